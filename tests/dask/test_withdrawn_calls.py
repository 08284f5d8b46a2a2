"""A call the driver reported failed never runs: the instance refuses a withdrawn call
whether the withdrawal arrives before or after it, and a lane that breaks under queued
calls withdraws them before saying so, with an error that tells what happened there."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from call_paths import backend_on

import hybridflow_dask as hf
from hybridflow_dask.backends import WorkerLostError
from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.hosting import Actor, EnvGate


class _Job:
    def __init__(self, ran: list[int], n: int) -> None:
        self.ran, self.n = ran, n

    def __call__(self, actor: Actor) -> int:
        self.ran.append(self.n)
        return self.n


@pytest.fixture
def actor():
    ref = InstanceRef("g", 0, Slot(0, "local", "127.0.0.1"))
    hosted = Actor(ref, {}, EnvGate())
    yield hosted
    hosted.stop()


def test_a_call_withdrawn_before_it_arrives_never_runs_and_later_calls_go_ahead(actor):
    ran: list[int] = []
    assert actor.skip("d", 2) is True
    first = actor.submit("d", 1, _Job(ran, 1))
    late = actor.submit("d", 2, _Job(ran, 2))  # the call's copy arrives after its withdrawal
    third = actor.submit("d", 3, _Job(ran, 3))
    assert first.result(5) == 1 and third.result(5) == 3
    with pytest.raises(RuntimeError, match="withdrawn"):
        late.result(5)
    assert ran == [1, 3]


def test_a_queued_call_withdrawn_fails_at_once_and_never_runs(actor):
    ran: list[int] = []
    gate = threading.Event()
    blocker = actor.submit("d", 1, lambda _: gate.wait(5))
    queued = actor.submit("d", 2, _Job(ran, 2))
    assert actor.skip("d", 2) is True
    with pytest.raises(RuntimeError, match="withdrawn"):
        queued.result(5)
    gate.set()
    blocker.result(5)
    assert actor.submit("d", 3, _Job(ran, 3)).result(5) == 3
    assert ran == [3]


def test_withdrawing_a_call_that_already_ran_says_so(actor):
    ran: list[int] = []
    assert actor.submit("d", 1, _Job(ran, 1)).result(5) == 1
    assert actor.skip("d", 1) is False


class Busy(hf.Worker):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        self.seen.append("slow")
        return "slow"

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def record(self, tag: str, payload: torch.Tensor) -> int:
        self.seen.append(tag)
        return payload.numel()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def log(self) -> list[str]:
        return list(self.seen)


@pytest.mark.parametrize("path", ["lane", "lane-socket-only"])
def test_calls_queued_on_a_lane_that_breaks_are_reported_truly_and_the_withdrawn_never_run(
    path, hf_dask_cluster
):
    with backend_on(path, hf_dask_cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Busy, backend=backend)
        group.log()  # the lane is open
        outcome: dict[str, BaseException | object] = {}

        def call(name: str, fn, *args) -> None:
            try:
                outcome[name] = fn(*args)
            except BaseException as exc:
                outcome[name] = exc

        slow = threading.Thread(target=call, args=("slow", group.slow, 1.5))
        slow.start()
        time.sleep(0.3)  # running now
        big = torch.ones(1 << 19)  # 2 MiB: left in this process's memory for the worker
        late = threading.Thread(target=call, args=("late", group.record, "late", big))
        late.start()
        time.sleep(0.3)  # queued behind the slow call
        (lane,) = [lane for lane in backend._direct._lanes.values() if lane is not None]
        lane.close()  # the connection breaks; the worker lives on
        slow.join(20), late.join(20)
        assert isinstance(outcome["late"], WorkerLostError), outcome
        assert "did not run there and will not" in str(outcome["late"])
        assert isinstance(outcome["slow"], WorkerLostError), outcome
        assert "had already started" in str(outcome["slow"])
        time.sleep(1.5)  # the slow call finishes there
        assert group.log() == [["slow"]]
        group.shutdown()
