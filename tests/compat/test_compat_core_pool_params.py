"""verl parity: ResourcePool and its functions take verl's parameters."""

from __future__ import annotations

import inspect

import pytest

from hybridflow_dask import (
    ClassWithInitArgs,
    Dispatch,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    WorkerGroup,
    create_colocated_worker_cls,
    make_nd_compute_dataproto_dispatch_fn,
    merge_resource_pool,
    register,
    register_dispatch_mode,
    split_resource_pool,
    update_dispatch_mode,
)
from hybridflow_dask.decorators import get_predefined_dispatch_fn


class Where(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def here(self) -> int:
        return self.rank


def slots(wg: WorkerGroup) -> list[int]:
    return [slot.index for slot in wg._rank_slots()]


# ---- parameter names ----------------------------------------------------------------------------


def test_split_and_merge_take_verls_keyword_names():
    subs = split_resource_pool(resource_pool=ResourcePool([4]), split_size=2)
    assert [p.world_size for p in subs] == [2, 2]
    merged = merge_resource_pool(rp1=ResourcePool([1]), rp2=ResourcePool([2]))
    assert merged.store == [1, 2]


@pytest.mark.parametrize(
    ("func", "names"),
    [
        (split_resource_pool, ["resource_pool", "split_size"]),
        (merge_resource_pool, ["rp1", "rp2"]),
        (register, ["dispatch_mode", "execute_mode", "blocking", "materialize_futures"]),
        (register_dispatch_mode, ["dispatch_mode_name", "dispatch_fn", "collect_fn"]),
        (update_dispatch_mode, ["dispatch_mode", "dispatch_fn", "collect_fn"]),
        (get_predefined_dispatch_fn, ["dispatch_mode"]),
        (make_nd_compute_dataproto_dispatch_fn, ["mesh_name"]),
        (create_colocated_worker_cls, ["class_dict"]),
    ],
)
def test_public_functions_use_verls_parameter_names(func, names):
    assert list(inspect.signature(func).parameters)[: len(names)] == names


# ---- ResourcePool -------------------------------------------------------------------------------


def test_empty_pool_grows_with_add_node_and_places_a_group(hf_local_backend, hf_worker_group):
    pool = ResourcePool()
    assert pool.world_size == 0
    pool.add_node(2)
    assert pool.store == [2]
    assert hf_worker_group(Where, pool, backend=hf_local_backend).here() == [0, 1]


def test_empty_pool_is_refused_naming_add_node(hf_local_backend):
    with pytest.raises(ValueError, match="add_node"):
        WorkerGroup(ResourcePool(), Where, backend=hf_local_backend)


def test_pool_and_manager_take_verls_positional_order_and_keywords():
    pool = ResourcePool([2, 2], False, "gen", 3, False, None, n_gpus_per_node=16)
    assert (pool.use_gpu, pool.name_prefix, pool.max_colocate_count) == (False, "gen", 3)
    assert pool.n_gpus_per_node == 16 and pool.detached is False
    manager = ResourcePoolManager({"global_pool": [2]}, {"actor": "global_pool"}, 1)
    assert manager.get_resource_pool("actor").max_colocate_count == 1


def test_merge_accepts_placed_pools_and_colocates_on_their_slots(hf_local_backend, hf_worker_group):
    first, second = ResourcePool([2], name_prefix="a"), ResourcePool([1], name_prefix="b")
    on_first = hf_worker_group(Where, first, backend=hf_local_backend)
    merged = merge_resource_pool(first, second)
    assert merged.name_prefix == "a_b"
    on_merged = hf_worker_group(Where, merged, backend=hf_local_backend)
    assert on_merged.here() == [0, 1, 2]
    # The merged group's first ranks share the first pool's slots.
    assert on_merged._rank_slots()[:2] == on_first._rank_slots()


def test_merge_refuses_pools_with_mismatched_limits():
    with pytest.raises(ValueError, match="max_colocate_count"):
        merge_resource_pool(ResourcePool([1], max_colocate_count=1), ResourcePool([1]))
    with pytest.raises(ValueError, match="n_gpus_per_node"):
        merge_resource_pool(ResourcePool([1], n_gpus_per_node=4), ResourcePool([1]))


def test_max_colocate_count_is_enforced_until_the_group_shuts_down(
    hf_local_backend, hf_worker_group
):
    pool = ResourcePool([2], max_colocate_count=1)
    first = hf_worker_group(Where, pool, backend=hf_local_backend)
    with pytest.raises(ValueError, match="max_colocate_count=1"):
        WorkerGroup(pool, Where, backend=hf_local_backend)
    first.shutdown()
    # The slot is free again once the group is gone.
    assert hf_worker_group(Where, pool, backend=hf_local_backend).here() == [0, 1]


def test_colocation_limit_counts_per_slot(hf_local_backend, hf_worker_group):
    root = ResourcePool([4], max_colocate_count=1)
    left, right = split_resource_pool(root, 2)
    hf_worker_group(Where, left, backend=hf_local_backend)
    assert slots(hf_worker_group(Where, right, backend=hf_local_backend)) == [2, 3]
    with pytest.raises(ValueError, match=r"slot\(s\) \[0, 1, 2, 3\]"):
        WorkerGroup(root, Where, backend=hf_local_backend)


def test_fused_roles_count_as_one_group_for_the_colocation_limit(hf_local_backend, hf_worker_group):
    pool = ResourcePool([2], max_colocate_count=1)
    fused = create_colocated_worker_cls({"a": ClassWithInitArgs(Where), "b": Where})
    group = hf_worker_group(fused, pool, backend=hf_local_backend)
    views = group.spawn(["a", "b"])
    assert views["a"].here() == views["b"].here() == [0, 1]
