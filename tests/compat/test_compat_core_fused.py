"""verl parity: fused workers behave as verl's FusedWorker does."""

from __future__ import annotations

import pytest

from hybridflow_dask import (
    ClassWithInitArgs,
    Dispatch,
    Worker,
    create_colocated_worker_cls,
    register,
)


class ActorRole(Worker):
    def __init__(self, greeting: str = "hi") -> None:
        super().__init__()
        self.greeting = greeting

    def plain_hello(self, name: str) -> str:  # not registered
        return f"{self.greeting} {name} from {self.rank}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hello(self) -> str:
        return self.greeting

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ask_rollout(self) -> tuple:
        rollout = self.get_fused_worker_by_name("rollout")
        return (
            sorted(self.fused_worker_dict),
            rollout.engine_name(),
            self.get_fused_worker_by_name("x"),
        )


class RolloutRole(Worker):
    def engine_name(self) -> str:
        return "engine"

    @register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    def generate_direct(self, prompt: str) -> str:
        return prompt.upper()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ready(self) -> bool:
        return True


def fused_cls() -> ClassWithInitArgs:
    return create_colocated_worker_cls(
        {"actor": ClassWithInitArgs(ActorRole, greeting="hey"), "rollout": RolloutRole}
    )


def test_spawned_role_view_reaches_unregistered_methods(hf_local_backend, hf_worker_group):
    fused = hf_worker_group(fused_cls(), [2], backend=hf_local_backend)
    actor = fused.spawn(["actor"])["actor"]
    assert actor.execute_all_sync("plain_hello", "bo") == ["hey bo from 0", "hey bo from 1"]
    assert actor.execute_rank_zero_sync("plain_hello", "al") == "hey al from 0"
    assert actor.execute_all_sync("hello") == ["hey", "hey"]


def test_fused_roles_see_each_other(hf_local_backend, hf_worker_group):
    fused = hf_worker_group(fused_cls(), [2], backend=hf_local_backend)
    actor = fused.spawn(["actor"])["actor"]
    assert actor.ask_rollout() == [(["actor", "rollout"], "engine", None)] * 2


def test_direct_rollout_methods_are_bound_plain_and_refused_from_the_driver(
    hf_local_backend, hf_worker_group
):
    cwia = fused_cls()
    assert callable(getattr(cwia.cls, "generate_direct", None))
    assert not hasattr(cwia.cls, "rollout_generate_direct")
    fused = hf_worker_group(cwia, [2], backend=hf_local_backend)
    with pytest.raises(NotImplementedError, match="DIRECT_ROLLOUT_METHOD"):
        fused.generate_direct("p")
    # Inside the process (where a rollout engine calls it) the method works.
    assert fused.execute_all_sync("generate_direct", "p") == ["P", "P"]
    rollout = fused.spawn(["rollout"])["rollout"]
    with pytest.raises(NotImplementedError):
        rollout.generate_direct("p")
    assert rollout.execute_all_sync("generate_direct", "q") == ["Q", "Q"]


def test_fuse_binds_role_groups_with_their_sub_cls_name(hf_local_backend, hf_worker_group):
    cwia = fused_cls()
    assert cwia.fused_worker_used is True
    fused = hf_worker_group(cwia, [2], backend=hf_local_backend)
    assert fused.fused_worker_used is True and fused.sub_cls_name == ""
    fused.fuse(["actor", "rollout"])
    assert set(fused.wg_dict) == {"actor", "rollout"}
    assert fused.actor.hello() == ["hey", "hey"]
    assert fused.rollout.ready() == [True, True]
    assert fused.actor.sub_cls_name == "actor" and fused.rollout.sub_cls_name == "rollout"
