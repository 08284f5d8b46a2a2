"""The /hybridflow page at 64 light ranks: healthy ranks folded per host and worker process,
an erroring rank, a straggler and a slow rank listed first, every rank still in the JSON.

The page logic without a cluster (ordering, dead processes, slowness) is tested at the end
with hand-made statistics.
"""

from __future__ import annotations

import html
import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.dask.scheduler.dashboard_page import (
    CallStats,
    group_view,
    render_html,
)

WORLD, PER_WORKER = 64, 16


class Ranked(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def step(self, fail_rank: int = -1):
        if self.rank == fail_rank:
            raise ValueError(f"bad shard on rank {self.rank}")
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds: float, rank: int):
        time.sleep(seconds if self.rank == rank else 0.0)
        return self.rank


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def group_json(backend: DaskBackend, name: str) -> dict[str, Any] | None:
    body = json.loads(fetch(backend.groups_page + "/groups.json"))
    return next((g for g in body["groups"] if g["name"] == name), None)


def wait_for(backend: DaskBackend, name: str, seen: Callable[[dict], Any], within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        group = group_json(backend, name)
        try:
            found = group is not None and seen(group)
        except KeyError:  # not on the page yet (the workers send their records every 250 ms)
            found = False
        if found:
            return group
        assert time.monotonic() < deadline, f"not on the page within {within} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def light_backend(hf_dask_cluster: Any) -> Iterator[DaskBackend]:
    """Light ranks on the session's 4 workers: 64 ranks, 16 per worker process."""
    with DaskBackend(cluster=hf_dask_cluster, ranks_per_worker=PER_WORKER) as backend:
        yield backend


@pytest.fixture
def wide_group(light_backend: DaskBackend) -> Iterator[hf.WorkerGroup]:
    group = hf.WorkerGroup(
        hf.ResourcePool([WORLD]), hf.ClassWithInitArgs(Ranked), backend=light_backend
    )
    yield group
    group.shutdown()


def test_a_large_group_is_folded_per_host_and_process_and_its_json_keeps_every_rank(
    light_backend, wide_group
):
    name = wide_group.name_prefix
    for _ in range(3):
        assert wide_group.step() == list(range(WORLD))
    # __init__ and 3 steps on every rank
    group = wait_for(light_backend, name, lambda g: g["methods"]["step"]["calls"] == 3 * WORLD, 10)

    assert [r["rank"] for r in group["ranks"]] == list(range(WORLD))  # every rank, in order
    assert all(r["alive"] and r["calls"] == 4 and r["errors"] == 0 for r in group["ranks"])
    assert group["folded"] and group["attention"] == []
    (host,) = group["hosts"]  # one loopback host
    assert (host["ranks"], host["alive"], host["processes"]) == (WORLD, WORLD, 4)
    assert host["calls"] == 4 * WORLD and host["errors"] == 0
    slots = [s.address for s in wide_group._rank_slots()]
    folds = [(w["address"], w["first_rank"], w["last_rank"], w["ranks"]) for w in host["workers"]]
    assert folds == [(slots[r], r, r + PER_WORKER - 1, PER_WORKER) for r in range(0, WORLD, 16)]
    assert all(w["p50_ms"] is not None and w["p99_ms"] >= w["p50_ms"] for w in host["workers"])

    page = html.unescape(fetch(light_backend.groups_page))
    section = page[page.index(name) :]
    assert f"all {WORLD} ranks alive" in section
    for first in range(0, WORLD, PER_WORKER):
        assert f"ranks {first}\u2013{first + PER_WORKER - 1}" in section
    rows = re.findall(r"<tr", section[: section.index("Methods")])
    assert len(rows) == 1 + 1 + 4  # the fold table's header, the host, its 4 processes


def test_an_erroring_rank_a_straggler_and_a_slow_rank_are_listed_first(light_backend, wide_group):
    name = wide_group.name_prefix
    slow_rank, error_rank, straggler = 50, 13, 40
    for _ in range(3):  # rank 50 finishes each nap long after the others
        hf.get(wide_group.nap(0.1, slow_rank))
    with pytest.raises(ValueError, match="bad shard on rank 13"):
        wide_group.step(error_rank)
    pending = wide_group.nap(4.0, straggler)

    def flagged(group: dict) -> bool:
        return any("straggler" in a["reasons"] for a in group["attention"])

    group = wait_for(light_backend, name, flagged, within=4.0)
    first = [(a["rank"], a["reasons"][0]) for a in group["attention"]]
    assert first[:2] == [(error_rank, "error"), (straggler, "straggler")]
    assert (slow_rank, "slow") in first
    ranks = group["ranks"]
    assert len(ranks) == WORLD
    assert ranks[error_rank]["failing"][0]["type"] == "ValueError"
    assert ranks[slow_rank]["slow"]["method"] == "nap" and ranks[slow_rank]["slow"]["p50_ms"] >= 100

    page = html.unescape(fetch(light_backend.groups_page))
    section = page[page.index(name) :]
    listed = section[: section.index("host / worker process")]  # before the folds
    assert "step failed" in listed and "bad shard on rank 13" in listed
    assert "straggler" in listed and "slow nap" in listed
    assert listed.index("bad shard") < listed.index("straggler") < listed.index("slow nap")
    assert hf.get(pending) == list(range(WORLD))


# -- without a cluster --------------------------------------------------------------------


def _refs(world: int, per_process: int) -> list[InstanceRef]:
    def slot(rank: int) -> Slot:
        process = rank // per_process
        return Slot(rank, f"tcp://h{process // 2}:{process}", f"h{process // 2}", name=str(process))

    return [InstanceRef("g", rank, slot(rank), "C") for rank in range(world)]


def test_a_dead_process_is_one_line_before_the_live_ranks_to_look_at():
    refs = _refs(256, 32)
    workers = {r.slot.address: {"name": r.slot.name, "pid": 1} for r in refs if r.rank < 224}
    stats = CallStats()
    now = time.time()
    for rank in range(256):
        stats.finished("g", "m", False, {"run": 0.01}, None, rank=rank, when=now)
    stats.finished("g", "m", False, {"run": 0.01}, {"type": "E", "message": "x"}, rank=3, when=now)
    view = group_view("g", refs, workers, stats, (), now)
    reasons = [(a["rank"], a["reasons"]) for a in view["attention"]]
    assert reasons[:32] == [(r, ["dead"]) for r in range(224, 256)] and reasons[32] == (
        3,
        ["error"],
    )
    page = html.unescape(
        render_html([view], scheduler="s", updated="t", status_url="/", json_url="/j")
    )
    assert page.count("dead: worker") == 1 and "ranks 224\u2013255" in page
    assert page.count("m failed") == 1  # the live rank 3, unfolded; the dead ones are folded


def test_small_groups_list_every_rank_and_large_ones_fold():
    stats = CallStats()
    small = group_view("g", _refs(16, 1), {}, stats)
    large = group_view("g", _refs(17, 1), {}, stats)
    assert not small["folded"] and large["folded"]
    assert len(large["ranks"]) == 17 and sum(h["ranks"] for h in large["hosts"]) == 17


def test_a_rank_slow_in_a_folded_report_stays_slow_after_one_fast_call():
    """A worker folds a rank's good calls between two reports into one entry (their count
    and longest run); that run stands for each call, so one fast call reported later does
    not outvote three slow ones folded before it."""
    refs = _refs(32, 16)
    stats = CallStats()
    now = time.time()
    for rank in range(32):
        run = 0.1 if rank == 20 else 0.0001
        stats.folded("g", "nap", False, rank, 3, run, when=now)  # the first report
        stats.folded("g", "nap", False, rank, 1, 0.0001, when=now + 0.25)  # the next
    view = group_view("g", refs, {r.slot.address: {"pid": 1} for r in refs}, stats, (), now)
    assert [(a["rank"], a["reasons"]) for a in view["attention"]] == [(20, ["slow"])]
    assert view["ranks"][20]["slow"]["p50_ms"] == 100.0
    assert view["ranks"][20]["calls"] == 4
