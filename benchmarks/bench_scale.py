"""Dispatch at many ranks: what one group call costs as the world grows to 256 ranks.

For each world size (``--worlds``, default 1 8 16 32 64 128 256) and each layout:

- ``hosts``: namespace hosts (``hybridflow_dask.testing.hosts``, needs root) of
  ``--per-host`` light ranks each (one worker process per host hosting them all,
  ``DaskBackend(ranks_per_worker=...)``); the scheduler runs on a host of its own;
- ``local``: the same worker processes on one loopback cluster (the scheduler in the
  driver's process, so its CPU counts as the driver's);

and each dispatch: ``grouped`` (the default: one message per worker process carrying its
ranks' parts) and ``flat`` (``hybridflow.group-messages: false``, one message per rank),
it measures a blocking no-op ``ONE_TO_ALL`` group call (median of ``--calls``):

- ``latency``: the call, from the driver's side;
- ``driver CPU``: the driver process's CPU per call (``time.process_time``: every
  thread, the in-process scheduler's too on ``local``);
- ``caller CPU``: the calling thread's alone (``time.thread_time``): what the call itself
  costs the driver, without its other threads' work, so it moves less with the load;
- ``last start``: from the call to the latest rank's method start (the same clock: all
  hosts are on one machine);
- ``driver bytes``: what crossed the driver's link per call (``hosts`` layout only);
- ``scheduler CPU``: the scheduler process's CPU per call, dashboard records included
  (``hosts`` layout only: ``local`` runs it in the driver);

and a non-blocking no-op ``ONE_TO_ALL`` group call waited for at once (``hf.get``; verl:
``ray.get``): its median (``non-block ms``) and the driver process's CPU per call (``its
driver us``), the results' bookkeeping and the wait included; and a ``DP_COMPUTE_PROTO``
call returning its rows, on a ``DataProto`` of 4 rows of 16 floats per rank (the few rows
each rank gets of a batch split among hundreds), blocking (``DP ms``, ``DP driver us``)
and non-blocking waited for at once (``DP nb ms``, ``its driver us``): the split, every
part's packing and reading, and the join, which grow with the ranks however the messages
travel.

``--verl`` adds verl's ``RayWorkerGroup`` (one Ray actor process per rank) at the world
sizes up to ``--verl-max`` (default 16: a process per rank is what fits on 2 cores).
Prints a table and writes ``bench_scale.json`` (and ``bench_scale.png``, latency and
driver CPU against world size) into ``benchmarks/results/`` (``--quick`` into
``results/scratch/``)::

    sudo .venv/bin/python benchmarks/bench_scale.py [--quick] [--layouts hosts local]
                                                      [--worlds 8 64 256] [--verl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dask
import psutil
import torch
from outdir import results_dir  # benchmarks/outdir.py, next to this script

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.testing.hosts import Hosts, missing

#: The world sizes of a full run (1: the one-rank call the others are compared with).
DEFAULT_WORLDS = (1, 8, 16, 32, 64, 128, 256)


class Scale(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def started(self) -> float:
        return time.time()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def noop_later(self) -> None:
        return None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def rows(self, data: hf.DataProto) -> hf.DataProto:
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows_later(self, data: hf.DataProto) -> hf.DataProto:
        return data


#: Rows per rank, and floats per row, of the DataProto calls.
ROWS_PER_RANK, ROW_FLOATS = 4, 16


def _cpu_of(pid: int) -> float:
    """Seconds of CPU process ``pid`` and its descendants (a host's launcher runs the
    scheduler as its child, in a PID namespace) used so far."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += times.user + times.system
    return total


def measure(
    group: Any,
    calls: int,
    warm: int,
    hosts: Hosts | None,
    data: Any,
    get: Callable[[Any], Any] = hf.get,
) -> dict[str, float]:
    """Medians of ``calls`` blocking no-op calls, and what one call costs around them;
    then of ``calls`` non-blocking ones, each waited for with ``get``; then of a fifth as
    many ``DP_COMPUTE_PROTO`` calls on ``data``, blocking and not."""
    for _ in range(warm):
        group.noop()
        get(group.noop_later())
    scheduler = hosts.scheduler if hosts else None
    scheduler_pid = scheduler.process.pid if scheduler and scheduler.process else None
    scheduler_before = _cpu_of(scheduler_pid) if scheduler_pid else 0.0
    link_before = hosts.driver_bytes() if hosts else None
    cpu_before, caller_before = time.process_time(), time.thread_time()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        group.noop()
        times.append(time.perf_counter() - start)
    caller = (time.thread_time() - caller_before) / calls
    cpu = (time.process_time() - cpu_before) / calls
    out: dict[str, float] = {
        "latency_ms": statistics.median(times) * 1e3,
        "driver_cpu_us": cpu * 1e6,
        "caller_cpu_us": caller * 1e6,
    }
    if hosts is not None and link_before is not None:
        after = hosts.driver_bytes()
        moved = sum(after[k] - link_before[k] for k in after)
        out["driver_bytes_per_call"] = moved / calls
    if scheduler_pid:
        out["scheduler_cpu_us"] = (_cpu_of(scheduler_pid) - scheduler_before) / calls * 1e6
    cpu_before, times = time.process_time(), []
    for _ in range(calls):
        start = time.perf_counter()
        get(group.noop_later())
        times.append(time.perf_counter() - start)
    out["later_ms"] = statistics.median(times) * 1e3
    out["later_driver_cpu_us"] = (time.process_time() - cpu_before) / calls * 1e6
    lags = []
    for _ in range(max(5, calls // 5)):
        sent = time.time()
        lags.append(max(group.started()) - sent)
    out["last_start_ms"] = statistics.median(lags) * 1e3
    for name, call in (("dp", group.rows), ("dp_later", lambda d: get(group.rows_later(d)))):
        for _ in range(max(1, warm // 2)):
            call(data)
        cpu_before, times = time.process_time(), []
        for _ in range(max(5, calls // 5)):
            start = time.perf_counter()
            call(data)
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = statistics.median(times) * 1e3
        out[f"{name}_driver_cpu_us"] = (time.process_time() - cpu_before) / len(times) * 1e6
    return out


def _rows(cls: Any, world: int) -> Any:
    """A batch of ``ROWS_PER_RANK`` rows per rank for ``cls`` (ours or verl's DataProto)."""
    return cls.from_dict({"x": torch.randn(ROWS_PER_RANK * world, ROW_FLOATS)})


@contextmanager
def ours(layout: str, world: int, per_host: int, group_messages: bool) -> Iterator[tuple]:
    """A group of ``world`` light ranks, ``per_host`` to a host (one process each)."""
    processes = max(1, -(-world // per_host))
    per = min(world, per_host)
    settings = {"hybridflow.fresh-processes": False, "hybridflow.group-messages": group_messages}
    with dask.config.set(settings):
        if layout == "hosts":
            with (
                Hosts(processes) as hosts,
                DaskBackend(address=hosts.scheduler_address, ranks_per_worker=per) as backend,
            ):
                yield _group(backend, [per] * processes), hosts  # a node entry per host
        else:
            with DaskBackend(n_workers=processes, ranks_per_worker=per) as backend:
                yield _group(backend, [world]), None


def _group(backend: DaskBackend, process_on_nodes: list[int]) -> Any:
    pool = hf.ResourcePool(process_on_nodes)
    return hf.WorkerGroup(pool, hf.ClassWithInitArgs(Scale), backend=backend)


def _verl_get(x: Any) -> Any:
    """A verl non-blocking call's result: its ``DataProtoFuture``'s, or its Ray refs'."""
    import ray

    return ray.get(x) if isinstance(x, list) else x.get()


def verl_side(world: int, calls: int, warm: int) -> dict[str, float]:
    """verl's RayWorkerGroup of ``world`` actors on a local Ray runtime."""
    import ray
    from verl import DataProto as VerlDataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    class VerlScale(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(Dispatch.ONE_TO_ALL)
        def started(self) -> float:
            return time.time()

        @register(Dispatch.ONE_TO_ALL, blocking=False)
        def noop_later(self) -> None:
            return None

        @register(Dispatch.DP_COMPUTE_PROTO)
        def rows(self, data: Any) -> Any:
            return data

        @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def rows_later(self, data: Any) -> Any:
            return data

    ray.init(
        num_cpus=world,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        configure_logging=False,
    )
    try:
        pool = RayResourcePool([world], use_gpu=False, max_colocate_count=1)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(VerlScale)))
        return measure(group, calls, warm, None, _rows(VerlDataProto, world), _verl_get)
    finally:
        ray.shutdown()


def run(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    rows = []
    for layout in args.layouts:
        for world in args.worlds:
            for dispatch in args.dispatch:
                log(f"{layout} {world} ranks, {dispatch} ...")
                with ours(layout, world, args.per_host, dispatch == "grouped") as (group, hosts):
                    result = measure(
                        group, args.calls, args.warm, hosts, _rows(hf.DataProto, world)
                    )
                processes = max(1, -(-world // args.per_host))
                rows.append(
                    {
                        "side": "ours",
                        "layout": layout,
                        "dispatch": dispatch,
                        "world": world,
                        "processes": processes,
                        **result,
                    }
                )
                log(f"  {result}")
    if args.verl:
        for world in [w for w in args.worlds if w <= args.verl_max]:
            log(f"verl {world} ranks ...")
            result = verl_side(world, args.calls, args.warm)
            rows.append(
                {
                    "side": "verl",
                    "layout": "local",
                    "dispatch": "per rank",
                    "world": world,
                    "processes": world,
                    **result,
                }
            )
            log(f"  {result}")
    return rows


COLUMNS = [
    ("latency_ms", "latency ms", "{:.2f}"),
    ("driver_cpu_us", "driver CPU us", "{:.0f}"),
    ("caller_cpu_us", "caller CPU us", "{:.0f}"),
    ("last_start_ms", "last start ms", "{:.2f}"),
    ("driver_bytes_per_call", "driver B/call", "{:.0f}"),
    ("scheduler_cpu_us", "sched CPU us", "{:.0f}"),
    ("later_ms", "non-block ms", "{:.2f}"),
    ("later_driver_cpu_us", "its driver us", "{:.0f}"),
    ("dp_ms", "DP ms", "{:.2f}"),
    ("dp_driver_cpu_us", "DP driver us", "{:.0f}"),
    ("dp_later_ms", "DP nb ms", "{:.2f}"),
    ("dp_later_driver_cpu_us", "its driver us", "{:.0f}"),
]


def print_table(rows: list[dict]) -> None:
    head = f"{'side':5} {'layout':6} {'dispatch':9} {'world':>5} {'procs':>5}"
    print("\n" + head + "".join(f" {title:>14}" for _, title, _ in COLUMNS))
    for row in rows:
        line = (
            f"{row['side']:5} {row['layout']:6} {row['dispatch']:9} {row['world']:>5} "
            f"{row['processes']:>5}"
        )
        for key, _, form in COLUMNS:
            line += f" {form.format(row[key]) if key in row else '-':>14}"
        print(line)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, cpu) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(f"{row['side']} {row['layout']} {row['dispatch']}", []).append(row)
    for name, points in series.items():
        worlds = [p["world"] for p in points]
        lat.plot(worlds, [p["latency_ms"] for p in points], marker="o", label=name)
        cpu.plot(worlds, [p["driver_cpu_us"] / 1e3 for p in points], marker="o", label=name)
    for axis, title in ((lat, "no-op group call, ms"), (cpu, "driver CPU per call, ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("world size (ranks)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="worlds 8 and 64, 20 calls")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULT_WORLDS))
    parser.add_argument(
        "--layouts", nargs="+", default=["hosts", "local"], choices=["hosts", "local"]
    )
    parser.add_argument(
        "--dispatch", nargs="+", default=["grouped", "flat"], choices=["grouped", "flat"]
    )
    parser.add_argument("--per-host", type=int, default=32, help="light ranks per host")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--verl", action="store_true", help="also verl's RayWorkerGroup")
    parser.add_argument("--verl-max", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.calls, args.warm = [8, 64], 20, 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "hosts" in args.layouts and (why := missing()) is not None:
        print(f"no namespace hosts ({why}): the local layout only", file=sys.stderr)
        args.layouts = [layout for layout in args.layouts if layout != "hosts"]
    rows = run(args, lambda text: print(text, file=sys.stderr, flush=True))
    print_table(rows)
    out = results_dir(args.out, trial=args.quick or args.worlds != list(DEFAULT_WORLDS))
    record = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": os.getloadavg(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    path = out / "bench_scale.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    plot(rows, out / "bench_scale.png")
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
