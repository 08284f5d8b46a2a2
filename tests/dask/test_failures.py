"""Real failures on the Dask backend: a killed worker process, a remote exception.

These tests kill worker processes, so the module starts its own small cluster (an owned
``DaskBackend``) instead of using the session cluster that other tests share. The nanny
restarts a killed worker at a new address, so the cluster heals between tests.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import dask
import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster


class Sleeper(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def ping(self):
        return "pong"

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def filled(self, size):
        return torch.full((size,), float(self.rank))

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def doze(self, seconds):
        time.sleep(seconds)
        return seconds

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def doze_rows(self, data):
        time.sleep(float(data.meta_info["seconds"]))
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def doze_rows_later(self, data):
        return self.doze_rows(data)


@pytest.fixture(scope="module")
def own_backend():
    backend = DaskBackend(n_workers=2)
    yield backend
    backend.shutdown()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _stopped(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` shows as stopped (state T in ``/proc``) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return True
        time.sleep(0.02)
    return False


def test_worker_killed_during_a_call_fails_it_within_5s_naming_group_and_rank(
    own_backend, hf_worker_group
):
    group = hf_worker_group(Sleeper, [2], backend=own_backend, name_prefix="sleepy")
    pids = group.pid()
    pending = group.nap(3)
    time.sleep(0.5)  # let the call start
    _kill(pids[1])
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 1 of worker group 'sleepy'"):
        hf.get(pending)
    assert time.monotonic() - start < 5


def test_worker_killed_during_a_blocking_call_fails_it_within_5s(own_backend, hf_worker_group):
    """A blocking call travels on the socket lane: its end, not the scheduler, says first."""
    group = hf_worker_group(Sleeper, [2], backend=own_backend, name_prefix="dozy")
    pids = group.pid()
    threading.Timer(0.5, _kill, args=(pids[1],)).start()
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 1 of worker group 'dozy'"):
        # Long enough to be killed mid-call; short because rank 0 dozes on, and the next
        # test's instances on its process (other variables: see EnvGate) wait for it.
        group.doze(4)
    assert time.monotonic() - start < 5


def test_worker_killed_between_calls_fails_the_next_call_within_5s(own_backend, hf_worker_group):
    group = hf_worker_group(Sleeper, [2], backend=own_backend, name_prefix="idle")
    pids = group.pid()
    assert group.ping() == ["pong", "pong"]
    _kill(pids[0])
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 0 of worker group 'idle'"):
        group.ping()
    assert time.monotonic() - start < 5
    # and again: later calls keep failing promptly instead of hanging
    start = time.monotonic()
    with pytest.raises(WorkerLostError):
        group.ping()
    assert time.monotonic() - start < 1


def test_hung_worker_is_reported_after_the_call_timeout(own_backend, hf_worker_group):
    """A stopped (SIGSTOP) process raises no error by itself: the call timeout catches it."""
    group = hf_worker_group(Sleeper, [2], backend=own_backend, name_prefix="hung")
    pids = group.pid()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        assert _stopped(pids[1]), f"process {pids[1]} (rank 1) did not stop"
        start = time.monotonic()
        with (
            dask.config.set({"hybridflow.call-timeout": "1s"}),
            pytest.raises(TimeoutError, match=r"hung\.ping on rank 1"),
        ):
            group.ping()
        assert time.monotonic() - start < 3
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert group.ping() == ["pong", "pong"]  # resumed: the group works again


class Counter(hf.Worker):
    def __init__(self, start: int) -> None:
        self.count = start

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def bump(self):
        self.count += 1
        return self.count, os.getpid()


def test_recover_recreates_dead_ranks_on_a_new_process_for_every_group_on_the_pool(
    own_backend, hf_worker_group
):
    pool = hf.ResourcePool([2])
    counters = hf_worker_group(hf.ClassWithInitArgs(Counter, 10), pool, backend=own_backend)
    sleepers = hf_worker_group(Sleeper, pool, backend=own_backend)
    before = counters.bump()
    assert [c for c, _ in before] == [11, 11]
    _kill(before[1][1])
    with pytest.raises(WorkerLostError):
        counters.bump()  # still runs on the live rank 0 (count 12 there)
    assert counters.recover() == [1]
    assert sleepers.recover() == [1]
    assert counters.recover() == []  # nothing left to recover
    after = counters.bump()
    assert after[0] == (13, before[0][1])  # the survivor kept its state and process
    assert after[1][0] == 11 and after[1][1] != before[1][1]  # rebuilt from __init__, new pid
    assert sleepers.pid() == [before[0][1], after[1][1]]  # colocation holds after recovery


def test_a_result_kept_by_a_worker_that_died_is_lost_and_one_the_driver_holds_is_not(
    own_backend, hf_worker_group
):
    group = hf_worker_group(Sleeper, [1], backend=own_backend, name_prefix="keeper")
    small, large = group.filled(4), group.filled(100_000)  # 16 B held, 400 kB kept
    deadline = time.monotonic() + 10
    while not all(f.done() for f in [*small, *large]) and time.monotonic() < deadline:
        time.sleep(0.01)  # both finished; nothing read yet
    _kill(group.pid()[0])
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 0 of worker group 'keeper'"):
        hf.get(large)
    assert time.monotonic() - start < 5
    assert hf.get(small)[0].tolist() == [0.0] * 4


def test_a_call_whose_input_died_with_its_worker_fails_naming_that_worker(
    own_backend, hf_worker_group
):
    producer = hf_worker_group(Sleeper, [1], backend=own_backend, name_prefix="maker")
    consumer = hf_worker_group(Sleeper, [1], backend=own_backend, name_prefix="taker")
    pid = producer.pid()[0]
    pending = consumer.nap(producer.nap(30)[0])  # waits for the producer's result
    time.sleep(0.5)
    _kill(pid)
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=r"rank 0 of group 'maker'"):
        hf.get(pending)
    assert time.monotonic() - start < 5


def test_a_worker_restarted_at_a_fixed_address_is_a_new_process_and_takes_the_rank_back():
    """``dask worker --worker-port``: the nanny restarts the worker at the same address."""
    from distributed import LocalCluster

    from hybridflow_dask.backends.hosting import find_free_port

    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            worker_port=find_free_port(),
        ) as cluster,
        DaskBackend(cluster=cluster) as backend,
        hf.WorkerGroup(
            hf.ResourcePool([1]), hf.ClassWithInitArgs(Counter, 0), backend=backend
        ) as group,
    ):
        [(count, pid)] = group.bump()
        address = group._rank_slots()[0].address
        _kill(pid)
        # The restart can be so quick that the call reaches the new, empty process before
        # the scheduler's removal event reaches the driver: then the worker says so itself.
        with pytest.raises((WorkerLostError, LookupError)):
            group.bump()
        assert group.recover() == [0]
        assert group._rank_slots()[0].address == address  # same address, new process
        [(count_after, pid_after)] = group.bump()
        assert (count_after, count) == (1, 1) and pid_after != pid


@pytest.mark.parametrize("blocking", [True, False], ids=["lane", "stream"])
def test_each_light_rank_of_a_process_killed_during_a_batch_fails_naming_its_own_rank(
    own_backend, blocking
):
    """The ranks one process hosts travel as one message (on its lane when blocking, on
    its Dask stream when not); when the process dies with it in flight, each of those
    ranks fails on its own, naming itself."""
    with dask.config.set({"hybridflow.fresh-processes": False}):
        light = DaskBackend(cluster=own_backend.cluster, ranks_per_worker=2)
    group = hf.WorkerGroup(hf.ResourcePool([4]), Sleeper, backend=light, name_prefix="batch")
    try:
        pids = group.pid()
        assert pids[0] == pids[1] != pids[2] == pids[3]  # two light ranks per process
        refs = group.workers
        futures = light.call_ranks(
            refs, "doze", [(2,)] * 4, [{}] * 4, label="doze", blocking=blocking
        )
        time.sleep(0.5)  # the batches are running
        _kill(pids[2])
        start = time.monotonic()
        for rank in (2, 3):
            with pytest.raises(WorkerLostError, match=f"rank {rank} of worker group 'batch"):
                light.gather([futures[rank]])
        assert time.monotonic() - start < 5
        assert light.gather(futures[:2]) == [2, 2]  # the other process's ranks
    finally:
        group.shutdown()
        light.shutdown()


@pytest.mark.parametrize("blocking", [True, False], ids=["lane", "stream"])
def test_a_light_rank_process_killed_during_a_dp_call_fails_it_naming_its_first_rank(
    own_backend, blocking
):
    """A DP call's rows reach each process's light ranks as one piece (and, blocking,
    come back joined); when a process dies with its piece in flight, the call fails with
    the loss of its first rank there."""
    own_backend.client.wait_for_workers(2, timeout=30)  # (a test before killed one)
    with dask.config.set({"hybridflow.fresh-processes": False}):
        light = DaskBackend(cluster=own_backend.cluster, ranks_per_worker=2)
    group = hf.WorkerGroup(hf.ResourcePool([4]), Sleeper, backend=light, name_prefix="rows")
    try:
        pids = group.pid()
        data = hf.DataProto.from_dict({"x": torch.arange(8.0)}, meta_info={"seconds": 2})
        call = group.doze_rows if blocking else group.doze_rows_later
        result: list = []
        running = threading.Thread(target=lambda: result.append(_outcome(call, data)))
        running.start()
        time.sleep(0.5)  # the pieces are running
        _kill(pids[2])
        running.join(10)
        assert isinstance(result[0], WorkerLostError), result
        assert "rank 2 of worker group 'rows" in str(result[0])
    finally:
        group.shutdown()
        light.shutdown()


def _outcome(call, data):
    """What a call on ``data`` ends with, waited for: its result or its error."""
    try:
        return hf.get(call(data))
    except Exception as exc:
        return exc
