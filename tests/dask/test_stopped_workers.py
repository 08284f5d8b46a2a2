"""A stopped worker (SIGSTOP) is the usual hung rank: ``hybridflow.call-timeout`` reports
its calls failed in time, withdraws those that had not started, and when the worker
resumes (SIGCONT) nothing reported failed runs, on every call path."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
import pytest
import torch
from call_paths import PATHS, backend_on
from distributed import LocalCluster

import hybridflow_dask as hf

pytestmark = pytest.mark.cluster  # a cluster of its own (its worker gets stopped)

LIMIT_S = 2.0


class Journal(hf.Worker):
    """Writes down every call that ran, and what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, float]] = []

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        self.seen.append(("slow", 0.0))
        return "slow"

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def record(self, tag: str, payload: torch.Tensor) -> int:
        self.seen.append((tag, float(payload.sum())))
        return payload.numel()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def keep(self, n: int) -> torch.Tensor:
        return torch.ones(n)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def log(self) -> list[tuple[str, float]]:
        return list(self.seen)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as made:
        yield made


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped as a debugger or a hung kernel would leave it; resumed after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def stacks_after(seconds: float) -> Iterator[Callable[[], str]]:
    """Every thread's stack, written down if the block still runs after ``seconds``: what a
    late timeout was waiting for, for the failure's message (empty when it was in time)."""
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback_later(seconds, file=dump)
        try:
            yield lambda: (dump.seek(0), dump.read())[1]
        finally:
            faulthandler.cancel_dump_traceback_later()


#: A process of its own that sleeps 10 ms at a time and, once its input closes, prints the
#: longest it ever overslept.
_WATCH = """
import sys, threading, time
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
worst, before = 0.0, time.monotonic()
print("ready", flush=True)
while not done.is_set():
    time.sleep(0.01)
    now = time.monotonic()
    worst, before = max(worst, now - before - 0.01), now
print(worst, flush=True)
"""


class StallWatch:
    """How long the machine itself stalled while it ran (seconds): the longest a separate
    process sleeping 10 ms at a time overslept, or the most time the hypervisor took from
    one CPU (its steal time: a thread asleep on that CPU wakes that much later, whatever
    runs on the other). A paused virtual machine delays any timeout by as much, so a
    bound on ours allows for it; a stall of the test's process alone (a held lock, a
    blocked write) shows in neither, and still fails the bound."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WATCH],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"
        self._steal = _steal_by_cpu()
        self._worst: float | None = None

    def __call__(self) -> float:
        """The longest stall, once the watch is over (it ends at the first look)."""
        if self._worst is None:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.close()
            overslept = float(self.process.stdout.readline())
            self.process.wait(10)
            stolen = [after - self._steal.get(cpu, after) for cpu, after in _steal_by_cpu().items()]
            self._worst = max(overslept, *stolen)
        return self._worst

    def __enter__(self) -> StallWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self()  # the watch ends with the block


def _steal_by_cpu() -> dict[str, float]:
    """Each CPU's steal time so far (seconds; none where ``/proc/stat`` is not there)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    return {
        fields[0]: int(fields[8]) / tick
        for fields in (line.split() for line in lines)
        if fields and fields[0].startswith("cpu") and fields[0] != "cpu" and len(fields) > 8
    }


def test_the_stall_watch_sees_the_machine_stall_and_not_the_test_sleep():
    with StallWatch() as stall:
        time.sleep(0.3)  # this process idles: the machine does not stall
    assert stall() < 0.2
    with StallWatch() as stall, stopped(stall.process.pid):  # as a paused machine would
        time.sleep(0.5)
    assert 0.4 < stall() < 5.0


@pytest.mark.parametrize("path", list(PATHS))
def test_a_call_to_a_stopped_worker_times_out_in_time_and_never_runs_after_it_resumes(
    path, cluster
):
    with backend_on(path, cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Journal, backend=backend)
        (pid,) = group.pid()  # and the lane, where there is one, is open
        payload = torch.ones(1 << 19)  # 2 MiB: large enough to be read from this process
        limit = dask.config.set({"hybridflow.call-timeout": f"{LIMIT_S}s"})
        with stopped(pid), limit, stacks_after(LIMIT_S + 1.0) as stacks, StallWatch() as stall:
            start = time.monotonic()
            with pytest.raises(hf.CallTimeoutError) as caught:
                group.record("late", payload)
            waited = time.monotonic() - start
            payload.fill_(7.0)  # the caller was told the call failed: its memory is its own
            assert waited < LIMIT_S + 1.0 + stall(), (
                f"{waited:.2f}s (the machine stalled {stall():.2f}s at most); the threads "
                f"then:\n{stacks()}"
            )
        assert isinstance(caught.value, hf.HybridFlowError) and isinstance(
            caught.value, TimeoutError
        )
        # Its worker could not say (it is stopped), or the call was never sent at all.
        assert caught.value.running == () and 0 in caught.value.unknown + caught.value.queued
        time.sleep(0.5)  # the resumed worker reads the call, and refuses it
        assert group.log() == [[]]
        group.shutdown()


@pytest.mark.parametrize("path", list(PATHS))
def test_a_call_queued_behind_a_slow_one_is_withdrawn_at_the_timeout_and_never_runs(path, cluster):
    with backend_on(path, cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Journal, backend=backend)
        group.pid()
        slow = threading.Thread(target=group.slow, args=(2.5,))
        slow.start()
        time.sleep(0.3)  # running now
        limit = dask.config.set({"hybridflow.call-timeout": "1s"})
        with limit, pytest.raises(hf.CallTimeoutError) as caught:
            group.record("queued", torch.ones(4))
        slow.join(10)
        assert caught.value.queued == (0,), str(caught.value)
        assert "will not run" in str(caught.value)
        assert group.log() == [[("slow", 0.0)]]
        group.shutdown()


def test_a_running_call_past_its_limit_is_reported_running_and_may_finish(cluster):
    with backend_on("lane", cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Journal, backend=backend)
        limit = dask.config.set({"hybridflow.call-timeout": "0.5s"})
        with limit, pytest.raises(hf.CallTimeoutError) as caught:
            group.slow(1.5)
        assert caught.value.running == (0,), str(caught.value)
        assert "may still finish" in str(caught.value)
        time.sleep(1.5)
        assert group.log() == [[("slow", 0.0)]]
        group.shutdown()


@pytest.mark.parametrize("path", ["comm", "task"])
def test_getting_a_result_kept_on_a_stopped_worker_is_bounded_by_the_limit(path, cluster):
    with backend_on(path, cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Journal, backend=backend)
        (pid,) = group.pid()
        kept = group.keep(1 << 20)
        group.pid()  # the kept result is there by now (calls run in order)
        limit = dask.config.set({"hybridflow.call-timeout": f"{LIMIT_S}s"})
        with stopped(pid), limit, StallWatch() as stall:
            start = time.monotonic()
            with pytest.raises(hf.CallTimeoutError):
                hf.get(kept)
            waited = time.monotonic() - start
        assert waited < LIMIT_S + 1.0 + stall(), (waited, stall())
        (value,) = hf.get(kept)  # resumed: the result is still there
        assert value.shape == (1 << 20,)
        group.shutdown()


@pytest.mark.parametrize("path", ["lane", "lane-socket-only"])
def test_a_limit_set_before_the_lane_opened_bounds_a_large_write_to_a_stopped_worker(path, cluster):
    limit = dask.config.set({"hybridflow.call-timeout": f"{LIMIT_S}s"})
    with limit, backend_on(path, cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Journal, backend=backend)
        (pid,) = group.pid()  # the lane opens under the limit
        payload = torch.ones(64 << 18)  # 64 MiB: more than the socket buffers hold
        with stopped(pid), StallWatch() as stall:
            start = time.monotonic()
            with pytest.raises(hf.CallTimeoutError):
                group.record("big", payload)
            waited = time.monotonic() - start
        assert waited < LIMIT_S + 1.0 + stall(), (waited, stall())
        time.sleep(0.5)
        assert group.log() == [[]]
        group.shutdown()
