"""Errors keep their names on every path: an exception the driver cannot rebuild, one
with an unpicklable attribute, a result that cannot travel, several failing ranks, a
backend shut down under a waiting thread, and a producer killed while its data moves."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import dask
import pytest
import torch
from call_paths import PATHS, backend_on

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError


class TwoPartError(Exception):
    def __init__(self, part: str, whole: str) -> None:  # not rebuildable from its args
        super().__init__(f"{part} of {whole}")


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


class Failing(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def two_part(self):
        raise TwoPartError("half", "it")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def locked(self):
        error = ValueError("carries a lock")
        error.lock = threading.Lock()
        raise error

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def odd_later(self):
        return Unpicklable()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def every_rank_fails(self):
        if self.rank == 0:
            time.sleep(0.5)  # rank 1 fails first
        raise ValueError(f"failed on rank {self.rank}")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def ping(self):
        return self.rank


@pytest.fixture(scope="module", params=list(PATHS))
def group(request, hf_dask_cluster):
    with backend_on(request.param, hf_dask_cluster) as backend:
        wg = hf.WorkerGroup(hf.ResourcePool([2]), Failing, backend=backend, name_prefix="failing")
        yield wg
        wg.shutdown()


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def test_an_exception_that_cannot_be_rebuilt_keeps_its_name_and_the_lane_lives(group):
    with pytest.raises(RuntimeError, match="TwoPartError: half of it") as info:
        group.two_part()
    assert not isinstance(info.value, WorkerLostError)
    assert "failing.two_part on rank 0" in _notes(info.value)
    assert group.ping() == [0, 1]


def test_an_exception_with_an_unpicklable_attribute_still_names_group_method_and_rank(group):
    with pytest.raises(RuntimeError, match="carries a lock") as info:
        group.locked()
    assert "failing.locked on rank 0" in _notes(info.value)


def test_a_result_that_cannot_travel_names_group_method_and_rank(group):
    with pytest.raises(TypeError, match="cannot be") as info:
        hf.get(group.odd_later())
    assert "failing.odd_later on rank 0" in _notes(info.value) + str(info.value)


def test_when_every_rank_fails_the_error_raised_is_rank_zeros(group):
    with pytest.raises(ValueError, match="failed on rank 0"):
        group.every_rank_fails()


# -- failures that need processes of their own --------------------------------------------


class Slow(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def make(self, mib: int):
        return torch.ones(mib << 18)  # float32: mib MiB

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def total(self, tensors):
        return float(tensors.sum())


@pytest.mark.cluster
def test_shutting_down_under_a_waiting_thread_is_the_shutdown_runtime_error():
    backend = DaskBackend(n_workers=1)
    try:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Slow, backend=backend)
        pending = group.nap(3)
        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                backend.gather(pending)
            except BaseException as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
    finally:
        backend.shutdown()
    waiter.join(10)
    assert len(outcome) == 1
    assert type(outcome[0]) is RuntimeError and "shut down" in str(outcome[0])


@pytest.mark.cluster
@pytest.mark.parametrize("path", ["lane", "task"])
def test_a_producer_killed_while_its_result_moves_is_a_worker_lost_error_naming_it(path):
    with _own(path) as backend:
        producer = hf.WorkerGroup(hf.ResourcePool([1]), Slow, backend=backend, name_prefix="prod")
        consumer = hf.WorkerGroup(hf.ResourcePool([1]), Slow, backend=backend, name_prefix="cons")
        (pid,) = producer.pid()
        (made,) = producer.make(256)
        backend.gather([made])  # in the producer's memory
        (total,) = consumer.total(made)  # the consumer's worker fetches 256 MiB from it
        time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        try:
            assert backend.gather([total]) == [float(256 << 18)]  # it moved before the kill
        except WorkerLostError as exc:
            assert "rank 0 of worker group 'prod'" in str(exc) or "prod" in str(exc)
        consumer.shutdown()


@contextlib.contextmanager
def _own(path: str) -> Iterator[DaskBackend]:
    """A backend with a cluster of its own (its workers get killed), on ``path``."""
    with dask.config.set(PATHS[path]):
        backend = DaskBackend(n_workers=2)
    try:
        yield backend
    finally:
        backend.shutdown()


class Taker(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def size(self, tensor):
        return tensor.numel()


@pytest.mark.cluster
def test_a_worker_killed_while_the_task_path_sends_it_arguments_is_a_worker_lost_error():
    with _own("task") as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Taker, backend=backend, name_prefix="taker")
        (pid,) = group.pid()
        big = torch.ones(64 << 20)  # 256 MiB, scattered to the worker as the call is made
        threading.Timer(0.02, os.kill, args=(pid, signal.SIGKILL)).start()
        with pytest.raises(WorkerLostError, match="rank 0 of worker group 'taker'"):
            hf.get(group.size(big))
