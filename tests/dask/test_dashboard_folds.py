"""Good calls reach the dashboard folded: counts per rank, with a uniform sample of rows.

A worker sends a row of its own only for a call the page must show by itself (a failure,
a call reported while pending); the good calls of a method between two such rows go as
one fold, and up to ``SAMPLED`` of their rows per event feed the phase times. The counts
stay exact and "the latest call of a method failed" keeps its order. The first test
drives real workers and reads both the events the scheduler kept and the served JSON;
the rest check the wire, the sample and the scheduler's reading without a cluster.
"""

from __future__ import annotations

import json
import random
import time
import types
import urllib.request
from collections import Counter
from typing import Any

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends.dask.scheduler.dashboard import GroupMonitor
from hybridflow_dask.backends.dask.wire.call_events import (
    FoldedCalls,
    call_entries,
    call_row,
    fold_entry,
    rows_event,
    sampled_calls,
)
from hybridflow_dask.backends.dask.wire.keys import CALL_TOPIC, GROUP_DATASET
from hybridflow_dask.backends.dask.worker.call_log import SAMPLED, _Sample

T = 1_700_000_000.0
GOOD_BEFORE, GOOD_AFTER = 120, 40


class Stepper(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def step(self, fail_rank: int = -1):
        if self.rank == fail_rank:
            raise ValueError(f"bad step on rank {self.rank}")
        return self.rank


def _group_json(backend: Any, name: str) -> dict[str, Any] | None:
    with urllib.request.urlopen(backend.groups_page + "/groups.json", timeout=10) as response:
        body = json.loads(response.read().decode())
    return next((g for g in body["groups"] if g["name"] == name), None)


def test_a_burst_of_good_calls_is_counted_exactly_from_folds_with_rows_only_for_failures(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Stepper, [2], backend=hf_dask_backend)
    name = group.name_prefix
    for _ in range(GOOD_BEFORE):
        group.step()
    with pytest.raises(ValueError, match="bad step on rank 1"):
        group.step(1)
    for _ in range(GOOD_AFTER):
        group.step()
    calls = 2 * (GOOD_BEFORE + 1 + GOOD_AFTER)

    deadline = time.monotonic() + 5
    while True:
        shown = _group_json(hf_dask_backend, name)
        step = (shown or {}).get("methods", {}).get("step")
        if step and step["calls"] == calls:
            break
        assert time.monotonic() < deadline, f"step's calls not all counted: {step}"
        time.sleep(0.1)
    assert step["errors"] == 1 and step["last_error"]["rank"] == 1
    assert step["p50_ms"] is not None  # the samples gave it run times
    assert [r["failing"] for r in shown["ranks"]] == [[], []]  # rank 1's latest call was good
    methods = shown["methods"]
    assert sum(r["calls"] for r in shown["ranks"]) == sum(m["calls"] for m in methods.values())

    # What the workers sent: one row (the failure), the rest folded and sampled.
    rows, folded, samples = [], 0, []
    for _, event in hf_dask_backend.client.get_events(CALL_TOPIC):
        if not isinstance(event, dict):
            continue
        entries = [e for e in call_entries(event) if e.group == name and e.method == "step"]
        rows += [e for e in entries if not isinstance(e, FoldedCalls)]
        folded += sum(n for e in entries if isinstance(e, FoldedCalls) for _, n, _ in e.ranks)
        sampled = [c for c in sampled_calls(event) if c.group == name and c.method == "step"]
        assert len(sampled) <= SAMPLED
        samples += sampled
    assert [(r.rank, r.ok) for r in rows] == [(1, False)]
    assert folded == calls - 1
    assert 0 < len(samples) < calls // 4 and all(c.ok for c in samples)


def _monitor() -> GroupMonitor:
    monitor = GroupMonitor()
    published = types.SimpleNamespace(datasets={GROUP_DATASET + "g": {"data": b""}})
    monitor.scheduler = types.SimpleNamespace(extensions={"publish": published}, plugins={})
    return monitor


def _row(rank: int, ok: bool = True, run: float = 0.01) -> list[Any]:
    stamps = (T, T, T + 0.001, T + 0.001 + run, T + 0.002 + run)
    error = None if ok else {"type": "ValueError", "message": "bad", "traceback": ""}
    status = "OK" if ok else "error"
    return call_row(
        f"g.step-{rank}", "g", "step", rank, "tcp://w:1", "lane", stamps, status, 0, error
    )


def _fold(*ranks: tuple[int, int, float]) -> list[Any]:
    return fold_entry("g", "step", "tcp://w:1", "lane", [list(r) for r in ranks])


def test_folds_and_rows_come_back_in_their_order_and_malformed_ranks_are_left_out():
    event = rows_event([_row(0, ok=False), _fold((0, 5, 0.2), ("bad",), (1, 0, 0.1))], [_row(3)])
    entries = call_entries(event)
    assert [type(e).__name__ for e in entries] == ["FinishedCall", "FoldedCalls"]
    assert entries[1].ranks == [(0, 5, 0.2)]  # a short entry and a count of 0 refused
    assert [c.rank for c in sampled_calls(event)] == [3]


def test_a_rank_whose_latest_call_failed_stays_failing_and_a_later_good_call_clears_it():
    monitor = _monitor()
    monitor.log_event(
        CALL_TOPIC, rows_event([_fold((0, 3, 0.01), (1, 3, 0.01)), _row(1, ok=False)])
    )
    assert set(monitor.stats.ranks["g"][1].failing) == {"step"}
    assert monitor.stats.method("g", "step").calls == 7
    monitor.log_event(CALL_TOPIC, rows_event([_row(0, ok=False), _fold((0, 2, 0.01))]))
    assert monitor.stats.ranks["g"][0].failing == {}
    assert [monitor.stats.ranks["g"][r].calls for r in (0, 1)] == [6, 4]


def test_samples_feed_the_phase_times_without_being_counted_again():
    monitor = _monitor()
    runs = [0.01, 0.02, 0.03]
    monitor.log_event(CALL_TOPIC, rows_event([_fold((0, 3, 0.03))], [_row(0, run=r) for r in runs]))
    stats = monitor.stats.method("g", "step")
    assert stats.calls == 3
    assert sorted(stats.phases["run"]) == pytest.approx(runs)
    assert monitor.stats.ranks["g"][0].median("step") == pytest.approx(0.03)  # the longest


def test_the_sample_keeps_each_call_about_equally_likely_not_the_first_ones():
    random.seed(7)
    kept: Counter[int] = Counter()
    for _ in range(400):
        sample = _Sample()
        for call in range(64):
            sample.offer(lambda call=call: [call])
        assert len(sample.rows) == SAMPLED
        kept.update(row[0] for row in sample.rows)
    early, late = sum(kept[c] for c in range(32)), sum(kept[c] for c in range(32, 64))
    assert abs(early - late) < 0.15 * (early + late)  # uniform: half and half, give or take
