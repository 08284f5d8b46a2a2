"""Light ranks (two or more ranks of one group in one process) keep their threads on the
CPU their calls arrive on; a process's only rank of a group keeps the process's mask."""

from __future__ import annotations

import os
import threading

import pytest

from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.hosting import Call, Instances, PickleCopy
from hybridflow_dask.backends.hosting.cpu_share import current_cpu

ALLOWED = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(
    current_cpu() is None or len(ALLOWED) < 2,
    reason="needs Linux's sched_getcpu and a process allowed on two CPUs or more",
)


class Mask:
    def mask(self) -> set[int]:
        return os.sched_getaffinity(0)

    def policy(self) -> int:
        return os.sched_getscheduler(0)


def _plain(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    return args, kwargs, ()


_next: dict[str, int] = {}  # an instance's next call number


def _add(instances: Instances, group: str, rank: int) -> InstanceRef:
    ref = InstanceRef(group, rank, Slot(rank, "local", "127.0.0.1"))
    env = {"HF_T_RANK": str(rank), "HF_T_GROUP": group}
    init = Call(ref.key, "d", 1, "__init__", (), {})
    instances.construct_now(ref, Mask, env, init, _plain).result(10)
    _next[ref.key] = 2
    return ref


def _masks_from(cpu: int, instances: Instances, refs: list[InstanceRef], seq: int) -> list:
    """Each rank's CPU mask, seen by its method, with the calls (number ``seq``, or the
    first after ``__init__`` for a rank created since) delivered from ``cpu``."""
    out: list = []

    def deliver() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only: it is the delivering thread
        futures = [
            instances.serve_now(
                Call(ref.key, "d", min(seq, _next[ref.key]), "mask", (), {}, result="now"),
                _plain,
            )
            for ref in refs
        ]
        for ref in refs:
            _next[ref.key] = min(seq, _next[ref.key]) + 1
        out.extend(f.result(10) for f in futures)

    thread = threading.Thread(target=deliver)
    thread.start()
    thread.join(20)
    return out


@pytest.fixture
def instances(monkeypatch):
    for name in ("HF_T_RANK", "HF_T_GROUP"):  # the gate leaves the last rank's in place
        monkeypatch.delenv(name, raising=False)  # taken out again after the test
    table = Instances(PickleCopy())
    yield table
    table.stop_all()


def test_light_ranks_threads_follow_the_cpu_their_calls_arrive_on(instances):
    refs = [_add(instances, "light", rank) for rank in range(3)]
    first, second = sorted(ALLOWED)[:2]
    assert _masks_from(first, instances, refs, 2) == [{first}] * 3
    assert _masks_from(second, instances, refs, 3) == [{second}] * 3


def test_the_only_rank_of_a_group_in_a_process_keeps_the_process_mask(instances):
    ref = _add(instances, "alone", 0)
    first = sorted(ALLOWED)[0]
    assert _masks_from(first, instances, [ref], 2) == [ALLOWED]
    assert os.sched_getscheduler(instances.get(ref.key).thread_id) == os.SCHED_OTHER


def test_light_ranks_threads_wait_their_turn_instead_of_preempting_on_wake(instances):
    refs = [_add(instances, "batch", rank) for rank in range(2)]
    policies = [
        instances.serve_now(Call(ref.key, "d", 2, "policy", (), {}, result="now"), _plain).result(
            10
        )
        for ref in refs
    ]
    assert policies == [os.SCHED_BATCH] * 2


def test_a_second_rank_of_a_group_makes_both_light_and_a_rank_gone_is_let_go(instances):
    one = _add(instances, "pair", 0)
    first = sorted(ALLOWED)[0]
    assert _masks_from(first, instances, [one], 2) == [ALLOWED]
    two = _add(instances, "pair", 1)
    assert _masks_from(first, instances, [one, two], 3) == [{first}, {first}]
    share = instances.cpu_share
    assert share is not None and len(share) == 2
    instances.forget(two.key)
    assert len(share) == 1  # its thread ends: never moved again
