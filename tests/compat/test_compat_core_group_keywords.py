"""verl parity: verl's WorkerGroup keywords and attributes."""

from __future__ import annotations

import os

import pytest

from hybridflow_dask import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register


class Keeper(Worker):
    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.value = start + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def read(self) -> int:
        return self.value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rendezvous(self) -> tuple[str, str]:
        return os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]


@pytest.fixture
def groups(hf_local_backend):
    made = []
    yield made
    for group in reversed(made):
        group.shutdown()


def test_group_takes_verls_keyword_names_and_refuses_unknown_ones(hf_local_backend, groups):
    cwia = ClassWithInitArgs(Keeper, start=10)
    wg = WorkerGroup(
        resource_pool=ResourcePool([2]),
        ray_cls_with_init=cwia,
        backend=hf_local_backend,
        device_name="cuda",
        ray_wait_register_center_timeout=300,
        profile_steps=None,
        worker_nsight_options=None,
    )
    groups.append(wg)
    assert wg.read() == [10, 11]
    assert wg.ray_cls_with_init is cwia and wg.device_name == "cuda"
    with pytest.raises(TypeError, match="bogus"):
        WorkerGroup(ResourcePool([1]), Keeper, backend=hf_local_backend, bogus=1)
    with pytest.raises(TypeError, match="not both"):
        WorkerGroup(ResourcePool([1]), Keeper, ray_cls_with_init=Keeper, backend=hf_local_backend)


def test_group_takes_verls_positional_order(hf_local_backend, groups):
    wg = WorkerGroup(ResourcePool([2]), Keeper, True, "compat_positional", backend=hf_local_backend)
    groups.append(wg)
    assert wg.name_prefix == "compat_positional"


def test_group_has_verls_attributes(hf_local_backend, groups):
    pool = ResourcePool([2])
    wg = WorkerGroup(pool, Keeper, backend=hf_local_backend)
    groups.append(wg)
    assert len(wg.workers) == wg.world_size == 2
    assert wg.resource_pool is pool
    assert {"read", "rendezvous", "execute_func_rank_zero"} <= set(wg.method_names)
    assert wg.fused_worker_used is False and wg.sub_cls_name == ""
    assert wg.rendezvous() == [(wg.master_address, wg.master_port)] * 2
    assert isinstance(wg.master_port, str)
    wg.start_worker_aliveness_check(every_n_seconds=1)


def test_group_attaches_by_names_handles_or_prefix(hf_local_backend, groups):
    wg = WorkerGroup(ResourcePool([2]), ClassWithInitArgs(Keeper, 5), backend=hf_local_backend)
    groups.append(wg)
    by_names = WorkerGroup.from_detached(
        worker_names=wg.worker_names, ray_cls_with_init=Keeper, backend=hf_local_backend
    )
    by_handles = WorkerGroup(None, Keeper, worker_handles=wg.workers, backend=hf_local_backend)
    by_prefix = WorkerGroup(None, Keeper, name_prefix=wg.name_prefix, backend=hf_local_backend)
    for attached in (by_names, by_handles, by_prefix):
        assert attached.read() == [5, 6]
        assert attached._is_init_with_detached_workers


def test_none_pool_without_workers_is_a_clear_error(hf_local_backend):
    with pytest.raises(ValueError, match="resource_pool=None attaches"):
        WorkerGroup(None, Keeper, backend=hf_local_backend)
    with pytest.raises(ValueError, match="no worker named"):
        WorkerGroup.from_detached(
            worker_names=["ghost/0"], ray_cls_with_init=Keeper, backend=hf_local_backend
        )


def test_master_addr_and_port_reach_the_ranks_and_use_gpu_is_checked(hf_local_backend, groups):
    wg = WorkerGroup(
        ResourcePool([2]),
        Keeper,
        backend=hf_local_backend,
        master_addr="10.1.2.3",
        master_port=29511,
    )
    groups.append(wg)
    assert wg.rendezvous() == [("10.1.2.3", "29511")] * 2
    assert (wg.master_address, wg.master_port) == ("10.1.2.3", "29511")
    with pytest.raises(ValueError, match="both master_addr and master_port"):
        WorkerGroup(ResourcePool([1]), Keeper, backend=hf_local_backend, master_addr="10.1.2.3")
    with pytest.raises(ValueError, match="use_gpu=True"):
        WorkerGroup(
            ResourcePool([1], use_gpu=False), Keeper, backend=hf_local_backend, use_gpu=True
        )


def test_verls_other_names_exist():
    from hybridflow_dask.colocate import create_colocated_worker_cls_fused
    from hybridflow_dask.decorators import MAGIC_ATTR, Execute, get_predefined_execute_fn

    attrs = getattr(Keeper.read, MAGIC_ATTR)
    assert attrs["dispatch_mode"] is Dispatch.ONE_TO_ALL and attrs["blocking"] is True
    assert get_predefined_execute_fn(Execute.RANK_ZERO) == {"execute_fn_name": "execute_rank_zero"}
    assert WorkerGroup.fused_worker_execute_fn_name == "_fuw_execute"
    assert WorkerGroup.spawn_fused is WorkerGroup.spawn
    assert create_colocated_worker_cls_fused({"k": Keeper}).fused_worker_used
