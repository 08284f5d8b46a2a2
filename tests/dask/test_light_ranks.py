"""Light ranks: several ranks of one pool in one worker process (``ranks-per-worker``)."""

from __future__ import annotations

import os

import dask
import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.config import ranks_per_worker
from hybridflow_dask.backends.dask.driver.placement import (
    WorkerInfo,
    assign_slots,
    workers_needed,
)


def _workers(n: int, host: str = "h") -> list[WorkerInfo]:
    return [WorkerInfo(f"tcp://{host}:{i}", host, str(i), worker_id=f"id{i}") for i in range(n)]


def test_consecutive_ranks_share_a_worker_up_to_ranks_per_worker():
    slots = assign_slots([8], _workers(3), ranks_per_worker=3)
    assert [s.address for s in slots] == ["tcp://h:0"] * 3 + ["tcp://h:1"] * 3 + ["tcp://h:2"] * 2
    assert [s.index for s in slots] == list(range(8))
    assert workers_needed([8], 3) == 3


def test_node_entries_never_share_a_worker_process():
    hosts = _workers(2, "a") + _workers(2, "b")
    slots = assign_slots([3, 3], hosts, ranks_per_worker=4)
    assert len({s.address for s in slots[:3]}) == 1 and len({s.address for s in slots[3:]}) == 1
    assert slots[0].host != slots[3].host
    assert workers_needed([3, 3], 4) == 2


def test_a_pool_too_large_for_the_workers_names_ranks_per_worker():
    with pytest.raises(ValueError, match=r"needs 3 worker processes .*9 ranks, 4 per worker"):
        assign_slots([9], _workers(2), ranks_per_worker=4)


@pytest.mark.parametrize("value", [0, -1, 1.5, "8", True])
def test_ranks_per_worker_must_be_a_whole_number_from_one(value):
    with pytest.raises(ValueError, match=r"hybridflow\.ranks-per-worker must be a whole number"):
        ranks_per_worker(value)
    with (
        dask.config.set({"hybridflow.ranks-per-worker": value}),
        pytest.raises(ValueError, match=r"DaskBackend\(ranks_per_worker=8\)"),
    ):
        ranks_per_worker()


class Rank(hf.Worker):
    def __init__(self) -> None:
        super().__init__()
        self.seen_at_init = os.environ["RANK"]

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def who(self):
        return os.getpid(), os.environ["RANK"], self.seen_at_init, self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def cpus(self):
        return os.getpid(), sorted(os.sched_getaffinity(0))

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def bump(self, step):
        self.count = getattr(self, "count", 0) + step
        return self.count


def _backend(cluster, ranks_per_worker: int = 1) -> DaskBackend:
    """A backend on the shared test cluster that keeps its worker processes."""
    with dask.config.set({"hybridflow.fresh-processes": False}):
        return DaskBackend(cluster=cluster, ranks_per_worker=ranks_per_worker)


@pytest.mark.cluster
def test_light_ranks_are_instances_of_their_own_sharing_a_process(hf_dask_cluster):
    with _backend(hf_dask_cluster, ranks_per_worker=4) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([8]), hf.ClassWithInitArgs(Rank), backend=backend)
        seen = group.who()
        pids = [pid for pid, *_ in seen]
        assert len(set(pids)) == 2 and pids[:4] == [pids[0]] * 4 and pids[4:] == [pids[4]] * 4
        assert [s[1:] for s in seen] == [(str(r), str(r), r) for r in range(8)]
        assert group.bump(1) == [1] * 8 and group.bump(2) == [3] * 8  # state per instance
        group.shutdown()


@pytest.mark.cluster
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a process allowed on one CPU has nothing to keep to"
)
def test_light_ranks_of_a_process_run_on_one_cpu_and_real_ranks_keep_their_mask(hf_dask_cluster):
    with _backend(hf_dask_cluster, ranks_per_worker=2) as light:
        group = hf.WorkerGroup(hf.ResourcePool([4]), hf.ClassWithInitArgs(Rank), backend=light)
        seen = group.cpus()
        assert all(len(mask) == 1 for _, mask in seen), seen
        by_process: dict[int, set] = {}
        for pid, mask in seen:
            by_process.setdefault(pid, set()).add(tuple(mask))
        assert len(by_process) == 2 and all(len(masks) == 1 for masks in by_process.values())
        group.shutdown()
    with _backend(hf_dask_cluster) as real:
        group = hf.WorkerGroup(hf.ResourcePool([2]), hf.ClassWithInitArgs(Rank), backend=real)
        assert [mask for _, mask in group.cpus()] == [sorted(os.sched_getaffinity(0))] * 2
        group.shutdown()
