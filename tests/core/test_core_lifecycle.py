"""A group's life (attach, context manager, shutdown), by-value calls, the default backend."""

from __future__ import annotations

import copy
import uuid

import numpy as np
import pytest
import torch
from core_helpers import assert_same_data, make_batch

import hybridflow_dask as hf
from hybridflow_dask import DataProto, Dispatch, ResourcePool, Worker, WorkerGroup, register
from hybridflow_dask.backends import LocalBackend


class Keeper(Worker):
    """Holds a list per rank; methods that mutate what they are given or what they return."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def append(self, item) -> int:
        self.items.append(item)
        return len(self.items)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def contents(self) -> list:
        return self.items  # the live list: a by-value backend must hand out a copy

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scribble_on(self, values: list) -> list:
        values.append(f"rank {self.rank} was here")
        return values

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scribble_on_shard(self, data: DataProto) -> DataProto:
        data.batch["obs"].add_(100)
        data.non_tensor_batch["uid"][0] = "overwritten"
        data.meta_info["touched"] = True
        return data


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def test_from_detached_attaches_by_name(backend, hf_worker_group):
    name = unique("keeper")
    owner = hf_worker_group(Keeper, [2], backend=backend, name_prefix=name)
    owner.append("x")
    attached = WorkerGroup.from_detached(name, Keeper, backend=backend)
    assert attached.world_size == 2
    assert attached.worker_names == owner.worker_names
    assert attached.contents() == [["x"], ["x"]]
    assert attached.append("y") == [2, 2]
    # The attached handle does not own the instances: its shutdown leaves them running.
    attached.shutdown()
    assert owner.contents() == [["x", "y"], ["x", "y"]]
    with pytest.raises(ValueError, match="no worker group"):
        WorkerGroup.from_detached(unique("missing"), Keeper, backend=backend)
    with pytest.raises(ValueError, match="only the group that created the instances"):
        attached.recover()


def test_recover_with_every_rank_alive_changes_nothing(backend, hf_worker_group):
    group = hf_worker_group(Keeper, [2], backend=backend)
    group.append("kept")
    assert group.recover() == []
    assert group.contents() == [["kept"], ["kept"]]


def test_context_manager_shuts_the_group_down(backend):
    pool = ResourcePool([2])
    with WorkerGroup(pool, Keeper, backend=backend, name_prefix=unique("ctx")) as wg:
        assert wg.append(1) == [1, 1]
        name = wg.name_prefix
        assert len(backend.lookup(name)) == 2
    assert backend.lookup(name) == []
    with pytest.raises(RuntimeError, match="shut down"):
        wg.contents()
    # The pool's slots went back, so a new group can take them.
    with WorkerGroup(pool, Keeper, backend=backend) as again:
        assert again.contents() == [[], []]


def test_calls_after_shutdown_raise_and_shutdown_is_idempotent(backend, hf_worker_group):
    wg = hf_worker_group(Keeper, [2], backend=backend)
    wg.shutdown()
    wg.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        wg.append(1)
    with pytest.raises(RuntimeError, match="shut down"):
        wg.execute_all_sync("contents")
    with pytest.raises(RuntimeError, match="shut down"):
        wg.execute_rank_zero_sync("contents")


def test_arguments_are_passed_by_value(backend, hf_worker_group):
    wg = hf_worker_group(Keeper, [2], backend=backend)
    values = ["mine"]
    assert wg.scribble_on(values) == [["mine", "rank 0 was here"], ["mine", "rank 1 was here"]]
    assert values == ["mine"]  # and each rank got its own copy

    batch = make_batch(4)
    before = copy.deepcopy(batch)
    out = wg.scribble_on_shard(batch)
    assert_same_data(batch, before)
    assert torch.equal(out.batch["obs"], before.batch["obs"] + 100)
    assert out.non_tensor_batch["uid"].tolist() == ["overwritten", "row-1", "overwritten", "row-3"]


def test_results_are_returned_by_value(backend, hf_worker_group):
    wg = hf_worker_group(Keeper, [2], backend=backend)
    wg.append(np.arange(3))
    first = wg.contents()
    first[0].append("driver scribble")
    first[1][0][:] = -1
    second = wg.contents()
    assert len(second[0]) == len(second[1]) == 1
    assert second[0][0].tolist() == second[1][0].tolist() == [0, 1, 2]


def test_init_sets_default_backend_local():
    local = LocalBackend()
    assert hf.init(local) is local
    try:
        with pytest.raises(RuntimeError, match="already set"):
            hf.init(LocalBackend())
        with WorkerGroup(ResourcePool([2]), Keeper) as wg:
            assert wg.backend is local
            assert wg.append("via default") == [1, 1]
            assert len(local.lookup(wg.name_prefix)) == 2
    finally:
        hf.shutdown()
    hf.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        local.place([1], None, "after")
