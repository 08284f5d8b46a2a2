"""``hf.Recovery``: a step retried after a real worker kill, restore told the rebuilt
ranks, the error re-raised once the retries are spent, other errors untouched.

These tests kill worker processes, so the module starts its own small cluster (an owned
``DaskBackend``) instead of using the session cluster other tests share; the nanny
restarts each killed worker, so the cluster heals between tests.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError


class Counter(hf.Worker):
    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.count = start

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def bump(self) -> int:
        self.count += 1
        return self.count

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def set_count(self, value: int) -> None:
        self.count = value


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def own_backend():
    backend = DaskBackend(n_workers=2)
    yield backend
    backend.shutdown()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


class Restores:
    """A ``restore`` that records what it was told and sets every rank's count."""

    def __init__(self, group: hf.WorkerGroup, value: int = 100) -> None:
        self.group, self.value, self.calls = group, value, []

    def __call__(self, rebuilt: dict[str, list[int]]) -> None:
        self.calls.append(rebuilt)
        self.group.set_count(self.value)


@pytest.mark.cluster
def test_a_step_is_retried_after_a_real_worker_kill_and_restore_gets_the_rebuilt_ranks(
    own_backend, hf_worker_group
):
    pool = hf.ResourcePool([2])
    counters = hf_worker_group(hf.ClassWithInitArgs(Counter, 10), pool, backend=own_backend)
    echoes = hf_worker_group(Echo, pool, backend=own_backend)  # colocated: same processes
    restore = Restores(counters)
    recovery = hf.Recovery([counters, echoes], restore)
    pids = counters.pid()
    attempts = []

    def step():
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            _kill(pids[1])
        return counters.bump()

    assert recovery.run(step, step=7) == [101, 101]  # restored to 100 on both, then bumped
    assert attempts == [1, 2]
    assert restore.calls == [{counters.name_prefix: [1], echoes.name_prefix: [1]}]
    [record] = recovery.records
    assert record.step == 7 and record.ranks == restore.calls[0]
    assert record.seconds > 0 and record.error.startswith("WorkerLostError")
    assert record.to_dict()["ranks"] == {counters.name_prefix: [1], echoes.name_prefix: [1]}
    new_pids = counters.pid()
    assert new_pids[0] == pids[0] and new_pids[1] != pids[1]
    assert echoes.pid() == new_pids  # both groups rebuilt on the same new process
    assert recovery.dead_ranks() == {}


@pytest.mark.cluster
def test_a_survivors_error_counts_as_a_lost_worker_when_a_rank_is_found_dead(
    own_backend, hf_worker_group
):
    """A collective fails on the survivors, often before the driver hears of the death."""
    counters = hf_worker_group(Counter, [2], backend=own_backend)
    restore = Restores(counters)
    recovery = hf.Recovery(counters, restore, grace_s=10)
    pids = counters.pid()
    attempts = []

    def step():
        attempts.append(1)
        if len(attempts) == 1:
            _kill(pids[0])
            raise RuntimeError("gloo: connection reset by peer")  # before anyone noticed
        return counters.bump()

    assert recovery.run(step) == [101, 101]
    assert restore.calls == [{counters.name_prefix: [0]}]
    assert recovery.records[0].step == 1  # no label given: the run's number
    assert recovery.records[0].error == "RuntimeError: gloo: connection reset by peer"


@pytest.mark.cluster
def test_the_error_is_reraised_once_the_retries_are_spent(own_backend, hf_worker_group):
    counters = hf_worker_group(Counter, [2], backend=own_backend)
    restore = Restores(counters)
    recovery = hf.Recovery([counters], restore, retries=1)

    def step():  # loses a worker every time
        _kill(counters.pid()[1])
        time.sleep(0.2)
        return counters.bump()

    with pytest.raises(WorkerLostError, match="rank 1"):
        recovery.run(step, step="s")
    assert len(restore.calls) == 1 and [r.step for r in recovery.records] == ["s"]
    assert counters.recover() == [1]  # the second loss was left for the caller
    assert counters.bump()[1] == 1  # rebuilt from __init__, not restored


class Boom(Exception):
    pass


@pytest.mark.cluster
def test_other_exceptions_pass_through_untouched(own_backend, hf_worker_group):
    counters = hf_worker_group(Counter, [2], backend=own_backend)
    restore = Restores(counters)
    recovery = hf.Recovery([counters], restore, retries=3, grace_s=0.3)
    error = Boom("not a lost worker")
    calls = []

    def step():
        calls.append(1)
        raise error

    start = time.monotonic()
    with pytest.raises(Boom) as caught:
        recovery.run(step)
    assert caught.value is error and not getattr(error, "__notes__", None)
    assert time.monotonic() - start < 3  # the grace period, not more
    assert len(calls) == 1 and restore.calls == [] and recovery.records == []

    recovery.grace_s = 0  # only WorkerLostError counts: re-raised at once
    with pytest.raises(Boom):
        recovery.run(step)
    assert len(calls) == 2 and restore.calls == []

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not an Exception: never caught
        recovery.run(interrupted)
    assert counters.bump() == [1, 1]  # nothing was recovered or restored


def test_a_lost_worker_outside_the_groups_is_reraised_with_a_note(hf_local_backend):
    group = hf.WorkerGroup(hf.ResourcePool([1]), Counter, backend=hf_local_backend)
    restore = Restores(group)
    recovery = hf.Recovery([group], restore)

    def step():
        raise WorkerLostError("rank 0 of worker group 'elsewhere' died")

    with pytest.raises(WorkerLostError) as caught:
        recovery.run(step)
    if hasattr(caught.value, "add_note"):  # Python 3.11+
        assert "nothing was recovered" in caught.value.__notes__[-1]
    assert restore.calls == [] and recovery.records == []


def test_it_checks_its_arguments(hf_local_backend):
    fused_cls = hf.create_colocated_worker_cls({"a": hf.ClassWithInitArgs(Counter)})
    fused = hf.WorkerGroup(hf.ResourcePool([1]), fused_cls, backend=hf_local_backend)
    view = fused.spawn(["a"])["a"]
    with pytest.raises(ValueError, match="fused group"):
        hf.Recovery([view], lambda rebuilt: None)
    with pytest.raises(ValueError, match="at least one"):
        hf.Recovery([], lambda rebuilt: None)
    with pytest.raises(TypeError, match="callable"):
        hf.Recovery(fused, None)
    with pytest.raises(ValueError, match="retries"):
        hf.Recovery(fused, lambda rebuilt: None, retries=-1)
    assert hf.Recovery(fused, lambda rebuilt: None).run(lambda: 42) == 42


@pytest.mark.cluster
def test_it_works_on_a_cluster_attached_by_address(own_backend, hf_worker_group):
    # The module's cluster (its workers are killed here anyway), attached by its address
    # from a second backend: one the backend did not start.
    own_backend.client.wait_for_workers(2, timeout=60)  # whole again after earlier kills
    with DaskBackend(address=own_backend.cluster.scheduler_address) as backend:
        counters = hf_worker_group(Counter, [2], backend=backend)
        restore = Restores(counters, value=5)
        recovery = hf.Recovery([counters], restore)
        pids = counters.pid()
        killed = []

        def step():
            if not killed:
                killed.append(pids[0])
                _kill(pids[0])
            return counters.bump()

        assert recovery.run(step) == [6, 6]
        assert restore.calls == [{counters.name_prefix: [0]}]
        counters.shutdown()
