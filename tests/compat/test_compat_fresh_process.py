"""verl gives every worker group fresh processes; colocated groups share one, clearly.

Checked on a real cluster with real ``torch.distributed`` (gloo) process groups.
"""

from __future__ import annotations

import os

import dask
import pytest
import torch.distributed as dist

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster

#: Module state a previous group leaves behind in its process, if the process is reused.
LEFT_BEHIND: dict[str, int] = {}


class Unguarded(hf.Worker):
    """Initializes torch.distributed the way a careless worker does: no is_initialized()."""

    def __init__(self) -> None:
        dist.init_process_group("gloo")
        self.inherited = dict(LEFT_BEHIND)
        LEFT_BEHIND["groups"] = LEFT_BEHIND.get("groups", 0) + 1

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def state(self) -> dict:
        return {"pid": os.getpid(), "inherited": self.inherited, "world": dist.get_world_size()}

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def total(self, value: int) -> int:
        import torch

        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        return int(tensor.item())


class Guarded(hf.Worker):
    """verl's FSDP workers' way: initialize only if nobody in the process did."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def total(self, value: int) -> int:
        import torch

        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        return int(tensor.item())


@pytest.fixture(scope="module")
def two_workers():
    with dask.config.set(
        {"hybridflow.fresh-processes": True}
    ):  # the default, which conftest turns off
        backend = DaskBackend(n_workers=2)
    yield backend
    backend.shutdown()


def test_a_group_made_after_another_was_shut_down_gets_fresh_processes(two_workers):
    first = hf.WorkerGroup(hf.ResourcePool([2]), Unguarded, backend=two_workers)
    assert first.total(1) == [2, 2]
    first.shutdown()
    # Same slots (the cluster has only two workers), new pool, unguarded init again.
    second = hf.WorkerGroup(hf.ResourcePool([2]), Unguarded, backend=two_workers)
    try:
        states = second.state()
        assert [s["inherited"] for s in states] == [{}, {}]  # no module state carried over
        assert [s["world"] for s in states] == [2, 2]
        assert second.total(3) == [6, 6]
    finally:
        second.shutdown()


def test_colocated_groups_initializing_torch_distributed_twice_get_a_clear_error(two_workers):
    pool = hf.ResourcePool([2])
    first = hf.WorkerGroup(pool, Unguarded, backend=two_workers)
    try:
        with pytest.raises(Exception, match=r"is_initialized\(\)") as caught:
            hf.WorkerGroup(pool, Unguarded, backend=two_workers)
        message = str(caught.value)
        assert "share" in message and "create_colocated_worker_cls" in message
        assert "separate pools" in message
    finally:
        first.shutdown()


def test_colocated_groups_guarding_the_init_share_the_pools_process_group(two_workers):
    pool = hf.ResourcePool([2])
    first = hf.WorkerGroup(pool, Guarded, backend=two_workers)
    second = hf.WorkerGroup(pool, Guarded, backend=two_workers)
    try:
        assert first.total(1) == [2, 2]
        assert second.total(5) == [10, 10]
    finally:
        second.shutdown()
        first.shutdown()


def test_groups_made_one_after_another_keep_every_slot_and_restart_quietly(two_workers, capfd):
    """Back-to-back restarts must not lose a worker for good.

    Dask's ``SpecCluster`` closes a nanny whose worker is away when ``lost-worker-timeout``
    runs out; a slot restarted again inside that window used to be lost (the next pool
    waited 60-120 s). A short timeout makes every restart fall inside the window.
    """
    cluster = two_workers._owned_cluster
    nannies = dict(cluster.workers)
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "50ms"}):
        for round_ in range(3):
            group = hf.WorkerGroup(hf.ResourcePool([2]), Guarded, backend=two_workers)
            try:
                assert group.total(round_) == [2 * round_, 2 * round_]
            finally:
                group.shutdown()
        # The same nannies restarted their processes: none was closed and replaced.
        assert {name: id(n) for name, n in cluster.workers.items()} == {
            name: id(n) for name, n in nannies.items()
        }
    assert "Restarting worker" not in capfd.readouterr().err
