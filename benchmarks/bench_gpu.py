"""GPU benchmark: what CUDA tensors cost on the Dask backend, against the same with CPU tensors.

Cases (each size: 64 MiB and 1 GiB of float32, medians of ``--repeats`` timed calls after
two untimed ones):

* ``noop``: a no-op blocking ONE_TO_ALL call on the GPU cluster (``DaskBackend()``, a
  LocalCUDACluster), one rank per GPU;
* ``dp round trip``: DP_COMPUTE_PROTO identity, the batch made in the driver on the GPU
  (``cuda``) or on the CPU (``cpu``); GB/s counts 2 x bytes / time (there and back);
* ``chain colocated``: ``B.consume(A.produce(...))`` on one pool (one process per GPU): A
  returns a batch it keeps, on the GPU or on the CPU, B returns one column; only the
  batch's trip from A to B is in the time (its copies at A's return and into B);
* ``chain 2 processes``: the same with A and B in two worker processes of one host (a
  plain LocalCluster of two workers that both see GPU 0), so the batch crosses a socket.

Every chain case runs on the host route (``hybridflow.device-transfer: host``, the
default) and on the device route (``device``; see README, GPU notes): on a tcp:// cluster
the device route keeps copies within a process on the device, and between processes
still moves host bytes.

``python benchmarks/bench_gpu.py [--sizes 64 1024] [--repeats 5] [--out FILE]`` prints a
table and writes JSON (default ``benchmarks/results/gpu.json``; ``--cpu`` and other partial
runs default to ``benchmarks/results/scratch/``, which git ignores), after every case, so a
run cut short keeps what it measured. ``--dry-run`` prints the plan and needs no GPU; without
a GPU the benchmark itself refuses (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from outdir import SCRATCH  # benchmarks/outdir.py, next to this script

import hybridflow_dask as hf

MiB = 1 << 20
COLS = 4096  # floats per row: 16 KiB rows
DEFAULT_OUT = Path(__file__).parent / "results" / "gpu.json"
WARMUP = 2


def plan(sizes: list[int], cpu_only: bool = False) -> list[dict[str, Any]]:
    """Every case the benchmark runs, in order (``cpu_only``: the script's own check)."""
    kinds = ("cpu",) if cpu_only else ("cpu", "cuda")
    routes = ("host",) if cpu_only else ("host", "device")
    cases: list[dict[str, Any]] = [{"case": "noop", "tensors": "-", "route": "host", "size_mib": 0}]
    for size in sizes:
        for tensors in kinds:
            cases.append(
                {"case": "dp round trip", "tensors": tensors, "route": "host", "size_mib": size}
            )
    for placement in ("chain colocated", "chain 2 processes"):
        for route in routes:
            for size in sizes:
                for tensors in kinds:
                    cases.append(
                        {"case": placement, "tensors": tensors, "route": route, "size_mib": size}
                    )
    return cases


# -- worker classes ------------------------------------------------------------------------


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: hf.DataProto) -> hf.DataProto:
        return data


class Producer(hf.Worker):
    """Returns a batch it keeps (one buffer per size and device), as a trainer returns its own."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[tuple[int, str], torch.Tensor] = {}

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, seeds: hf.DataProto) -> hf.DataProto:
        key = (len(seeds), seeds.meta_info["device"])
        if key not in self.kept:
            self.kept = {key: torch.ones(key[0], COLS, device=key[1])}
        return hf.DataProto.from_dict({"x": self.kept[key]})


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def consume(self, data: hf.DataProto) -> hf.DataProto:
        x = data.batch["x"]
        return hf.DataProto.from_dict(
            {"first": x[:, 0].cpu(), "on_cuda": torch.full((len(data),), x.is_cuda)}
        )


# -- measuring --------------------------------------------------------------------------


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float], nbytes: int, factor: int) -> dict[str, Any]:
    ordered = sorted(times)
    median = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    gbps = factor * nbytes / median / 1e9 if nbytes and median > 0 else None
    return {"median_s": median, "p90_s": p90, "gb_per_s": gbps, "repeats": len(times)}


@contextmanager
def gpu_backend(route: str, two_processes: bool) -> Iterator[Any]:
    from hybridflow_dask.backends import DaskBackend

    if not two_processes:
        with DaskBackend(device_transfer=route) as backend:
            yield backend
        return
    from distributed import LocalCluster

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as cluster,
        DaskBackend(cluster=cluster, device_transfer=route) as backend,
    ):
        yield backend


def run(args: argparse.Namespace) -> dict[str, Any]:
    gpus = 1 if args.cpu else torch.cuda.device_count()
    use_gpu = None if args.cpu else True
    result: dict[str, Any] = {"meta": meta(args, gpus), "rows": []}

    def record(case: dict[str, Any], times: list[float], nbytes: int, factor: int, **extra: Any):
        row = {**case, **summary(times, nbytes, factor), **extra}
        result["rows"].append(row)
        print(format_row(row), flush=True)
        write(result, args.out)

    print(header(), flush=True)
    cases = plan(args.sizes, args.cpu)
    with gpu_backend("host", two_processes=False) as backend:
        result["meta"]["cluster"] = backend.choice.kind if backend.choice else "given"
        echo = hf.WorkerGroup(hf.ResourcePool([gpus], use_gpu=use_gpu), Echo, backend=backend)
        for case in [c for c in cases if c["case"] in ("noop", "dp round trip")]:
            if case["case"] == "noop":
                record(case, timed(echo.noop, 200), 0, 1)
                continue
            rows = max(gpus, case["size_mib"] * MiB // (COLS * 4) // gpus * gpus)
            data = hf.DataProto.from_dict({"x": torch.ones(rows, COLS, device=case["tensors"])})
            nbytes = rows * COLS * 4
            out = echo.identity(data)
            assert out.batch["x"].device.type == case["tensors"], out.batch["x"].device
            record(case, timed(lambda d=data: echo.identity(d), args.repeats), nbytes, 2)
            del data, out
        echo.shutdown()
    for placement in ("chain colocated", "chain 2 processes"):
        for route in ("host", "device"):
            chosen = [c for c in cases if c["case"] == placement and c["route"] == route]
            if not chosen:
                continue
            with gpu_backend(route, two_processes=placement == "chain 2 processes") as backend:
                pool_a = hf.ResourcePool([1], use_gpu=use_gpu)
                pool_b = (
                    pool_a
                    if placement == "chain colocated"
                    else hf.ResourcePool([1], use_gpu=use_gpu)
                )
                a = hf.WorkerGroup(pool_a, Producer, backend=backend)
                b = hf.WorkerGroup(pool_b, Consumer, backend=backend)
                between = backend.transfer_route.between_workers
                for case in chosen:
                    rows = case["size_mib"] * MiB // (COLS * 4)
                    seeds = hf.DataProto.from_dict(
                        {"seed": torch.zeros(rows)}, meta_info={"device": case["tensors"]}
                    )

                    def chain(s: hf.DataProto = seeds, a: Any = a, b: Any = b) -> hf.DataProto:
                        return hf.get(b.consume(a.produce(s)))

                    arrived = chain()
                    on_cuda = bool(arrived.batch["on_cuda"].all())
                    assert on_cuda == (case["tensors"] == "cuda"), case
                    record(
                        case,
                        timed(chain, args.repeats),
                        rows * COLS * 4,
                        1,
                        between_workers=between,
                    )
                b.shutdown()
                a.shutdown()
    return result


# -- output -----------------------------------------------------------------------------


def header() -> str:
    names = ("case", "tensors", "route", "size", "median", "p90", "GB/s")
    widths = (-18, -7, -6, 8, 10, 10, 7)
    return " ".join(f"{n:<{-w}}" if w < 0 else f"{n:>{w}}" for n, w in zip(names, widths))


def format_row(row: dict[str, Any]) -> str:
    size = f"{row['size_mib']} MiB" if row["size_mib"] else "-"
    median = _duration(row["median_s"])
    p90 = _duration(row["p90_s"])
    gbps = f"{row['gb_per_s']:.2f}" if row.get("gb_per_s") else "-"
    return (
        f"{row['case']:<18} {row['tensors']:<7} {row['route']:<6} {size:>8} "
        f"{median:>10} {p90:>10} {gbps:>7}"
    )


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def meta(args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    import dask
    import distributed

    names = [] if args.cpu else [torch.cuda.get_device_name(i) for i in range(gpus)]
    return {
        "gpus": names,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "python": platform.python_version(),
        "sizes_mib": args.sizes,
        "repeats": args.repeats,
        "warmup": WARMUP,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], metavar="MIB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON file (default: results/gpu.json; results/scratch/ if partial)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run only the CPU-tensor, host-route cases with no GPU: a check of this script "
        "on any machine, not a GPU figure",
    )
    args = parser.parse_args(argv)
    if any(size < 1 for size in args.sizes) or args.repeats < 1:
        parser.error("sizes and repeats must be at least 1")
    if args.out is None:
        partial = args.cpu or (args.sizes, args.repeats) != ([64, 1024], 5)
        folder = SCRATCH if partial else DEFAULT_OUT.parent
        args.out = folder / DEFAULT_OUT.name
    if args.dry_run:
        cases = plan(args.sizes, args.cpu)
        print(
            f"bench_gpu plan: {len(cases)} cases, {args.repeats} timed repeats each "
            f"(+{WARMUP} untimed); JSON to {args.out}"
        )
        for case in cases:
            size = f"{case['size_mib']} MiB" if case["size_mib"] else "-"
            print(f"  {case['case']:<18} {case['tensors']:<5} {case['route']:<6} {size}")
        return 0
    reason = "" if args.cpu else _no_gpu_reason()
    if reason:
        print(f"bench_gpu: needs a CUDA GPU: {reason}; --dry-run prints the plan", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = run(args)
    result["meta"]["wall_s"] = time.perf_counter() - started
    write(result, args.out)
    print(f"wrote {args.out} ({result['meta']['wall_s']:.0f} s)")
    return 0


def _no_gpu_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver or no device)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
