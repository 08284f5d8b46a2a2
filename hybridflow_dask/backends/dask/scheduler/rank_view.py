"""What the worker-group page shows of many ranks: folds per host and worker process, and
the ranks that need a look, first.

A group of hundreds of ranks cannot be read one row per rank, and a healthy rank says
nothing its neighbours do not. So each rank keeps a few counters and a short window of
its run times (``RankStats``); the page folds healthy ranks into one row per host and
per worker process (counts, calls, errors, run p50/p99), and lists unfolded, before the
folds, the ranks that are dead, whose latest call of a method failed, that run a
straggling call, whose calls have been pending longest, or that run a method much slower
than the other ranks do (``attention``). The JSON keeps every rank. Pure Python, no Dask.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTENTION_SHOWN",
    "FOLD_ABOVE",
    "RANK_WINDOW",
    "RankStats",
    "attention",
    "fold",
    "percentile",
    "rank_fields",
    "slow_ranks",
    "stats_of",
]

#: Run times each rank keeps per method (for its median, and its folds' percentiles).
RANK_WINDOW = 16
#: Groups with more ranks than this are folded on the page; smaller ones list every rank.
FOLD_ABOVE = 16
#: The most unfolded ranks the page lists before the folds (the JSON has them all).
ATTENTION_SHOWN = 12
#: How many of the longest pending calls, and of the slowest ranks, are listed.
PENDING_SHOWN = 4
SLOW_SHOWN = 4
#: A rank is slow at a method once its median run is this many times the ranks' median ...
SLOW_RATIO = 2.0
#: ... and at least this much longer (seconds), so microsecond noise never counts.
SLOW_MIN_S = 0.02
#: Worker processes listed under their hosts; past this many in a group, hosts only.
PROCESSES_SHOWN = 32
#: The order of the reasons a rank is listed first, most urgent first.
REASONS = ("dead", "error", "straggler", "pending", "slow")


@dataclass
class RankStats:
    """One rank's finished calls: counts, the methods whose latest call failed, recent runs."""

    calls: int = 0
    errors: int = 0
    #: method -> the error of its latest call on this rank, while that call is the latest.
    failing: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, deque] = field(default_factory=dict)

    def finished(
        self,
        method: str,
        run: float | None,
        error: Mapping[str, Any] | None,
        when: float | None,
        count: int = 1,
    ) -> None:
        """``count`` calls of ``method`` ended (the latest with ``error``); ``run`` (the
        longest of them, when a worker folded them) stands for each in the method's window,
        so the window is the rank's last calls however the worker batched its reports."""
        self.calls += count
        if run is not None:
            window = self.runs.get(method)
            if window is None:
                window = self.runs[method] = deque(maxlen=RANK_WINDOW)
            window.extend(itertools.repeat(max(0.0, run), min(count, RANK_WINDOW)))
        if error is None:
            self.failing.pop(method, None)
            return
        self.errors += 1
        self.failing[method] = {
            "method": method,
            "type": error.get("type"),
            "message": error.get("message"),
            "time": when,
        }

    def median(self, method: str) -> float | None:
        window = self.runs.get(method)
        return percentile(sorted(window), 0.5) if window else None

    def recent_runs(self) -> Iterable[float]:
        """Run times of the recent method calls; construction (a one-off) left out."""
        for method, window in self.runs.items():
            if method != "__init__":
                yield from window


def rank_fields(stats: RankStats | None) -> dict[str, Any]:
    """What the JSON adds to a rank: its counts and the errors still standing."""
    if stats is None:
        return {"calls": 0, "errors": 0, "failing": []}
    failing = sorted(stats.failing.values(), key=lambda e: -(e["time"] or 0.0))
    return {"calls": stats.calls, "errors": stats.errors, "failing": failing}


def slow_ranks(stats: Mapping[Any, RankStats]) -> dict[Any, dict[str, Any]]:
    """Rank -> its slowest method against the other ranks (``method``, ``ratio``,
    ``p50_ms``, ``ranks_p50_ms``), for the ranks past ``SLOW_RATIO`` and ``SLOW_MIN_S``."""
    medians: dict[str, dict[Any, float]] = {}
    for rank, rank_stats in stats.items():
        for method in rank_stats.runs:
            value = rank_stats.median(method)
            if value is not None:
                medians.setdefault(method, {})[rank] = value
    slow: dict[Any, dict[str, Any]] = {}
    for method, by_rank in medians.items():
        if len(by_rank) < 2:
            continue
        typical = percentile(sorted(by_rank.values()), 0.5) or 0.0
        for rank, value in by_rank.items():
            if value < SLOW_RATIO * typical or value - typical < SLOW_MIN_S:
                continue
            ratio = value / typical if typical > 0 else math.inf
            if rank not in slow or ratio > slow[rank]["ratio"]:
                slow[rank] = {
                    "method": method,
                    "ratio": round(ratio, 1) if math.isfinite(ratio) else None,
                    "p50_ms": round(value * 1e3, 3),
                    "ranks_p50_ms": round(typical * 1e3, 3),
                }
    return slow


def attention(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks to show first, most urgent first, each once with all its reasons.

    ``ranks`` are the page's rank rows (``alive``, ``failing``, ``pending``, ``slow``); each
    entry names the rank and its ``index`` in them. Dead ranks come first, then ranks
    whose latest call of a method failed (newest error first), ranks running a straggling
    call (longest first), the ``PENDING_SHOWN`` ranks whose calls have been pending
    longest, and the ``SLOW_SHOWN`` slowest ranks.
    """
    reasons: dict[int, list[str]] = {}
    order: dict[int, tuple] = {}

    def flag(index: int, reason: str, key: float) -> None:
        reasons.setdefault(index, [])
        if reason not in reasons[index]:
            reasons[index].append(reason)
        rank_key = (REASONS.index(reason), key, index)
        order[index] = min(order.get(index, rank_key), rank_key)

    pending = []
    for i, r in enumerate(ranks):
        if not r["alive"]:
            flag(i, "dead", 0.0)
        if r["failing"]:
            flag(i, "error", -(r["failing"][0]["time"] or 0.0))
        longest = max((c["seconds"] for c in r["pending"]), default=None)
        if any(c["straggler"] for c in r["pending"]):
            flag(i, "straggler", -(longest or 0.0))
        if longest is not None:
            pending.append((-longest, i))
    for minus_seconds, i in sorted(pending)[:PENDING_SHOWN]:
        flag(i, "pending", minus_seconds)
    slow = sorted((-(r["slow"]["ratio"] or math.inf), i) for i, r in enumerate(ranks) if r["slow"])
    for minus_ratio, i in slow[:SLOW_SHOWN]:
        flag(i, "slow", minus_ratio)
    return [
        {"rank": ranks[i]["rank"], "index": i, "reasons": sorted(reasons[i], key=REASONS.index)}
        for i in sorted(order, key=order.__getitem__)
    ]


def fold(ranks: list[dict[str, Any]], stats: Mapping[Any, RankStats]) -> list[dict[str, Any]]:
    """One entry per host, each with one per worker process: ranks, alive, calls, errors,
    calls pending now, and p50/p99 of the recent run times of the ranks there."""
    hosts: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in ranks:
        hosts.setdefault(str(r["host"]), {}).setdefault(str(r["address"]), []).append(r)
    out = []
    for host in sorted(hosts):
        workers = []
        for address, members in hosts[host].items():
            first = members[0]
            workers.append(
                {
                    "address": address,
                    "worker_name": first["worker_name"],
                    "pid": first["pid"],
                    "first_rank": first["rank"],
                    "last_rank": members[-1]["rank"],
                    **_summary(members, stats),
                }
            )
        members = [r for ws in hosts[host].values() for r in ws]
        out.append(
            {
                "host": host,
                "processes": len(workers),
                **_summary(members, stats),
                "workers": workers,
            }
        )
    return out


def _summary(members: list[dict[str, Any]], stats: Mapping[Any, RankStats]) -> dict[str, Any]:
    runs = sorted(v for r in members if (s := stats_of(stats, r["rank"])) for v in s.recent_runs())
    alive = sum(bool(r["alive"]) for r in members)
    return {
        "ranks": len(members),
        "alive": alive,
        "dead": len(members) - alive,
        "calls": sum(r["calls"] for r in members),
        "errors": sum(r["errors"] for r in members),
        "failing": sum(bool(r["failing"]) for r in members),
        "pending": sum(len(r["pending"]) for r in members),
        "p50_ms": _ms(percentile(runs, 0.5)),
        "p99_ms": _ms(percentile(runs, 0.99)),
    }


def stats_of(table: Mapping[Any, Any], rank: Any) -> Any:
    """``table.get(rank)``, ``None`` for a publisher's unhashable rank."""
    try:
        return table.get(rank)
    except TypeError:  # a publisher's unhashable rank: it has no statistics
        return None


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (``None`` when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered) - 1e-9) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)
