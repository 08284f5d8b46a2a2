"""Auto padding, non-blocking DP calls and chains of them: row counts always survive."""

from __future__ import annotations

import copy

import pytest
import torch
from core_helpers import assert_same_data, make_batch, rows

import hybridflow_dask as hf
from hybridflow_dask import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    Dispatch,
    ResourcePool,
    Worker,
    register,
    split_resource_pool,
)

LENGTHS = range(1, 21)


class RowWorker(Worker):
    """``obs * 2 + 1`` per row, keeping ``idx`` and ``uid``; counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def transform(self, data: DataProto) -> DataProto:
        self.calls += 1
        return _transformed(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def transform_later(self, data: DataProto) -> DataProto:
        self.calls += 1
        return _transformed(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_count(self) -> int:
        return self.calls


class AddOne(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stage_a(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"obs": data.batch["obs"] + 1, "idx": data.batch["idx"]})


class TimesTwo(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def stage_b(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"obs": data.batch["obs"] * 2, "idx": data.batch["idx"]})


def _transformed(data: DataProto) -> DataProto:
    return DataProto.from_dict(
        {"obs": data.batch["obs"] * 2 + 1, "idx": data.batch["idx"]},
        {"uid": data.non_tensor_batch["uid"]},
    )


def check_transformed(out: DataProto, batch: DataProto) -> None:
    assert len(out) == len(batch)
    assert torch.equal(out.batch["obs"], batch.batch["obs"] * 2 + 1)
    assert rows(out) == rows(batch)
    assert rows(out, "uid") == rows(batch, "uid")


def run_every_length(wg, *, per_batch_flag: bool = False) -> None:
    for n in LENGTHS:
        batch = make_batch(n, auto_padding=per_batch_flag)
        before = copy.deepcopy(batch)
        check_transformed(wg.transform(batch), batch)
        check_transformed(wg.transform(data=batch), batch)
        assert_same_data(batch, before)  # the caller's batch is never padded in place


# ---- auto padding -------------------------------------------------------------------------


def test_auto_padding_global_config_every_length(backend, hf_worker_group):
    wg = hf_worker_group(RowWorker, [4], backend=backend)
    DataProtoConfig.auto_padding = True
    try:
        run_every_length(wg)
    finally:
        DataProtoConfig.auto_padding = False


def test_auto_padding_env_var_every_length(backend, hf_worker_group, monkeypatch):
    wg = hf_worker_group(RowWorker, [4], backend=backend)
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    run_every_length(wg)


def test_auto_padding_per_batch_flag_every_length(backend, hf_worker_group):
    wg = hf_worker_group(RowWorker, [4], backend=backend)
    run_every_length(wg, per_batch_flag=True)


def test_without_padding_uneven_batch_fails_before_any_call(backend, hf_worker_group):
    wg = hf_worker_group(RowWorker, [4], backend=backend)
    batch = make_batch(6)
    with pytest.raises(ValueError, match="not divisible by 4"):
        wg.transform(batch)
    with pytest.raises(ValueError, match="not divisible by 4"):
        wg.transform(data=batch)
    with pytest.raises(ValueError, match="not divisible by 4"):
        wg.transform_later(batch)
    assert wg.call_count() == [0, 0, 0, 0]
    check_transformed(wg.transform(make_batch(8)), make_batch(8))  # divisible: fine


# ---- non-blocking DP calls -------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 7])
def test_non_blocking_dp_call_returns_a_future_equal_to_blocking(backend, hf_worker_group, n):
    wg = hf_worker_group(RowWorker, [4], backend=backend)
    batch = make_batch(n, auto_padding=True)
    future = wg.transform_later(batch)
    assert isinstance(future, DataProtoFuture)
    blocking = wg.transform(batch)
    check_transformed(blocking, batch)
    assert_same_data(future.get(), blocking)
    assert_same_data(hf.get(future), blocking)


# ---- chains of groups with different world sizes --------------------------------------------


def chain_pools(size_a: int, size_b: int) -> tuple[ResourcePool, ResourcePool]:
    """Pools for A and B that overlap on one placement, so a 4-worker cluster hosts both.

    The larger group takes the whole pool, the smaller one a split of it (equal sizes share
    the pool: the colocated path); the rows still have to be re-split from ``size_a``
    producers to ``size_b`` consumers.
    """
    big = ResourcePool([max(size_a, size_b)])
    small = min(size_a, size_b)
    sub = (
        big
        if small == big.world_size
        else split_resource_pool(big, [small, big.world_size - small])[0]
    )
    return (big, sub) if size_a >= size_b else (sub, big)


@pytest.mark.parametrize(("size_a", "size_b"), [(2, 3), (3, 2), (4, 1), (4, 4)])
def test_chain_between_world_sizes_keeps_rows(backend, hf_worker_group, size_a, size_b):
    pool_a, pool_b = chain_pools(size_a, size_b)
    wg_a = hf_worker_group(AddOne, pool_a, backend=backend)
    wg_b = hf_worker_group(TimesTwo, pool_b, backend=backend)
    assert (wg_a.world_size, wg_b.world_size) == (size_a, size_b)
    for n in range(1, 10):
        batch = make_batch(n, auto_padding=True)
        future = wg_a.stage_a(batch)
        assert isinstance(future, DataProtoFuture)
        out = wg_b.stage_b(future)
        assert len(out) == n, f"{n} rows in, {len(out)} out"
        assert rows(out) == list(range(n))
        assert torch.equal(out.batch["obs"], (batch.batch["obs"] + 1) * 2)
