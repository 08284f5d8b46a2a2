"""Every predefined dispatch mode, side by side: payload x world size x backend / call path.

Modes: RANK_ZERO, ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE, DP_COMPUTE_PROTO (rows divisible by
the world size, and with auto padding), DP_COMPUTE_PROTO_WITH_FUNC, DP_COMPUTE_METRIC and
an N-d mesh mode (``make_nd_compute_dataproto_dispatch_fn``: TP 2 inside each DP group,
collected from TP rank 0). Payloads 0, 1, 64 and 256 MiB (0 MiB: a no-op call, or a
DataProto of 1024 rows of zero-width tensors for the DataProto modes); world sizes 1, 2
and 4; backends ``local`` (in-process), ``dask-task`` and ``dask-direct`` (one
``DaskBackend(n_workers=4)`` per call path, chosen with ``hybridflow.call-path``; as many
workers as the largest world size asked for, so ``--quick`` starts 2).

Per case: median and p90 latency of a blocking call, throughput (2 x bytes / s for the
modes whose result carries the data back, bytes / s for the one-way ones), bytes through
the driver as the backend counts them (``DaskBackend.driver_bytes``: what it scattered and
gathered; arguments that ride inside the call message are not counted: small ones on the
task path, all of them on the direct path) and the bytes each rank's method was given
(``dask.sizeof``, measured on the worker).

    python benchmarks/bench_dispatch.py [--quick] [--plot] [--worlds 1 2 4] [--sizes 0 1 64 256]

``--compare`` instead runs the backends side by side on ``compare_verl.py``'s cases (world
size 2: no-op calls, a DP_COMPUTE_PROTO 64 MiB round trip, a non-blocking 64 MiB chain
between two groups, back-to-back non-blocking calls, backend + group ready): the same
driver code on ``DaskBackend`` and ``RayBackend``, and verl's own ``RayWorkerGroup`` where
verl is installed (``--no-verl`` leaves it out). One side runs at a time; it prints a
table and writes ``results/backends.json``:

    python benchmarks/bench_dispatch.py --compare [--quick] [--no-verl]

Only a full run writes into ``benchmarks/results/`` (``dispatch.json``, ``backends.json``);
``--quick``, a subset (``--worlds``, ``--sizes``, ``--backends``, ``--modes``,
``--repeats``) or a side left out writes into ``benchmarks/results/scratch/``, which git
ignores, unless ``--out DIR`` names a folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dask
import dask.config
import torch
from dask.sizeof import sizeof
from outdir import results_dir  # benchmarks/outdir.py, next to this script

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, LocalBackend

MiB = 1 << 20
ROWS = 1024
MESH = "bench-mesh"
BACKENDS = ("local", "dask-task", "dask-direct")


def _identity(data: Any) -> Any:
    """The function DP_COMPUTE_PROTO_WITH_FUNC ships to every rank."""
    return data


class DispatchBench(hf.Worker):
    """One method per mode; each records what it was given, so sizes are the worker's view."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[int] = []
        tp = 2 if self.world_size >= 2 else 1
        self._register_dispatch_collect_info(MESH, self.rank // tp, self.rank % tp == 0)

    def _took(self, data: Any) -> None:
        self.received.append(0 if data is None else int(sizeof(data)))

    @hf.register(hf.Dispatch.RANK_ZERO)
    def rank_zero(self, data: Any = None) -> None:
        self._took(data)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def one_to_all(self, data: Any = None) -> None:
        self._took(data)

    @hf.register(hf.Dispatch.ALL_TO_ALL)
    def all_to_all(self, data: Any = None) -> Any:
        self._took(data)
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE)
    def dp_compute(self, data: Any = None) -> Any:
        self._took(data)
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def dp_proto(self, data: hf.DataProto) -> hf.DataProto:
        self._took(data)
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def dp_proto_func(self, func: Callable[..., Any], data: hf.DataProto) -> hf.DataProto:
        self._took(data)
        return func(data)

    @hf.register(hf.Dispatch.DP_COMPUTE_METRIC)
    def dp_metric(self, data: hf.DataProto) -> dict[str, int]:
        self._took(data)
        return {"rows": len(data)}

    @hf.register(dispatch_mode=hf.make_nd_compute_dataproto_dispatch_fn(MESH))
    def nd_mesh(self, data: hf.DataProto) -> hf.DataProto:
        self._took(data)
        return data

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def take_received(self) -> list[int]:
        taken, self.received = self.received, []
        return taken


@dataclass(frozen=True)
class Mode:
    """One benchmarked mode: the method to call and how its arguments are built."""

    name: str
    method: str
    kind: str  # "any": one object; "per-rank": a list of chunks; "proto": one DataProto
    round_trip: bool  # whether the result brings the data back to the driver
    padded: bool = False


MODES = [
    Mode("RANK_ZERO", "rank_zero", "any", round_trip=False),
    Mode("ONE_TO_ALL", "one_to_all", "any", round_trip=False),
    Mode("ALL_TO_ALL", "all_to_all", "per-rank", round_trip=True),
    Mode("DP_COMPUTE", "dp_compute", "per-rank", round_trip=True),
    Mode("DP_COMPUTE_PROTO", "dp_proto", "proto", round_trip=True),
    Mode("DP_COMPUTE_PROTO padded", "dp_proto", "proto", round_trip=True, padded=True),
    Mode("DP_COMPUTE_PROTO_WITH_FUNC", "dp_proto_func", "proto", round_trip=True),
    Mode("DP_COMPUTE_METRIC", "dp_metric", "proto", round_trip=False),
    Mode("ND mesh (tp=2)", "nd_mesh", "proto", round_trip=True),
]


def make_payload(mib: int, padded: bool) -> hf.DataProto:
    """1024 rows (1023 with padding, so world sizes 2 and 4 need it) of float32 columns."""
    rows = ROWS - 1 if padded else ROWS
    width = mib * MiB // (ROWS * 4)
    return hf.DataProto.from_dict({"x": torch.randn(rows, width)}, auto_padding=padded)


def payload_bytes(data: Any) -> int:
    if isinstance(data, hf.DataProto):
        return sum(t.numel() * t.element_size() for t in data.batch.values())
    return 0


def call_args(mode: Mode, mib: int, world: int) -> tuple[tuple, int]:
    """The call's positional arguments and the payload bytes they carry (built untimed)."""
    if mode.kind == "any":
        if mib == 0:
            return (), 0
        data = make_payload(mib, False)
        return (data,), payload_bytes(data)
    if mode.kind == "per-rank":
        if mib == 0:
            return ([None] * world,), 0
        data = make_payload(mib, False)
        chunks = [c.clone() if hasattr(c, "clone") else c for c in data.chunk(world)]
        return (chunks,), payload_bytes(data)
    data = make_payload(mib, mode.padded)
    args: tuple = (_identity, data) if mode.method == "dp_proto_func" else (data,)
    return args, payload_bytes(data)


def repeats_for(mib: int, repeats: int) -> int:
    """Fewer repeats as payloads grow, so the full sweep fits in minutes on 2 cores."""
    if mib == 0:
        return repeats
    if mib <= 1:
        return max(3, repeats // 2)
    if mib <= 64:
        return max(3, min(repeats, 5))
    return 3


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)
    return ordered[max(index, 0)]


def driver_bytes(backend: Any) -> int | None:
    counts = getattr(backend, "driver_bytes", None)
    return int(counts["scattered"] + counts["gathered"]) if counts is not None else None


def run_case(group: Any, backend: Any, name: str, mode: Mode, mib: int, repeats: int) -> dict:
    world = group.world_size
    args, nbytes = call_args(mode, mib, world)
    method = getattr(group, mode.method)
    method(*args)  # warm: first-call costs (pickling the class's methods, routes) stay out
    group.take_received()
    before = driver_bytes(backend)
    reps = repeats_for(mib, repeats)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        method(*args)
        times.append(time.perf_counter() - start)
    after = driver_bytes(backend)
    received = group.take_received()
    median = statistics.median(times)
    moved = nbytes * (2 if mode.round_trip else 1)
    del args
    gc.collect()
    return {
        "backend": name,
        "call_path": getattr(backend, "call_path", "inline"),
        "mode": mode.name,
        "world_size": world,
        "payload_mib": mib,
        "payload_bytes": nbytes,
        "round_trip": mode.round_trip,
        "repeats": reps,
        "median_s": median,
        "p90_s": percentile(times, 0.9),
        "calls_per_s": 1 / median,
        "throughput_gb_per_s": moved / median / 1e9 if moved else None,
        "driver_bytes_per_call": (after - before) // reps if after is not None else None,
        "rank_received_bytes_per_call": [sum(r) // reps for r in received],
    }


@contextmanager
def open_backend(name: str, n_workers: int) -> Iterator[Any]:
    """One backend per name: LocalBackend, or an owned DaskBackend on a call path."""
    if name == "local":
        with LocalBackend() as backend:
            yield backend
        return
    path = name.removeprefix("dask-")
    with (
        dask.config.set({"hybridflow.call-path": path}),
        DaskBackend(n_workers=n_workers) as backend,
    ):
        live = getattr(backend, "call_path", path)
        if live != path:
            print(f"note: asked for call path {path!r}, the backend runs {live!r}")
        yield backend


def run_backend(
    name: str, args: argparse.Namespace, modes: list[Mode], phases: dict[str, float]
) -> list[dict]:
    rows: list[dict] = []
    start = time.perf_counter()
    # as many workers as the largest group needs (4 for the full sweep): --quick starts 2
    with open_backend(name, max(args.worlds)) as backend:
        phases[f"{name} start"] = time.perf_counter() - start
        start = time.perf_counter()
        for world in args.worlds:
            group = hf.WorkerGroup(
                hf.ResourcePool([world]),
                DispatchBench,
                backend=backend,
                name_prefix=f"bench-{name}-w{world}",
            )
            try:
                for _ in range(5):
                    group.one_to_all()
                for mode in modes:
                    for mib in args.sizes:
                        row = run_case(group, backend, name, mode, mib, args.repeats)
                        rows.append(row)
                        print_row(row, flush=True)
            finally:
                group.shutdown()
        phases[f"{name} cases"] = time.perf_counter() - start
        start = time.perf_counter()
    phases[f"{name} stop"] = time.perf_counter() - start
    return rows


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


HEADER = (
    f"{'backend':11} {'mode':27} {'w':>1} {'MiB':>4} {'median':>10} {'p90':>10} "
    f"{'rate':>12} {'driver MiB':>10}  rank in MiB"
)


def print_row(row: dict, flush: bool = False) -> None:
    rate = (
        f"{row['throughput_gb_per_s']:.2f} GB/s"
        if row["throughput_gb_per_s"]
        else f"{row['calls_per_s']:.0f} call/s"
    )
    driver = row["driver_bytes_per_call"]
    driver_s = "-" if driver is None else f"{driver / MiB:.1f}"
    ranks = " ".join(f"{b / MiB:.1f}" for b in row["rank_received_bytes_per_call"])
    print(
        f"{row['backend']:11} {row['mode']:27} {row['world_size']:>1} {row['payload_mib']:>4} "
        f"{fmt_s(row['median_s']):>10} {fmt_s(row['p90_s']):>10} {rate:>12} {driver_s:>10}  "
        f"{ranks}",
        flush=flush,
    )


def plot(rows: list[dict], path: Path) -> bool:
    """Median latency per mode, one panel per payload, bars per backend and world size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    sizes = sorted({r["payload_mib"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = sorted({(r["backend"], r["world_size"]) for r in rows})
    colors = {"local": "#dd8452", "dask-task": "#8172b3", "dask-direct": "#4c72b0"}
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    tall = 1.5 + 0.12 * len(modes) * max(len(series), 3)
    fig, axes = plt.subplots(
        1, len(sizes), figsize=(4.5 * len(sizes) + 2, tall), sharey=True, layout="constrained"
    )
    axes = [axes] if len(sizes) == 1 else list(axes)
    height = 0.8 / max(len(series), 1)
    for ax, mib in zip(axes, sizes):
        for i, (backend, world) in enumerate(series):
            index = {
                r["mode"]: r["median_s"] * 1e3
                for r in rows
                if r["payload_mib"] == mib and r["backend"] == backend and r["world_size"] == world
            }
            ys = [m + i * height for m in range(len(modes)) if modes[m] in index]
            xs = [index[m] for m in modes if m in index]
            alpha = 0.4 + 0.6 * world / max(w for _, w in series)
            ax.barh(ys, xs, height, color=colors.get(backend, "gray"), alpha=alpha)
            ax.plot([], [], color=colors.get(backend, "gray"), alpha=alpha, lw=6)
        ax.set_yticks([m + 0.4 - height / 2 for m in range(len(modes))], modes, fontsize=7)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("median ms (lower is better)")
        ax.set_title(f"{mib} MiB payload")
    axes[0].invert_yaxis()  # the axes share y: once flips them all
    fig.legend(
        [f"{b} w={w}" for b, w in series],
        fontsize=8,
        loc="outside lower center",
        ncol=min(len(series), 6),
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- --compare: the backends side by side -----------------------------------------------

#: ``--compare``'s sides: (key in the JSON, column title).
SIDES = (("dask", "DaskBackend"), ("ray", "RayBackend"), ("verl", "verl RayWorkerGroup"))


def compare_backends(args: argparse.Namespace) -> None:
    """``compare_verl.py``'s cases on each side (its code, not a copy), one after another."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import importlib.util

    import compare_verl as cv

    plan = cv.Plan.quick() if args.quick else cv.Plan(sizes_mib=[64])
    skipped: dict[str, str] = {}
    sides: list[tuple[str, Any]] = [("dask", cv.Ours(kind="dask"))]
    if importlib.util.find_spec("ray") is None:
        skipped["ray"] = "ray is not installed (pip install -e '.[ray]')"
    else:
        sides.append(("ray", cv.Ours(kind="ray")))
    why_not = "--no-verl given" if args.no_verl else cv.verl_available()
    if why_not:
        skipped["verl"] = why_not
    else:
        sides.append(("verl", cv.Verl()))
    for key, why in skipped.items():
        print(f"{key} side skipped: {why}", flush=True)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    results = {
        key: cv.run_side(side, plan, lambda line: print(line, flush=True)) for key, side in sides
    }
    rows = compare_table(results, cv.compared_value)
    print_compare(rows)
    stem = "backends_quick" if args.quick else "backends"
    args.out = results_dir(args.out, trial=args.quick or bool(skipped))
    out = args.out / f"{stem}.json"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "world_size": 2,
        "skipped": skipped,
        "versions": cv.versions(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "plan": plan.__dict__,
        "wall_s": time.perf_counter() - started,
        "load_avg_1m_start_end": [load_start, os.getloadavg()[0]],
    }
    out.write_text(json.dumps({"meta": meta, "table": rows, "sides": results}, indent=2))
    print(f"wrote {out}")


def compare_table(results: dict[str, dict], value_of: Callable[..., Any]) -> list[dict]:
    """One row per case: the compared value (and its unit) on every side that ran it."""
    rows = []
    for case, first in next(iter(results.values())).items():
        unit, _, higher = value_of(case, first)
        row: dict[str, Any] = {"case": case, "unit": unit, "higher_is_better": higher}
        for key, _ in SIDES:
            found = results.get(key, {}).get(case)
            row[key] = value_of(case, found)[1] if found is not None else None
        rows.append(row)
    return rows


def print_compare(rows: list[dict]) -> None:
    header = f"{'case':42}" + "".join(f" {title:>20}" for _, title in SIDES)
    print("\nmedians, world size 2 (one side at a time, on this machine)")
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = "".join(f" {fmt_value(row['unit'], row[key]):>20}" for key, _ in SIDES)
        print(f"{row['case']:42}{cells}")


def fmt_value(unit: str, value: float | None) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return fmt_s(value)
    return f"{value:.2f} {unit}" if unit == "GB/s" else f"{value:.0f} {unit}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="world 2, 0 and 1 MiB, 5 repeats")
    parser.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 1, 64, 256], help="MiB")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--modes", nargs="+", help="mode names to keep (default: all)")
    parser.add_argument("--repeats", type=int, default=30, help="repeats of 0 MiB calls")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the JSON (default: results/, or results/scratch/ for a partial run)",
    )
    parser.add_argument("--replot", type=Path, help="only draw the PNG of a results JSON")
    parser.add_argument(
        "--compare", action="store_true", help="DaskBackend vs RayBackend vs verl (see above)"
    )
    parser.add_argument("--no-verl", action="store_true", help="--compare without verl's side")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.sizes, args.repeats = [2], [0, 1], 5
    if any(w > 4 or w < 1 for w in args.worlds):
        parser.error("world sizes must be 1 to 4 (the DaskBackend has 4 workers)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        compare_backends(args)
        return
    if args.replot:
        png = args.replot.with_suffix(".png")
        if plot(json.loads(args.replot.read_text())["rows"], png):
            print(f"wrote {png}")
        return
    modes = [m for m in MODES if not args.modes or m.name in args.modes]
    if not modes:
        raise SystemExit(f"no mode matches {args.modes}; known: {[m.name for m in MODES]}")
    full = (args.worlds, args.sizes, args.repeats) == ([1, 2, 4], [0, 1, 64, 256], 30)
    partial = args.quick or not full or args.backends != list(BACKENDS) or bool(args.modes)
    args.out = results_dir(args.out, trial=partial)
    stem = "dispatch_quick" if args.quick else "dispatch"
    print(HEADER)
    print("-" * len(HEADER))
    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    started = time.perf_counter()
    rows: list[dict] = []
    phases: dict[str, float] = {}
    for name in args.backends:
        rows += run_backend(name, args, modes, phases)
    result = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "quick": args.quick,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "dask": dask.__version__,
            "hybridflow_dask": getattr(hf, "__version__", None),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "worlds": args.worlds,
            "sizes_mib": args.sizes,
            "backends": args.backends,
            "wall_s": time.perf_counter() - started,
            "load_avg_1m_start_end": [load_start, os.getloadavg()[0]],
            "phases_s": phases,
        },
        "rows": rows,
    }
    out = args.out / f"{stem}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if args.plot and plot(rows, args.out / f"{stem}.png"):
        print(f"wrote {args.out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
