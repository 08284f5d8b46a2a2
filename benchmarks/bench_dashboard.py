"""What the /hybridflow page costs the scheduler at 256 ranks, polled at its refresh rate.

On an owned ``DaskBackend(n_workers=8, ranks_per_worker=32)``, one group of 256 light
ranks makes calls all along from a driver thread (ONE_TO_ALL ``step`` calls, blocking;
rank 7 is slow, and every tenth step fails on rank 200, so the page has ranks to list
first). Two measurements of the scheduler's CPU:

* **render**: on the scheduler's event loop (``run_on_scheduler``), what the two handlers
  do per request, timed in CPU seconds of that thread (``time.thread_time``): the page
  (``snapshot`` + ``render_html``) and the JSON (``snapshot`` + ``json.dumps``), medians
  of ``--repeats``; their sum over the refresh interval (2 s) is the cost of one browser
  tab plus one script polling the JSON.
* **polled / idle**: the CPU time of the scheduler's event-loop thread (``psutil``, the
  scheduler runs in this process) over alternating windows of ``--window-s`` seconds, in
  which a poller thread fetches the page and the JSON every 2 s over HTTP, or nothing; the
  difference of the medians is the page's cost with tornado's own work included, and it is
  as noisy as the machine (the calls go on in both).

Prints a table and writes ``dashboard.json`` into ``benchmarks/results/``; ``--quick`` (64
ranks on 2 workers, short windows) and other sizes write into ``results/scratch/``, unless
``--out`` names a folder::

    python benchmarks/bench_dashboard.py [--quick] [--ranks 256] [--workers 8] [--pairs 3]
                                         [--window-s 20] [--repeats 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outdir import results_dir  # benchmarks/outdir.py, next to this script

REFRESH_S = 2.0  # the page's own refresh (its meta refresh)
SLOW_RANK, FAILING_RANK = 7, 200


class Stepper(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def step(self, fail: bool):
        if self.rank == SLOW_RANK:
            time.sleep(0.02)
        if fail and self.rank == FAILING_RANK:
            raise ValueError(f"bad batch on rank {self.rank}")
        return self.rank


def render_cost(repeats: int, dask_scheduler: Any = None) -> dict[str, Any]:
    """Runs on the scheduler's event loop: CPU seconds per page and per JSON render."""
    from hybridflow_dask.backends.dask.scheduler.dashboard import PLUGIN_NAME
    from hybridflow_dask.backends.dask.scheduler.dashboard_page import render_html

    monitor = dask_scheduler.plugins[PLUGIN_NAME]
    page, body, sizes = [], [], {}
    for _ in range(repeats):
        t = time.thread_time()
        html = render_html(
            monitor.snapshot(),
            scheduler=dask_scheduler.address,
            updated="now",
            status_url="/status",
            json_url="/hybridflow/groups.json",
            events=monitor.events.recent(),
        )
        page.append(time.thread_time() - t)
        t = time.thread_time()
        text = json.dumps(
            {"groups": monitor.snapshot(), "events": monitor.events.recent()}, default=str
        )
        body.append(time.thread_time() - t)
        sizes = {"page_bytes": len(html), "json_bytes": len(text)}
    return {"page_s": page, "json_s": body, **sizes}


def loop_thread_cpu(tid: int) -> float:
    """CPU seconds the scheduler's event-loop thread has used so far."""
    for thread in psutil.Process().threads():
        if thread.id == tid:
            return thread.user_time + thread.system_time
    raise RuntimeError(f"the scheduler's thread {tid} is gone")


class Poller(threading.Thread):
    """Fetches the page and the JSON every ``REFRESH_S`` while ``on`` is set."""

    def __init__(self, page: str) -> None:
        super().__init__(daemon=True, name="bench-poller")
        self.urls = [page, page + "/groups.json"]
        self.on = threading.Event()
        self.stop = threading.Event()
        self.latency: dict[str, list[float]] = {"page": [], "json": []}

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.on.wait(0.1):
                continue
            began = time.monotonic()
            for kind, url in zip(("page", "json"), self.urls):
                t = time.perf_counter()
                with urllib.request.urlopen(url, timeout=30) as response:
                    response.read()
                self.latency[kind].append(time.perf_counter() - t)
            self.stop.wait(max(0.0, REFRESH_S - (time.monotonic() - began)))


def drive(group: hf.WorkerGroup, stop: threading.Event, counts: dict[str, int]) -> None:
    """Calls all along: a ``step`` per loop, every tenth one failing on one rank."""
    while not stop.is_set():
        fail = counts["steps"] % 10 == 9
        try:
            group.step(fail)
        except ValueError:
            counts["failed"] += 1
        counts["steps"] += 1


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    started = time.monotonic()
    with DaskBackend(n_workers=args.workers, ranks_per_worker=-(-args.ranks // args.workers)) as b:
        log(f"cluster of {args.workers} workers up in {time.monotonic() - started:.1f} s")
        t = time.monotonic()
        group = hf.WorkerGroup(
            hf.ResourcePool([args.ranks]), hf.ClassWithInitArgs(Stepper), backend=b
        )
        log(f"group of {args.ranks} ranks built in {time.monotonic() - t:.1f} s")
        tid = b.client.run_on_scheduler(threading.get_native_id)
        counts = {"steps": 0, "failed": 0}
        stop = threading.Event()
        driver = threading.Thread(target=drive, args=(group, stop, counts), daemon=True)
        driver.start()
        poller = Poller(b.groups_page)
        poller.start()
        time.sleep(args.window_s)  # warm-up: calls counted, windows filled
        windows: dict[str, list[dict[str, float]]] = {"polled": [], "idle": []}
        for pair in range(args.pairs):
            for phase in ("polled", "idle") if pair % 2 == 0 else ("idle", "polled"):
                (poller.on.set if phase == "polled" else poller.on.clear)()
                cpu, wall, steps = loop_thread_cpu(tid), time.monotonic(), counts["steps"]
                time.sleep(args.window_s)
                seconds = time.monotonic() - wall
                windows[phase].append(
                    {
                        "cpu_frac": (loop_thread_cpu(tid) - cpu) / seconds,
                        "steps_per_s": (counts["steps"] - steps) / seconds,
                    }
                )
                log(f"  {phase:6s} window {pair + 1}: {windows[phase][-1]}")
        poller.on.clear()
        render = b.client.run_on_scheduler(render_cost, args.repeats)
        stop.set()
        driver.join(timeout=60)
        poller.stop.set()
        group.shutdown()
    page_ms = statistics.median(render["page_s"]) * 1e3
    json_ms = statistics.median(render["json_s"]) * 1e3
    polled = statistics.median(w["cpu_frac"] for w in windows["polled"])
    idle = statistics.median(w["cpu_frac"] for w in windows["idle"])
    return {
        "ranks": args.ranks,
        "workers": args.workers,
        "steps": counts["steps"],
        "steps_per_s": statistics.median(w["steps_per_s"] for w in windows["idle"]),
        "render": {
            "page_ms_p50": page_ms,
            "json_ms_p50": json_ms,
            "page_ms_max": max(render["page_s"]) * 1e3,
            "json_ms_max": max(render["json_s"]) * 1e3,
            "page_bytes": render["page_bytes"],
            "json_bytes": render["json_bytes"],
            "core_pct_at_refresh": (page_ms + json_ms) / (REFRESH_S * 1e3) * 100,
        },
        "loop_thread": {
            "polled_core_pct": polled * 100,
            "idle_core_pct": idle * 100,
            "page_core_pct": (polled - idle) * 100,
            "windows": windows,
        },
        "http_latency_ms_p50": {
            k: statistics.median(v) * 1e3 if v else None for k, v in poller.latency.items()
        },
    }


def print_table(r: dict[str, Any]) -> None:
    render, loop = r["render"], r["loop_thread"]
    rows = [
        ("ranks x worker processes", f"{r['ranks']} on {r['workers']}"),
        ("group calls driven (steps/s)", f"{r['steps_per_s']:.1f}"),
        ("page render, scheduler CPU (p50)", f"{render['page_ms_p50']:.1f} ms"),
        ("JSON render, scheduler CPU (p50)", f"{render['json_ms_p50']:.1f} ms"),
        ("page + JSON every 2 s", f"{render['core_pct_at_refresh']:.2f} % of a core"),
        ("loop thread, polled", f"{loop['polled_core_pct']:.1f} % of a core"),
        ("loop thread, not polled", f"{loop['idle_core_pct']:.1f} % of a core"),
        ("difference (the page, with HTTP)", f"{loop['page_core_pct']:.2f} % of a core"),
        ("page / JSON size", f"{render['page_bytes']:,} / {render['json_bytes']:,} bytes"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="64 ranks on 2 workers, short")
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=3, help="polled/idle window pairs")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=30, help="renders timed on the scheduler")
    parser.add_argument("--out", type=Path, help="folder for the JSON")
    args = parser.parse_args(argv)
    default = (args.ranks, args.workers, args.pairs, args.window_s) == (256, 8, 3, 20.0)
    if args.quick:
        args.ranks, args.workers, args.pairs, args.window_s, args.repeats = 64, 2, 1, 4.0, 5
    out_dir = results_dir(args.out, trial=args.quick or not default)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    result = run(args, lambda line: print(line, flush=True))
    print_table(result)
    result["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "pairs": args.pairs,
        "window_s": args.window_s,
        "repeats": args.repeats,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - started,
        "load_avg_1m_start_end": [load_start, os.getloadavg()[0]],
    }
    name = "dashboard" + ("_quick" if args.quick else "" if default else "_custom")
    out = out_dir / f"{name}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['meta']['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
