"""Soak: many calls on one owned DaskBackend, then what is left behind.

On an owned ``DaskBackend(n_workers=2)`` with world size 2 groups ``a`` and ``b`` (both on
one pool, so colocated; ``--separate-pools`` puts ``b`` on 2 workers of its own), after a
warm-up phase:

* 10,000 non-blocking no-op ONE_TO_ALL calls, gathered every 100 (the driver never holds
  more than 100 group calls' futures);
* 1,000 DP_COMPUTE_PROTO identity calls of 1 MiB, alternately blocking (the socket lane)
  and non-blocking (a result kept on the workers, gathered every 10 calls), and every 100
  calls a 64 MiB non-blocking chain ``a -> b``.

It reports the RSS of the driver (which also runs the scheduler) and of every worker
process at the start (after the warm-up) and at the end, the scheduler's task count and
the keys in worker memory before the soak and once every future is released (references
dropped, ``gc.collect()``, then polled for up to ``--settle`` seconds), and names what is
left. Targets: RSS growth under 50 MiB per process; no task and no key left behind.

    python benchmarks/soak.py [--quick] [--separate-pools] [--noop-calls N] [--dp-calls N]
                              [--config KEY=VALUE ...] [--settle S] [--out DIR]

``--quick`` (500 no-op calls, 50 DP calls, one chain after the warm-up's) is the test
suite's smoke test, which asserts that nothing is left. Writes ``soak.json`` into
``benchmarks/results/``; any other run (``soak_quick.json``; ``_separate``, ``_config``,
``_custom`` mark the other options) goes to ``benchmarks/results/scratch/``, which git
ignores, unless ``--out`` names a folder.
Growth that stops is not a leak: Dask keeps bounded histories that every call adds to
(the task stream, ``hybridflow.task-stream-length`` records (10,000; Dask's default is
100,000), which the dashboard feeds with direct calls too;
``key_split``'s cache of 100,000 keys; ``hybridflow.message-log-length`` recent batches
per batched stream, 100 on a cluster the backend starts, Dask's 1,000 with ``null``), so
``--config hybridflow.task-stream-length=1000 --config hybridflow.message-log-length=10``
shows what remains without them, ``--config hybridflow.message-log-length=null`` the
growth with Dask's own logs, and
``--noop-calls 80000`` how far the histories grow before they stop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dask
import psutil
import torch
import yaml
from outdir import results_dir  # benchmarks/outdir.py, next to this script

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

MiB = 1 << 20
ROWS = 1024
RSS_TARGET_MIB = 50


@dataclass
class Plan:
    """How much each phase does (``--quick`` shrinks it)."""

    noop_calls: int = 10_000
    noop_batch: int = 100
    dp_calls: int = 1_000
    dp_mib: int = 1
    dp_batch: int = 10
    chain_every: int = 100
    chain_mib: int = 64
    warm_noop: int = 300
    warm_dp: int = 20
    warm_chains: int = 1
    samples: int = 10  # RSS samples per phase

    @classmethod
    def quick(cls) -> Plan:
        return cls(noop_calls=500, dp_calls=50, chain_every=50, warm_noop=100, warm_dp=10)


class Soak(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def noop_async(self) -> None:
        return None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: hf.DataProto) -> hf.DataProto:
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def identity_async(self, data: hf.DataProto) -> hf.DataProto:
        return data


# ---- what the probes run on workers and on the scheduler ------------------------------


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _trim() -> bool:
    """Give freed heap back to the OS (glibc's ``malloc_trim``); False where there is none."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def worker_rss(trim: bool = False) -> int:
    """Run on a worker: its process's RSS after a full collection (and a trim)."""
    gc.collect()
    if trim:
        _trim()
    return _rss()


def block_cache() -> int | None:
    """Bytes this process keeps in the package's block cache for large buffers (in use or
    idle, up to ``hybridflow.buffer-cache`` idle): RSS that is reuse, not a leak. A private
    attribute, read for this report only; None where it is not there."""
    try:
        from hybridflow_dask.protocol import large_memory

        return sum(block.nbytes for block in large_memory._CACHE._blocks)
    except (ImportError, AttributeError):
        return None


def worker_keys(dask_worker: Any) -> list[str]:
    return [str(k) for k in dask_worker.data]


def scheduler_tasks(dask_scheduler: Any) -> list[dict]:
    return [
        {
            "key": str(key),
            "state": ts.state,
            "who_wants": sorted(str(cs.client_key) for cs in ts.who_wants or ()),
            "waiters": len(ts.waiters or ()),
            "who_has": sorted(str(ws.address) for ws in ts.who_has or ()),
        }
        for key, ts in dask_scheduler.tasks.items()
    ]


def scheduler_task_count(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


# ---- measurements -------------------------------------------------------------------------


class Probe:
    def __init__(self, backend: DaskBackend) -> None:
        self.client = backend.client

    def rss(self, trim: bool = False) -> dict[str, int]:
        """RSS in bytes: ``driver`` and every worker address (after ``gc.collect()``)."""
        gc.collect()
        if trim:
            _trim()
        found = {"driver": _rss()}
        found.update(self.client.run(worker_rss, trim))
        return found

    def block_cache(self) -> dict[str, int | None]:
        found = {"driver": block_cache()}
        found.update(self.client.run(block_cache))
        return found

    def counts(self) -> dict[str, Any]:
        keys = self.client.run(worker_keys)
        return {
            "scheduler_tasks": self.client.run_on_scheduler(scheduler_task_count),
            "worker_keys": {w: len(k) for w, k in keys.items()},
            "client_futures": len(self.client.futures),
        }

    def settle(self, before: dict[str, Any], timeout: float) -> tuple[dict[str, Any], float]:
        """Poll until the scheduler is back to ``before``'s task count and no worker holds
        more keys than then, or ``timeout``; returns the last counts and the wait."""
        gc.collect()
        start = time.perf_counter()
        while True:
            now = self.counts()
            settled = now["scheduler_tasks"] <= before["scheduler_tasks"] and all(
                n <= before["worker_keys"].get(w, 0) for w, n in now["worker_keys"].items()
            )
            waited = time.perf_counter() - start
            if settled or waited > timeout:
                return now, waited
            time.sleep(0.1)
            gc.collect()

    def leftovers(self, limit: int = 50) -> dict[str, Any]:
        """What is still there: scheduler tasks and worker keys, with counts by prefix
        (``group.method``)."""
        tasks = self.client.run_on_scheduler(scheduler_tasks)
        keys = self.client.run(worker_keys)
        return {
            "task_prefixes": dict(Counter(prefix(t["key"]) for t in tasks)),
            "task_states": dict(Counter(t["state"] for t in tasks)),
            "tasks": tasks[:limit],
            "key_prefixes": {w: dict(Counter(prefix(k) for k in ks)) for w, ks in keys.items()},
            "keys": {w: ks[:limit] for w, ks in keys.items()},
            "client_futures": [str(k) for k in list(self.client.futures)[:limit]],
        }


def prefix(key: str) -> str:
    """``"{group}.{method}"`` of a call key (Dask's ``key_split`` would also do)."""
    return key.rsplit("-", 1)[0] if "-" in key else key


# ---- the soak -------------------------------------------------------------------------------


class Soaker:
    def __init__(self, backend: DaskBackend, a: Any, b: Any, plan: Plan) -> None:
        self.backend, self.a, self.b, self.plan = backend, a, b, plan
        self.small = hf.DataProto.from_dict(
            {"x": torch.randn(ROWS, plan.dp_mib * MiB // (ROWS * 4))}
        )
        self.large = hf.DataProto.from_dict(
            {"x": torch.randn(ROWS, plan.chain_mib * MiB // (ROWS * 4))}
        )

    def noops(self, calls: int) -> None:
        done = 0
        while done < calls:
            n = min(self.plan.noop_batch, calls - done)
            futures = [self.a.noop_async() for _ in range(n)]
            values = self.backend.gather([f for fl in futures for f in fl])
            assert values == [None] * (2 * n), values[:4]
            del futures, values
            done += n

    def dps(self, calls: int, start: int = 0) -> int:
        """``calls`` DP calls (numbered from ``start``), a chain after every
        ``chain_every``-th; returns how many chains ran."""
        chains = 0
        pending: list[Any] = []
        for i in range(start, start + calls):
            if i % 2:
                out = self.a.identity(self.small)
                assert len(out) == ROWS
                del out
            else:
                pending.append(self.a.identity_async(self.small))
            if len(pending) >= self.plan.dp_batch:
                self._drain(pending)
            if (i + 1) % self.plan.chain_every == 0:
                self._drain(pending)
                self.chain()
                chains += 1
        self._drain(pending)
        return chains

    def _drain(self, pending: list[Any]) -> None:
        for out in hf.get(pending):
            assert len(out) == ROWS
        pending.clear()

    def chain(self) -> None:
        out = hf.get(self.b.identity_async(self.a.identity_async(self.large)))
        assert len(out) == ROWS
        del out


def mib(n: float) -> float:
    return n / MiB


def run(plan: Plan, separate_pools: bool, settle_s: float, log: Callable[[str], None]) -> dict:
    n_workers = 4 if separate_pools else 2
    started = time.perf_counter()
    backend = DaskBackend(n_workers=n_workers)
    try:
        pool_a = hf.ResourcePool([2])
        pool_b = hf.ResourcePool([2]) if separate_pools else pool_a
        a = hf.WorkerGroup(pool_a, Soak, backend=backend, name_prefix="soak_a")
        b = hf.WorkerGroup(pool_b, Soak, backend=backend, name_prefix="soak_b")
        probe = Probe(backend)
        soaker = Soaker(backend, a, b, plan)
        ready_s = time.perf_counter() - started
        initial = probe.counts()
        log(f"ready in {ready_s:.1f} s; before any call: {initial}")

        t = time.perf_counter()
        soaker.noops(plan.warm_noop)
        soaker.dps(plan.warm_dp)
        for _ in range(plan.warm_chains):
            soaker.chain()
        # Settled against the counts before any call: whatever the warm-up left is a leak
        # too (the soak's own figures are against these counts as well).
        before, before_wait = probe.settle(initial, settle_s)
        rss_start = probe.rss()
        cache_start = probe.block_cache()
        warm_s = time.perf_counter() - t
        log(f"warm-up {warm_s:.1f} s; before the soak: {before} (settled in {before_wait:.2f} s)")

        samples: list[dict] = []

        def sample(phase: str, done: int) -> None:
            rss = probe.rss()
            samples.append(
                {"phase": phase, "done": done, "t_s": time.perf_counter() - t0, "rss": rss}
            )
            log(
                f"  {phase} {done:>6}: "
                + ", ".join(f"{short(p)} {mib(v):.0f} MiB" for p, v in rss.items())
            )

        # phase times count the calls only, not the RSS samples between them
        t0 = time.perf_counter()
        noop_s = 0.0
        step = max(1, plan.noop_calls // plan.samples)
        for done in range(0, plan.noop_calls, step):
            t = time.perf_counter()
            soaker.noops(min(step, plan.noop_calls - done))
            noop_s += time.perf_counter() - t
            sample("no-op", min(done + step, plan.noop_calls))

        dp_s = 0.0
        step = max(plan.chain_every, plan.dp_calls // plan.samples)
        chains = 0
        for done in range(0, plan.dp_calls, step):
            t = time.perf_counter()
            chains += soaker.dps(min(step, plan.dp_calls - done), start=done)
            dp_s += time.perf_counter() - t
            sample("DP", min(done + step, plan.dp_calls))
        soak_s = time.perf_counter() - t0

        after, after_wait = probe.settle(initial, settle_s)
        rss_end = probe.rss()
        cache_end = probe.block_cache()
        rss_trimmed = probe.rss(trim=True)
        anything = after["scheduler_tasks"] or any(after["worker_keys"].values())
        left = probe.leftovers() if anything or after["client_futures"] else None
        log(f"after the soak: {after} (settled in {after_wait:.2f} s)")

        rss_rows = [
            {
                "process": p,
                "start_mib": mib(rss_start[p]),
                "end_mib": mib(rss_end[p]),
                "growth_mib": mib(rss_end[p] - rss_start[p]),
                "end_trimmed_mib": mib(rss_trimmed[p]),
                "peak_sampled_mib": mib(max(s["rss"][p] for s in samples)),
                "block_cache_start_mib": mib(cache_start.get(p) or 0),
                "block_cache_end_mib": mib(cache_end.get(p) or 0),
                "ok": rss_end[p] - rss_start[p] < RSS_TARGET_MIB * MiB,
            }
            for p in rss_start
        ]
        keys_left = sum(
            max(0, n - initial["worker_keys"].get(w, 0)) for w, n in after["worker_keys"].items()
        )
        tasks_left = after["scheduler_tasks"] - initial["scheduler_tasks"]
        a.shutdown()
        if b is not a:
            b.shutdown()
        return {
            "n_workers": n_workers,
            "ready_s": ready_s,
            "warm_s": warm_s,
            "noop_s": noop_s,
            "noop_calls_per_s": plan.noop_calls / noop_s,
            "dp_s": dp_s,
            "chains": chains + plan.warm_chains,
            "soak_s": soak_s,
            "initial": initial,
            "before": before,
            "after": after,
            "settle_wait_s": after_wait,
            "tasks_initial": initial["scheduler_tasks"],
            "tasks_before": before["scheduler_tasks"],
            "tasks_after": after["scheduler_tasks"],
            "tasks_left": tasks_left,
            "keys_left": keys_left,
            "client_futures_left": after["client_futures"],
            "leftovers": left,
            "rss": rss_rows,
            "rss_ok": all(r["ok"] for r in rss_rows),
            "samples": samples,
        }
    finally:
        backend.shutdown()


def short(process: str) -> str:
    return process if process == "driver" else "worker " + process.rsplit(":", 1)[-1]


def print_table(result: dict) -> None:
    header = (
        f"{'process':16} {'RSS start':>10} {'RSS end':>10} {'growth':>9} {'trimmed':>9} "
        f"{'peak':>9} {'blocks start/end':>17}"
    )
    print(
        f"\nRSS in MiB (start: after the warm-up; end: after every future is released; "
        f"target growth < {RSS_TARGET_MIB}; trimmed: end after malloc_trim; peak: of the "
        "samples; blocks: the package's cache for large buffers)"
    )
    print(header)
    print("-" * len(header))
    for r in result["rss"]:
        blocks = f"{r['block_cache_start_mib']:.0f} / {r['block_cache_end_mib']:.0f}"
        print(
            f"{short(r['process']):16} {r['start_mib']:>10.1f} {r['end_mib']:>10.1f} "
            f"{r['growth_mib']:>+9.1f} {r['end_trimmed_mib']:>9.1f} "
            f"{r['peak_sampled_mib']:>9.1f} {blocks:>17}{'' if r['ok'] else '  OVER'}"
        )
    print()
    rows = [
        (
            "scheduler tasks: first call / soak start / end",
            f"{result['tasks_initial']} / {result['tasks_before']} / {result['tasks_after']}",
        ),
        ("tasks left (end - first call)", str(result["tasks_left"])),
        ("keys left in worker memory", str(result["keys_left"])),
        ("client futures left", str(result["client_futures_left"])),
        ("settled in", f"{result['settle_wait_s']:.2f} s"),
        ("no-op phase", f"{result['noop_s']:.1f} s ({result['noop_calls_per_s']:.0f} calls/s)"),
        ("DP phase (with chains)", f"{result['dp_s']:.1f} s ({result['chains']} chains in all)"),
        ("soak", f"{result['soak_s']:.1f} s"),
    ]
    for name, value in rows:
        print(f"{name:32} {value}")
    if result["leftovers"]:
        print("\nleft behind:", json.dumps(result["leftovers"], indent=2)[:4000])


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("hybridflow-dask", "distributed", "torch"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="500 no-op calls, 50 DP calls")
    parser.add_argument(
        "--separate-pools", action="store_true", help="b on a pool of its own (4 workers)"
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds to wait for the counts to settle"
    )
    parser.add_argument("--noop-calls", type=int, help="override the plan's no-op calls")
    parser.add_argument("--dp-calls", type=int, help="override the plan's DP calls")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dask.config setting for the run, the workers' too (YAML value; repeatable), "
        "e.g. distributed.admin.low-level-log-length=10",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the JSON (default: results/, or results/scratch/ for a partial run)",
    )
    args = parser.parse_args(argv)
    settings = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--config takes KEY=VALUE, got {item!r}")
        settings[key] = yaml.safe_load(value)
    plan = Plan.quick() if args.quick else Plan()
    if args.noop_calls is not None:
        plan.noop_calls = args.noop_calls
    if args.dp_calls is not None:
        plan.dp_calls = args.dp_calls
    custom = args.noop_calls is not None or args.dp_calls is not None
    partial = args.quick or custom or args.separate_pools or bool(settings)
    args.out = results_dir(args.out, trial=partial)

    def log(line: str) -> None:
        print(line, flush=True)

    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    with dask.config.set(settings):  # workers get the driver's config when they start
        result = run(plan, args.separate_pools, args.settle, log)
    print_table(result)
    result["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "world_size": 2,
        "separate_pools": args.separate_pools,
        "dask_config": settings,
        "versions": versions(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "plan": plan.__dict__,
        "rss_target_mib": RSS_TARGET_MIB,
        "wall_s": time.perf_counter() - started,
        "load_avg_1m_start_end": [load_start, os.getloadavg()[0]],
    }
    name = "soak" + ("_separate" if args.separate_pools else "") + ("_config" if settings else "")
    name += ("_quick" if args.quick else "") + ("_custom" if custom else "")
    out = args.out / f"{name}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['meta']['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
