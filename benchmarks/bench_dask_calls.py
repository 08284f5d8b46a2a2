"""Call latency and data movement of WorkerGroups on the Dask backend (world size 2).

Cases: no-op ONE_TO_ALL and RANK_ZERO latency, back-to-back non-blocking call rate,
DP_COMPUTE_PROTO identity round trips of 64 and 256 MiB, and a 64 MiB chain between two
groups (separate pools, and the same pool). For each case it reports the median time,
effective throughput, bytes through the driver and bytes each rank received (its method's
input, and what its worker pulled from other workers). LocalBackend rows are the
in-process reference. Prints a table; writes JSON and a PNG next to this file.

    python benchmarks/bench_dask_calls.py [--repeats 5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from dask.sizeof import sizeof

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, LocalBackend

MiB = 1 << 20


class Bench(hf.Worker):
    def __init__(self) -> None:
        self.received: list[int] = []

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
        self.received.append(sizeof(data))
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def identity_async(self, data: hf.DataProto) -> hf.DataProto:
        self.received.append(sizeof(data))
        return data

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def take_received(self) -> list[int]:
        taken, self.received = self.received, []
        return taken


def payload(mib: int) -> hf.DataProto:
    rows = 1024
    width = mib * MiB // (rows * 4)
    return hf.DataProto.from_dict({"x": torch.randn(rows, width)})


def pulled_bytes(backend: Any) -> dict[str, int]:
    """Bytes each worker fetched from other workers so far (Dask's transfer log)."""
    if not isinstance(backend, DaskBackend):
        return {}

    def total(dask_worker: Any) -> int:
        return int(sum(t["total"] for t in dask_worker.transfer_incoming_log))

    return backend.client.run(total)


def driver_bytes(backend: Any) -> int:
    counts = getattr(backend, "driver_bytes", None)
    return int(counts["scattered"] + counts["gathered"]) if counts else 0


def wait_done(backend: Any, futures: list[Any]) -> None:
    """Wait until futures are computed, without bringing their data to the driver."""
    if isinstance(backend, DaskBackend):
        from distributed import wait

        with backend.client.as_current():
            wait(futures)


def timed(fn: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def per_rank(group: Any, backend: Any, before: dict[str, int], calls: int) -> list[dict]:
    """Per call: what each rank's method was given, what its worker pulled from others."""
    after = pulled_bytes(backend)
    received = [sum(sizes) // calls for sizes in group.take_received()]
    return [
        {
            "rank": rank,
            "method_input_bytes": received[rank],
            "pulled_from_workers_bytes": (after.get(slot.address, 0) - before.get(slot.address, 0))
            // calls,
        }
        for rank, slot in enumerate(group._rank_slots())
    ]


def run_backend(
    name: str, backend: Any, repeats: int, sizes: list[int], chain_mib: int
) -> list[dict]:
    rows: list[dict] = []
    pool = hf.ResourcePool([2])
    group = hf.WorkerGroup(pool, Bench, backend=backend, name_prefix=f"bench-{name}")
    try:
        for _ in range(20):
            group.noop()
        for label, call in (
            ("noop ONE_TO_ALL", group.noop),
            ("noop RANK_ZERO", group.noop_rank_zero),
        ):
            times = timed(call, 200)
            med = statistics.median(times)
            rows.append({"backend": name, "case": label, "median_s": med, "calls_per_s": 1 / med})
        start = time.perf_counter()
        futures = [group.noop_async() for _ in range(300)]
        hf.get(futures[-1])
        backend.gather([f for fl in futures for f in fl])
        elapsed = time.perf_counter() - start
        rows.append(
            {
                "backend": name,
                "case": "300 non-blocking calls",
                "median_s": elapsed,
                "calls_per_s": 300 / elapsed,
            }
        )
        for mib in sizes:
            data = payload(mib)
            group.identity(payload(1))  # warm
            group.take_received()
            before_pull, before_driver = pulled_bytes(backend), driver_bytes(backend)
            reps = max(2, repeats if mib <= 64 else repeats - 2)
            times = timed(lambda d=data: group.identity(d), reps)
            med = statistics.median(times)
            rows.append(
                {
                    "backend": name,
                    "case": f"DP_COMPUTE_PROTO identity {mib} MiB",
                    "median_s": med,
                    "gb_per_s": 2 * mib * MiB / med / 1e9,
                    "driver_bytes_per_call": (driver_bytes(backend) - before_driver) // reps,
                    "ranks": per_rank(group, backend, before_pull, reps),
                    "repeats": reps,
                }
            )
        rows.extend(run_chains(name, backend, pool, group, repeats, chain_mib))
    finally:
        group.shutdown()
    return rows


def run_chains(
    name: str, backend: Any, pool: Any, producer: Any, repeats: int, mib: int
) -> list[dict]:
    rows = []
    data = payload(mib)
    for layout in ("separate pools", "same pool"):
        consumer_pool = pool if layout == "same pool" else hf.ResourcePool([2])
        consumer = hf.WorkerGroup(
            consumer_pool, Bench, backend=backend, name_prefix=f"bench-{name}-b"
        )
        try:
            hf.get(consumer.identity_async(producer.identity_async(payload(1))))
            producer.take_received()
            consumer.take_received()
            before_pull, before_driver = pulled_bytes(backend), driver_bytes(backend)
            hop_times, total_times = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                first = producer.identity_async(data)
                wait_done(backend, first.parts)  # the producer is done: time the hop alone
                hop_start = time.perf_counter()
                second = consumer.identity_async(first)
                wait_done(backend, second.parts)
                hop_times.append(time.perf_counter() - hop_start)
                second.get()
                total_times.append(time.perf_counter() - start)
            rows.append(
                {
                    "backend": name,
                    "case": f"chain {mib} MiB, {layout}",
                    "median_s": statistics.median(total_times),
                    "hop_median_s": statistics.median(hop_times),
                    "gb_per_s": 2 * mib * MiB / statistics.median(total_times) / 1e9,
                    "driver_bytes_per_call": (driver_bytes(backend) - before_driver) // repeats,
                    "ranks": per_rank(consumer, backend, before_pull, repeats),
                    "repeats": repeats,
                }
            )
        finally:
            consumer.shutdown()
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'backend':7} {'case':42} {'median':>10} {'rate':>14} {'driver MiB':>10} "
        f"{'rank in MiB (method / pulled)':>32}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        med = row["median_s"]
        median = f"{med * 1e3:.2f} ms" if med < 1 else f"{med:.3f} s"
        if "gb_per_s" in row:
            rate = f"{row['gb_per_s']:.2f} GB/s"
        else:
            rate = f"{row['calls_per_s']:.0f} calls/s"
        driver = (
            f"{row.get('driver_bytes_per_call', 0) / MiB:.1f}"
            if "driver_bytes_per_call" in row
            else ""
        )
        ranks = " ".join(
            f"{r['method_input_bytes'] / MiB:.0f}/{r['pulled_from_workers_bytes'] / MiB:.0f}"
            for r in row.get("ranks", [])
        )
        if "hop_median_s" in row:
            rate += f" hop {row['hop_median_s'] * 1e3:.0f} ms"
        print(
            f"{row['backend']:7} {row['case']:42} {median:>10} {rate:>14} {driver:>10} {ranks:>32}"
        )


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind in zip(axes, ("calls", "data")):
        subset = [r for r in rows if ("gb_per_s" in r) == (kind == "data")]
        labels = [f"{r['backend']}\n{r['case']}" for r in subset]
        values = [r["median_s"] * 1e3 for r in subset]
        ax.barh(
            labels,
            values,
            color=["#4c72b0" if r["backend"] == "dask" else "#dd8452" for r in subset],
        )
        ax.set_xlabel("median ms (lower is better)")
        ax.set_xscale("log")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title("calls" if kind == "calls" else "DataProto movement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="MiB")
    parser.add_argument("--chain-mib", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--no-local", action="store_true", help="skip the LocalBackend rows")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with DaskBackend(n_workers=4) as backend:
        rows += run_backend("dask", backend, args.repeats, args.sizes, args.chain_mib)
    if not args.no_local:
        with LocalBackend() as backend:
            rows += run_backend("local", backend, args.repeats, args.sizes, args.chain_mib)
    print_table(rows)
    (args.out / "dask_calls.json").write_text(json.dumps({"rows": rows}, indent=2))
    plot(rows, args.out / "dask_calls.png")
    print(f"wrote {args.out / 'dask_calls.json'} and {args.out / 'dask_calls.png'}")


if __name__ == "__main__":
    main()
