"""A slot actor killed for real (SIGKILL to its process): what calls, inputs and
``alive`` say, and ``recover()`` rebuilding colocated ranks in one new process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'hybridflow-dask[ray]')")

from ray_workers import Echo

import hybridflow_dask as hf
from hybridflow_dask.backends import WorkerLostError

#: How long a call on a killed rank may take to fail (it fails in well under a second).
DEATH_LIMIT_S = 5.0


@dataclass
class Killed:
    a: hf.WorkerGroup
    b: hf.WorkerGroup
    old_pids: list[int]
    in_flight: BaseException | None
    in_flight_s: float
    consumer: BaseException | None
    later: BaseException | None


def _error(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:
        return exc
    return None


@pytest.fixture(scope="module")
def killed(ray_backend: Any) -> Iterator[Killed]:
    """Groups ``a`` and ``b`` on one pool of 2, a consumer of ``a``'s rank 1, and rank 1's
    process killed while ``a`` runs a long call there."""
    pool = hf.ResourcePool([2])
    a = hf.WorkerGroup(pool, Echo, backend=ray_backend, name_prefix="death_a")
    b = hf.WorkerGroup(pool, Echo, backend=ray_backend, name_prefix="death_b")
    consumer = hf.WorkerGroup(hf.ResourcePool([1]), Echo, backend=ray_backend)
    try:
        a.count()
        b.count()
        old_pids = a.pid()
        running = a.sleep(3.0)  # rank 1's never finishes: its process dies under it
        waiting = ray_backend.call(  # an input from the dying rank: waits for it
            consumer.workers[0], "total", (running[1],), {}, label="consumer.total"
        )
        start = time.monotonic()
        os.kill(old_pids[1], signal.SIGKILL)
        in_flight = _error(lambda: hf.get(running))
        in_flight_s = time.monotonic() - start
        consumer_error = _error(lambda: ray_backend.gather([waiting]))
        later = _error(a.count)
        yield Killed(a, b, old_pids, in_flight, in_flight_s, consumer_error, later)
    finally:
        for group in (consumer, b, a):
            group.shutdown()


def _names(exc: BaseException | None, group: str, rank: int) -> None:
    assert isinstance(exc, WorkerLostError), f"expected WorkerLostError, got {exc!r}"
    assert group in str(exc) and f"rank {rank}" in str(exc), str(exc)


def test_a_call_in_flight_on_the_killed_rank_fails_at_once_naming_group_and_rank(killed):
    _names(killed.in_flight, "death_a", 1)
    assert killed.in_flight_s < DEATH_LIMIT_S, (
        f"the lost call failed after {killed.in_flight_s:.1f}s, while rank 0 still ran"
    )


def test_a_call_waiting_for_the_killed_ranks_result_fails_naming_the_producer(killed):
    _names(killed.consumer, "death_a", 1)


def test_later_calls_fail_and_alive_turns_false(killed):
    _names(killed.later, "death_a", 1)
    backend = killed.a._backend
    assert not backend.alive(killed.a.workers[1].slot)
    assert backend.alive(killed.a.workers[0].slot)


def test_recover_rebuilds_colocated_ranks_in_one_new_process(killed):
    assert killed.a.recover() == [1]
    assert killed.b.recover() == [1]
    a_pids, b_pids = killed.a.pid(), killed.b.pid()
    assert a_pids == b_pids, "colocated groups recovered into different processes"
    assert a_pids[0] == killed.old_pids[0]
    assert a_pids[1] != killed.old_pids[1], "rank 1 was not rebuilt in a new process"
    # rank 0 kept its state (one count before the kill, one failed after it); rank 1
    # starts from __init__
    assert killed.a.count() == [3, 1]
    assert killed.b.count() == [2, 1]
