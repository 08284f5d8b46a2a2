"""Colocation (fused workers, shared pools) and resource pool surgery (split, merge, manager)."""

from __future__ import annotations

import pytest
import torch
from core_helpers import assert_same_data, make_batch

import hybridflow_dask as hf
from hybridflow_dask import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    ResourcePoolManager,
    Worker,
    create_colocated_worker_cls,
    merge_resource_pool,
    register,
    split_resource_pool,
)
from hybridflow_dask.backends import LocalBackend


class Actor(Worker):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.direct_calls = 0

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def act(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"obs": data.batch["obs"] * self.scale, "rank": torch.full((len(data),), self.rank)}
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int, int]:
        return "actor", self.rank, self.world_size

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def generate_direct(self, prompt: str) -> str:
        self.direct_calls += 1
        return prompt

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def direct_call_count(self) -> int:
        return self.direct_calls


class Critic(Worker):
    def __init__(self, bias: float = 0.0) -> None:
        super().__init__()
        self.bias = bias

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def value(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"value": data.batch["obs"].sum(-1) + self.bias})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int, int]:
        return "critic", self.rank, self.world_size


class Ranked(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_plus(self, offset: int) -> int:
        return self.rank + offset

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def local_place(self) -> tuple[int, int, int]:
        return self.rank, self.local_rank, self.local_world_size


def pids(wg) -> list[int]:
    return [info["pid"] for info in wg._process_info()]


def slot_indices(wg) -> list[int]:
    return [slot.index for slot in wg._rank_slots()]


# ---- fused workers ------------------------------------------------------------------------


def fused_roles() -> ClassWithInitArgs:
    return create_colocated_worker_cls(
        {
            "actor": ClassWithInitArgs(Actor, scale=3.0),
            "critic": ClassWithInitArgs(Critic, bias=0.5),
        }
    )


def test_fused_group_spawns_role_groups_equal_to_separate_groups(backend, hf_worker_group):
    batch = make_batch(6)
    fused = hf_worker_group(fused_roles(), [2], backend=backend)
    roles = fused.spawn(prefix_set={"actor", "critic"})
    assert set(roles) == {"actor", "critic"}
    actor_out = roles["actor"].act(batch)
    critic_out = roles["critic"].value(batch)
    assert roles["actor"].describe() == [("actor", 0, 2), ("actor", 1, 2)]
    assert roles["critic"].describe() == [("critic", 0, 2), ("critic", 1, 2)]

    separate_pool = ResourcePool([2])
    actor = hf_worker_group(ClassWithInitArgs(Actor, scale=3.0), separate_pool, backend=backend)
    critic = hf_worker_group(ClassWithInitArgs(Critic, bias=0.5), separate_pool, backend=backend)
    assert_same_data(actor_out, actor.act(batch))
    assert_same_data(critic_out, critic.value(batch))


def test_fused_group_exposes_role_prefixed_methods(backend, hf_worker_group):
    batch = make_batch(4)
    fused = hf_worker_group(fused_roles(), [2], backend=backend)
    for name in ("actor_act", "actor_describe", "critic_value", "critic_describe"):
        assert callable(getattr(fused, name)), name
    assert fused.actor_describe() == [("actor", 0, 2), ("actor", 1, 2)]
    assert fused.critic_describe() == [("critic", 0, 2), ("critic", 1, 2)]
    assert torch.equal(fused.actor_act(batch).batch["obs"], batch.batch["obs"] * 3.0)
    # Both roles live in one object per rank, so in one process.
    roles = fused.spawn(prefix_set=["actor", "critic"])
    assert pids(roles["actor"]) == pids(roles["critic"]) == pids(fused)


def test_groups_on_one_pool_are_colocated(backend, hf_worker_group):
    pool = ResourcePool([2])
    actor = hf_worker_group(Actor, pool, backend=backend)
    critic = hf_worker_group(Critic, pool, backend=backend)
    assert pids(actor) == pids(critic)
    assert slot_indices(actor) == slot_indices(critic) == [0, 1]
    if not isinstance(backend, LocalBackend):
        assert len(set(pids(actor))) == 2  # one process per rank


def test_direct_rollout_method_refuses_driver_calls(backend, hf_worker_group):
    wg = hf_worker_group(Actor, [2], backend=backend)
    with pytest.raises(TypeError, match="DIRECT_ROLLOUT_METHOD"):
        wg.generate_direct("hi")
    fused = hf_worker_group(fused_roles(), [2], backend=backend)
    with pytest.raises(TypeError, match="DIRECT_ROLLOUT_METHOD"):
        fused.actor_generate_direct("hi")
    assert wg.direct_call_count() == [0, 0]
    assert fused.actor_direct_call_count() == [0, 0]


# ---- split, merge, manager ----------------------------------------------------------------


def test_split_pools_give_groups_on_distinct_slots(backend, hf_worker_group):
    first_pool, second_pool = split_resource_pool(ResourcePool([4]), 2)
    assert first_pool.world_size == second_pool.world_size == 2
    first = hf_worker_group(Ranked, first_pool, backend=backend)
    second = hf_worker_group(Ranked, second_pool, backend=backend)
    assert first.world_size == second.world_size == 2
    # Each group numbers its ranks from 0; the offset shows where its rows would start.
    assert first.rank_plus(0) == [0, 1]
    assert second.rank_plus(2) == [2, 3]
    assert slot_indices(first) == [0, 1]
    assert slot_indices(second) == [2, 3]
    if not isinstance(backend, LocalBackend):
        assert not set(pids(first)) & set(pids(second))
        assert len(set(pids(first) + pids(second))) == 4


def test_split_pool_by_sizes(backend, hf_worker_group):
    small, large = split_resource_pool(ResourcePool([4]), [1, 3])
    assert (small.world_size, large.world_size) == (1, 3)
    wg = hf_worker_group(Ranked, large, backend=backend)
    assert wg.rank_plus(1) == [1, 2, 3]
    assert slot_indices(wg) == [1, 2, 3]
    with pytest.raises(ValueError):
        split_resource_pool(ResourcePool([4]), 3)
    with pytest.raises(ValueError):
        split_resource_pool(ResourcePool([4]), [1, 2])


def test_merge_resource_pool(backend, hf_worker_group):
    merged = merge_resource_pool(ResourcePool([2]), ResourcePool([1, 1]))
    assert merged.store == [2, 1, 1]
    assert merged.world_size == 4
    wg = hf_worker_group(Ranked, merged, backend=backend)
    assert wg.local_place() == [(0, 0, 2), (1, 1, 2), (2, 0, 1), (3, 0, 1)]
    with pytest.raises(ValueError, match="max_colocate_count"):
        merge_resource_pool(ResourcePool([1], max_colocate_count=1), ResourcePool([1]))
    with pytest.raises(ValueError, match="GPU"):
        merge_resource_pool(ResourcePool([1], use_gpu=True), ResourcePool([1], use_gpu=False))


def test_resource_pool_manager_creates_and_maps_pools(backend, hf_worker_group):
    manager = ResourcePoolManager(
        {"global_pool": [2], "reward_pool": [1]},
        {"actor": "global_pool", "critic": "global_pool", "reward": "reward_pool"},
    )
    pools = manager.create_resource_pool()
    assert set(pools) == {"global_pool", "reward_pool"}
    assert manager.get_resource_pool("actor") is manager.get_resource_pool("critic")
    assert manager.get_resource_pool("reward").world_size == 1
    assert manager.get_n_gpus() == 3
    with pytest.raises(ValueError, match="no resource pool"):
        manager.get_resource_pool("ref")
    with pytest.raises(ValueError, match="lacks"):
        ResourcePoolManager({"a": [1]}, {"actor": "b"})
    actor = hf_worker_group(Actor, manager.get_resource_pool("actor"), backend=backend)
    critic = hf_worker_group(Critic, manager.get_resource_pool("critic"), backend=backend)
    assert pids(actor) == pids(critic)


def test_spawned_views_support_execute_all_and_close_with_the_fused_group(backend):
    fused_cls = hf.create_colocated_worker_cls(
        {"a": hf.ClassWithInitArgs(_ViewRole), "b": hf.ClassWithInitArgs(_ViewRole)}
    )
    fused = hf.WorkerGroup(hf.ResourcePool([2]), fused_cls, backend=backend)
    views = fused.spawn(["a", "b"])
    assert views["a"].execute_all_sync("hello") == ["hi", "hi"]
    fused.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        views["b"].hello()


class _ViewRole(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def hello(self):
        return "hi"
