"""hybridflow_dask (DaskBackend, default call path) against verl's RayWorkerGroup, one run.

The cases of issue 8's target table, world size 2: no-op ONE_TO_ALL and RANK_ZERO calls,
DP_COMPUTE_PROTO identity round trips of 64 and 256 MiB (GB/s = 2 x bytes / time), a
64 MiB non-blocking chain A -> B on separate pools (2 + 2), backend + group of 2 ready
(from nothing to the first call answered, a fresh runtime each time; the first of them in
the driver process also on its own: our workers fork from a server that it starts, and
that serves the later ones) and back-to-back
non-blocking no-op calls with order kept (calls/s). Our side runs first, then verl's, so
the two runtimes never compete for the CPUs; every figure is a median of that one run
(7 timed repeats per case; each data size first gets two untimed calls, on both sides,
so that a median does not rest on the process's first touches of that much memory).

The no-op cases and the burst also say what CPU they took per rank call: the driver
process's (``time.process_time``: every thread of it, so our owned cluster's scheduler,
or Ray's core worker threads) and the ranks' processes' (``psutil``), over the whole
timed loop. CPU is far steadier than a median of wall times on a shared machine; Ray's
own daemons (raylet, GCS) are not counted on verl's side.

verl and ray come with the optional extra ``compare`` (``pip install -e '.[compare]'``);
without them only our side runs, with a message saying so. verl 0.9.1 has no predefined
``Dispatch.RANK_ZERO`` functions, so its RANK_ZERO case is ``Execute.RANK_ZERO``.

    python benchmarks/compare_verl.py [--quick] [--no-verl] [--tls] [--out DIR]

A full run writes ``benchmarks/results/compare_verl[_tls].json``; a ``--quick`` run or one
without verl's side writes into ``benchmarks/results/scratch/`` (ignored by git) unless
``--out`` names a folder.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import torch
from outdir import results_dir  # benchmarks/outdir.py, next to this script

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

MiB = 1 << 20
ROWS = 1024


# ---- the settings of one run ------------------------------------------------------------


@dataclass
class Plan:
    """How many repeats each case gets (``--quick`` shrinks them all)."""

    noop_calls: int = 200
    noop_warm: int = 20
    sizes_mib: list[int] = field(default_factory=lambda: [64, 256])
    data_warm: int = 2
    data_repeats: int = 7
    chain_mib: int = 64
    chain_repeats: int = 7
    ready_repeats: int = 3
    burst_calls: int = 300
    burst_repeats: int = 7

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            noop_calls=20,
            noop_warm=5,
            sizes_mib=[1],
            data_warm=1,
            data_repeats=3,
            chain_mib=1,
            chain_repeats=3,
            ready_repeats=1,
            burst_calls=50,
            burst_repeats=2,
        )


# ---- our side -----------------------------------------------------------------------------


class Bench(hf.Worker):
    """The same methods as verl's ``VerlBench`` below, on hybridflow_dask."""

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @hf.register(hf.Dispatch.RANK_ZERO)
    def noop_rank_zero(self) -> None:
        return None

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def noop_async(self) -> None:
        return None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: hf.DataProto) -> hf.DataProto:
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def identity_async(self, data: hf.DataProto) -> hf.DataProto:
        return data

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class Ours:
    """hybridflow_dask on an owned 4-worker DaskBackend with the default call path; with
    ``tls`` every comm of that cluster is ``tls://`` (a temporary certificate), and so
    is every socket lane. ``kind="ray"``: on an owned ``RayBackend`` instead (a local
    Ray instance; ``bench_dispatch.py --compare`` runs both)."""

    def __init__(self, tls: bool = False, kind: str = "dask") -> None:
        if kind not in ("dask", "ray") or (tls and kind != "dask"):
            raise ValueError(f"kind must be 'dask' or 'ray' (TLS only on dask), got {kind!r}")
        self.backend: Any = None
        self.call_path = "?"
        self.tls = tls
        self.kind = kind
        self.name = "hybridflow_dask" if kind == "dask" else "hybridflow_dask on Ray"

    def _new_backend(self, **dask_kwargs: Any) -> Any:
        if self.kind == "ray":
            from hybridflow_dask.backends.ray import RayBackend

            return RayBackend(log_to_driver=False)
        return DaskBackend(security=self.tls or None, **dask_kwargs)

    def start(self) -> None:
        self.backend = self._new_backend(n_workers=4)
        if self.kind == "ray":
            self.call_path = "Ray actor calls"
            return
        self.call_path = self.backend.call_path + (" over TLS" if self.tls else "")

    def stop(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
            self.backend = None

    def group(self) -> Any:
        return hf.WorkerGroup(hf.ResourcePool([2]), Bench, backend=self.backend)

    @staticmethod
    def data(tensor: torch.Tensor) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": tensor})

    @staticmethod
    def chain(a: Any, b: Any, data: hf.DataProto) -> hf.DataProto:
        return hf.get(b.identity_async(a.identity_async(data)))

    def burst(self, group: Any, calls: int) -> None:
        futures = [group.noop_async() for _ in range(calls)]
        self.backend.gather([f for fl in futures for f in fl])

    def ready(self) -> float:
        """From nothing to a group of 2 answering its first call: a fresh backend (for
        Ray, a fresh Ray instance too)."""
        start = time.perf_counter()
        backend = self._new_backend()
        try:
            group = hf.WorkerGroup(hf.ResourcePool([2]), Bench, backend=backend)
            group.noop()
            return time.perf_counter() - start
        finally:
            backend.shutdown()

    @staticmethod
    def shutdown_group(group: Any) -> None:
        group.shutdown()


# ---- verl's side --------------------------------------------------------------------------


def verl_available() -> str | None:
    """None when verl and ray import, else why not."""
    missing = [m for m in ("ray", "verl") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install -e '.[compare]')"
    try:
        from verl.single_controller.ray import RayWorkerGroup  # noqa: F401
    except Exception as exc:  # an import error deep in verl's dependencies
        return f"verl does not import: {type(exc).__name__}: {exc}"
    return None


def verl_worker_class() -> Any:
    """verl's bench worker, built only once verl imports (pickled by value to Ray)."""
    import ray
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, Execute, register

    class VerlBench(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
        def noop_rank_zero(self) -> None:
            return None

        @register(Dispatch.ONE_TO_ALL, blocking=False)
        def noop_async(self) -> None:
            return None

        @register(Dispatch.DP_COMPUTE_PROTO)
        def identity(self, data: Any) -> Any:
            return data

        @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def identity_async(self, data: Any) -> Any:
            return data

        @register(Dispatch.ONE_TO_ALL)
        def pid(self) -> int:
            return os.getpid()

    return ray.remote(VerlBench)


class Verl:
    """verl's RayWorkerGroup on a local Ray runtime (CPU only, one CPU per rank)."""

    name = "verl on Ray"

    def __init__(self) -> None:
        self.cls = verl_worker_class()

    @staticmethod
    def _init_ray() -> None:
        import ray

        ray.init(
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=False,
        )

    def start(self) -> None:
        self._init_ray()

    def stop(self) -> None:
        import ray

        ray.shutdown()

    def group(self) -> Any:
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayResourcePool,
            RayWorkerGroup,
        )

        # max_colocate_count=1: verl's default (10) asks each bundle for 10 CPUs
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        return RayWorkerGroup(pool, RayClassWithInitArgs(cls=self.cls))

    @staticmethod
    def data(tensor: torch.Tensor) -> Any:
        from verl import DataProto

        return DataProto.from_dict({"x": tensor})

    @staticmethod
    def chain(a: Any, b: Any, data: Any) -> Any:
        return b.identity_async(a.identity_async(data)).get()

    @staticmethod
    def burst(group: Any, calls: int) -> None:
        import ray

        futures = [group.noop_async() for _ in range(calls)]
        ray.get([f for refs in futures for f in refs])

    def ready(self) -> float:
        """From nothing to a group of 2 answering its first call: a fresh Ray runtime."""
        start = time.perf_counter()
        self._init_ray()
        try:
            group = self.group()
            group.noop()
            return time.perf_counter() - start
        finally:
            self.stop()

    @staticmethod
    def shutdown_group(group: Any) -> None:
        import ray

        for worker in getattr(group, "_workers", []):
            ray.kill(worker)


# ---- the cases ------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


class CpuMeter:
    """CPU seconds used by this (driver) process and by the ranks' processes."""

    def __init__(self, rank_pids: list[int]) -> None:
        self.ranks = sorted(set(rank_pids))

    def read(self) -> tuple[float, float]:
        return time.process_time(), sum(map(process_cpu, self.ranks))

    def per_rank_call(self, before: tuple[float, float], rank_calls: int) -> dict[str, float]:
        """µs of CPU per rank call since ``before``: the driver's and the ranks'."""
        driver, ranks = self.read()
        return {
            "driver_cpu_us_per_rank_call": (driver - before[0]) / rank_calls * 1e6,
            "ranks_cpu_us_per_rank_call": (ranks - before[1]) / rank_calls * 1e6,
        }


def process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` so far: to the nanosecond from each thread's
    ``/proc`` schedstat on Linux (``psutil`` counts clock ticks, 10 ms each, too coarse
    for a loop of short calls), else ``psutil``."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    total = 0
    for task in tasks.iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def summary(times: list[float], **extra: Any) -> dict:
    return {
        "median_s": statistics.median(times),
        "p90_s": percentile(times, 0.9),
        "repeats": len(times),
        "times_s": times,
        **extra,
    }


def run_side(side: Any, plan: Plan, log: Callable[[str], None]) -> dict[str, dict]:
    """Every case on one side; returns ``{case: summary}``."""
    results: dict[str, dict] = {}

    ready = [side.ready() for _ in range(plan.ready_repeats)]
    results["backend + group of 2 ready"] = summary(ready)
    # The first in this process on its own: ours starts the server its workers fork from
    # then (it lives as long as the driver), Ray its runtime every time.
    results["first backend + group of 2 ready"] = summary(ready[:1])
    log(f"{side.name}: ready {statistics.median(ready):.2f} s (first {ready[0]:.2f} s)")

    side.start()
    try:
        group = side.group()
        for _ in range(plan.noop_warm):
            group.noop()
            group.noop_rank_zero()
        pids = list(group.pid())
        cpu = CpuMeter(pids)
        for case, call, ranks in (
            ("no-op ONE_TO_ALL call", group.noop, len(pids)),
            ("no-op RANK_ZERO call", group.noop_rank_zero, 1),
        ):
            before = cpu.read()
            times = timed(call, plan.noop_calls)
            used = cpu.per_rank_call(before, plan.noop_calls * ranks)
            results[case] = summary(times, calls_per_s=1 / statistics.median(times), **used)
            log(f"{side.name}: {case} {statistics.median(times) * 1e3:.2f} ms, {_cpu(used)}")

        side.burst(group, 10)  # warm
        before = cpu.read()
        times = timed(lambda: side.burst(group, plan.burst_calls), plan.burst_repeats)
        used = cpu.per_rank_call(before, plan.burst_calls * plan.burst_repeats * len(pids))
        rate = plan.burst_calls / statistics.median(times)
        results["back-to-back non-blocking no-op calls"] = summary(
            times, calls=plan.burst_calls, calls_per_s=rate, **used
        )
        log(f"{side.name}: burst {rate:.0f} calls/s, {_cpu(used)}")

        group.identity(side.data(torch.randn(ROWS, 256)))  # warm
        for mib in plan.sizes_mib:
            tensor = torch.randn(ROWS, mib * MiB // (ROWS * 4))
            data = side.data(tensor)
            timed(lambda d=data: group.identity(d), plan.data_warm)  # first touches of memory
            times = timed(lambda d=data: group.identity(d), plan.data_repeats)
            nbytes = tensor.numel() * tensor.element_size()
            results[f"DP_COMPUTE_PROTO identity {mib} MiB"] = summary(
                times, bytes=nbytes, gb_per_s=2 * nbytes / statistics.median(times) / 1e9
            )
            log(f"{side.name}: identity {mib} MiB {statistics.median(times):.3f} s")
            del data, tensor
            gc.collect()

        consumer = side.group()
        try:
            tensor = torch.randn(ROWS, plan.chain_mib * MiB // (ROWS * 4))
            data = side.data(tensor)
            side.chain(group, consumer, side.data(torch.randn(ROWS, 256)))  # warm
            times = timed(lambda: side.chain(group, consumer, data), plan.chain_repeats)
            results[f"{plan.chain_mib} MiB chain A -> B, separate pools"] = summary(times)
            log(f"{side.name}: chain {statistics.median(times):.3f} s")
        finally:
            side.shutdown_group(consumer)
        side.shutdown_group(group)
    finally:
        side.stop()
    return results


def _cpu(used: dict[str, float]) -> str:
    return (
        f"CPU per rank call: driver {used['driver_cpu_us_per_rank_call']:.0f} µs, "
        f"ranks {used['ranks_cpu_us_per_rank_call']:.0f} µs"
    )


# (case, the value compared, whether higher is better)
def compared_value(case: str, result: dict) -> tuple[str, float, bool]:
    if "gb_per_s" in result:
        return "GB/s", result["gb_per_s"], True
    if case.startswith("back-to-back"):
        return "calls/s", result["calls_per_s"], True
    return "s", result["median_s"], False


def table(ours: dict[str, dict], verl: dict[str, dict] | None) -> list[dict]:
    rows = []
    for case, result in ours.items():
        unit, value, higher = compared_value(case, result)
        row: dict[str, Any] = {"case": case, "unit": unit, "ours": value, "verl": None}
        if verl and case in verl:
            other = compared_value(case, verl[case])[1]
            row["verl"] = other
            # > 1 means ours is better, whatever the unit
            row["ours_better_by"] = value / other if higher else other / value
        rows.append(row)
    return rows


def fmt(unit: str, value: float | None) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"
    return f"{value:.2f} {unit}" if unit == "GB/s" else f"{value:.0f} {unit}"


def cpu_rows(ours: dict[str, dict], verl: dict[str, dict] | None) -> list[dict]:
    """The CPU per rank call of the cases that measured it, both sides."""
    rows = []
    for case, result in ours.items():
        if "driver_cpu_us_per_rank_call" not in result:
            continue
        theirs = (verl or {}).get(case, {})
        rows.append(
            {
                "case": case,
                **{
                    f"{side}_{what}": part.get(f"{what}_cpu_us_per_rank_call")
                    for side, part in (("ours", result), ("verl", theirs))
                    for what in ("driver", "ranks")
                },
            }
        )
    return rows


def print_cpu_table(rows: list[dict]) -> None:
    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} µs"

    header = (
        f"{'CPU per rank call':42} {'ours: driver':>13} {'ranks':>8} "
        f"{'verl: driver':>13} {'ranks':>8}"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:42} {us(row['ours_driver']):>13} {us(row['ours_ranks']):>8} "
            f"{us(row['verl_driver']):>13} {us(row['verl_ranks']):>8}"
        )


def print_table(rows: list[dict], call_path: str) -> None:
    header = f"{'case':42} {'hybridflow_dask':>16} {'verl on Ray':>14} {'ours better by':>15}"
    print(f"\nmedians, world size 2; hybridflow_dask call path: {call_path}")
    print(header)
    print("-" * len(header))
    for row in rows:
        better = f"{row['ours_better_by']:.2f}x" if "ours_better_by" in row else "-"
        print(
            f"{row['case']:42} {fmt(row['unit'], row['ours']):>16} "
            f"{fmt(row['unit'], row['verl']):>14} {better:>15}"
        )


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("hybridflow-dask", "distributed", "torch", "verl", "ray"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 MiB data, few repeats")
    parser.add_argument("--no-verl", action="store_true", help="run our side only")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the JSON (default: results/, or results/scratch/ for a partial run)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="our cluster speaks only TLS (security=True)"
    )
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()

    def log(line: str) -> None:
        print(line, flush=True)

    why_not = "--no-verl given" if args.no_verl else verl_available()
    if why_not:
        print(f"verl side skipped: {why_not}; running hybridflow_dask only", flush=True)
    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    started = time.perf_counter()
    ours_side = Ours(tls=args.tls)
    ours = run_side(ours_side, plan, log)
    verl = run_side(Verl(), plan, log) if not why_not else None
    rows = table(ours, verl)
    print_table(rows, ours_side.call_path)
    cpu = cpu_rows(ours, verl)
    print_cpu_table(cpu)
    result = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "quick": args.quick,
            "world_size": 2,
            "call_path": ours_side.call_path,
            "tls": args.tls,
            "verl_skipped": why_not,
            "versions": versions(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "plan": plan.__dict__,
            "wall_s": time.perf_counter() - started,
            "load_avg_1m_start_end": [load_start, os.getloadavg()[0]],
        },
        "table": rows,
        "cpu_per_rank_call_us": cpu,
        "ours": ours,
        "verl": verl,
    }
    name = "compare_verl" + ("_tls" if args.tls else "") + ("_quick" if args.quick else "")
    out = results_dir(args.out, trial=args.quick or bool(why_not)) / f"{name}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
