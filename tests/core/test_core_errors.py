"""Errors: worker exceptions reach the driver whole; bad input fails before anything is sent."""

from __future__ import annotations

import uuid

import pytest
from core_helpers import make_batch

import hybridflow_dask as hf
from hybridflow_dask import (
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)

#: A Dispatch member without dispatch/collect functions: binding it must fail cleanly.
UNBOUND_MODE = Dispatch.register("CORE_TEST_UNBOUND")


class BoomError(RuntimeError):
    """A user-defined exception type: it must arrive as itself, not as a wrapper."""


def detonate_in_worker(rank: int) -> None:
    raise BoomError(f"kaboom on {rank}")


class Faulty(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def explode_on_rank_one(self) -> int:
        self.calls += 1
        if self.rank == 1:
            detonate_in_worker(self.rank)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def divide_later(self, x: int) -> float:
        return x / self.rank  # rank 0 divides by zero

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def per_rank(self, x: int, y: int = 0) -> int:
        self.calls += 1
        return x + y

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def proto(self, data: DataProto) -> DataProto:
        self.calls += 1
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> int:
        self.calls += 1
        return len(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_count(self) -> int:
        return self.calls


class FailsInInit(Worker):
    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            detonate_in_worker(self.rank)


class ClashesWithGroup(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:  # WorkerGroup.shutdown exists: cannot be bound
        pass


class UsesUnboundMode(Worker):
    @register(dispatch_mode=UNBOUND_MODE)
    def orphan(self) -> None:
        pass


def error_text(exc: BaseException) -> str:
    return "\n".join([str(exc), *getattr(exc, "__notes__", [])])


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


# ---- exceptions raised in workers ---------------------------------------------------------


def test_worker_exception_keeps_type_and_names_group_method_rank(backend, hf_worker_group):
    wg = hf_worker_group(Faulty, [2], backend=backend, name_prefix=unique("faulty"))
    with pytest.raises(BoomError, match="kaboom on 1") as info:
        wg.explode_on_rank_one()
    text = error_text(info.value)
    assert wg.name_prefix in text
    assert "explode_on_rank_one" in text
    assert "rank 1" in text
    assert "detonate_in_worker" in info.value.remote_traceback
    # The group is still usable afterwards.
    assert wg.call_count() == [1, 1]


def test_non_blocking_exception_surfaces_at_get(backend, hf_worker_group):
    wg = hf_worker_group(Faulty, [2], backend=backend)
    futures = wg.divide_later(1)
    with pytest.raises(ZeroDivisionError) as info:
        hf.get(futures)
    text = error_text(info.value)
    assert "divide_later" in text and "rank 0" in text and wg.name_prefix in text
    assert "divide_later" in info.value.remote_traceback
    assert hf.get(futures[1]) == 1.0


def test_exception_in_init_fails_creation_and_frees_the_pool(backend, hf_worker_group):
    pool = ResourcePool([4])
    name = unique("fails-in-init")
    with pytest.raises(BoomError) as info:
        hf_worker_group(FailsInInit, pool, backend=backend, name_prefix=name)
    text = error_text(info.value)
    assert name in text and "__init__" in text and "rank 1" in text
    assert backend.lookup(name) == []
    # The slots went back: a group can take the whole pool again.
    wg = hf_worker_group(Faulty, pool, backend=backend)
    assert wg.call_count() == [0, 0, 0, 0]


# ---- bad input: rejected in the driver, before any rank is called -----------------------------


def test_dp_compute_wrong_length_names_the_argument(backend, hf_worker_group):
    wg = hf_worker_group(Faulty, [4], backend=backend)
    with pytest.raises(ValueError, match=r"argument #0 .*4 items.*length 3"):
        wg.per_rank([1, 2, 3])
    with pytest.raises(ValueError, match=r"argument 'y'"):
        wg.per_rank([1, 2, 3, 4], y=[1, 2])
    with pytest.raises(ValueError, match=r"argument #0 .*got int"):
        wg.per_rank(5)
    assert wg.call_count() == [0, 0, 0, 0]
    assert wg.per_rank([1, 2, 3, 4], y=[10, 20, 30, 40]) == [11, 22, 33, 44]


def test_non_dataproto_to_proto_modes_is_a_type_error(backend, hf_worker_group):
    wg = hf_worker_group(Faulty, [2], backend=backend)
    with pytest.raises(TypeError, match="DataProto"):
        wg.proto([1, 2])
    with pytest.raises(TypeError, match="DataProto"):
        wg.proto(data={"obs": [1, 2]})
    with pytest.raises(TypeError, match="DataProto"):
        wg.metric("rows")
    with pytest.raises(TypeError, match="function"):
        wg.execute_with_func_generator("not a function", make_batch(2))
    assert wg.call_count() == [0, 0]


def test_unknown_method_name_is_rejected(backend, hf_worker_group):
    wg = hf_worker_group(Faulty, [2], backend=backend)
    for call in (wg.execute_all, wg.execute_all_sync, wg.execute_rank_zero):
        with pytest.raises(ValueError, match="no_such_method"):
            call("no_such_method")
    assert wg.call_count() == [0, 0]


def test_registered_name_clashing_with_group_attribute_is_rejected_before_placing(
    backend, hf_worker_group
):
    pool = ResourcePool([4])
    name = unique("clash")
    with pytest.raises(ValueError, match="shutdown"):
        WorkerGroup(pool, ClashesWithGroup, backend=backend, name_prefix=name)
    assert backend.lookup(name) == []
    wg = hf_worker_group(Faulty, pool, backend=backend)  # nothing kept the slots
    assert wg.world_size == 4


def test_dispatch_mode_without_functions_is_rejected_before_placing(backend, hf_worker_group):
    pool = ResourcePool([4])
    name = unique("unbound")
    with pytest.raises(ValueError, match="CORE_TEST_UNBOUND"):
        WorkerGroup(pool, UsesUnboundMode, backend=backend, name_prefix=name)
    assert backend.lookup(name) == []
    wg = hf_worker_group(Faulty, pool, backend=backend)
    assert wg.world_size == 4


def test_duplicate_name_prefix_is_rejected(backend, hf_worker_group):
    name = unique("twice")
    first = hf_worker_group(Faulty, [2], backend=backend, name_prefix=name)
    with pytest.raises(ValueError, match="already exists"):
        hf_worker_group(Faulty, [2], backend=backend, name_prefix=name)
    assert first.call_count() == [0, 0]
    assert len(backend.lookup(name)) == 2


# ---- bad input that needs no backend at all -------------------------------------------------


@pytest.mark.parametrize("nodes", [[0], [2, 0], [-1], [1.5], [True]])
def test_resource_pool_rejects_empty_or_non_positive_nodes(nodes):
    with pytest.raises(ValueError, match=r"ResourcePool|process_on_nodes"):
        ResourcePool(nodes)


def test_register_rejects_unknown_dispatch_modes():
    with pytest.raises(TypeError, match="dispatch_mode"):
        register(dispatch_mode="NO_SUCH_MODE")
    with pytest.raises(ValueError, match="collect_fn"):
        register(dispatch_mode={"dispatch_fn": lambda wg, *a, **k: (a, k)})
    with pytest.raises(TypeError, match="callable"):
        register(dispatch_mode={"dispatch_fn": 1, "collect_fn": 2})
    with pytest.raises(TypeError, match="execute_mode"):
        register(execute_mode="RANK_ZERO")
    assert Dispatch.from_name("NO_SUCH_MODE") is None  # verl's answer for an unknown name
