"""A non-blocking call's plain result (``None``, a number, a short string), or one whose
wire form is at most ``hybridflow.hold-threshold``, is held by the driver, not kept on a
worker under a Dask key, until another process needs it: then the worker that made it
keeps it, and the later call or task reads it as any Dask input."""

from __future__ import annotations

import time

import dask
import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend


class Producer(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def rank_times(self, factor: int) -> int:
        return self.rank * factor

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def tensor(self, size: int = 3) -> torch.Tensor:
        return torch.full((size,), float(self.rank))

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def rows(self) -> hf.DataProto:
        """A few rows of its own, which the next call changes in place."""
        if not hasattr(self, "state"):
            self.state = torch.zeros(4, 2)
        self.state += 1
        return hf.DataProto.from_dict({"x": self.state}, meta_info={"rank": self.rank})

    @hf.register(hf.Dispatch.ALL_TO_ALL)
    def total(self, value: torch.Tensor) -> float:
        return float(value.sum())

    @hf.register(hf.Dispatch.ALL_TO_ALL)
    def plus_one(self, value: int) -> int:
        return value + 1

    @hf.register(hf.Dispatch.ALL_TO_ALL, blocking=False)
    def plus_one_later(self, value: int) -> int:
        return value + 1

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def sum_of(self, values: list) -> int:
        return sum(values)

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def sleep_then(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


def _known_to_scheduler(backend: DaskBackend, keys: list[str]) -> dict[str, list[str]]:
    """Each of ``keys`` the scheduler knows, with the addresses of the workers holding it."""

    def look(dask_scheduler, keys=keys):  # runs on the scheduler
        return {
            k: sorted(ws.address for ws in dask_scheduler.tasks[k].who_has or ())
            for k in keys
            if k in dask_scheduler.tasks
        }

    return backend.client.run_on_scheduler(look)


@pytest.fixture(scope="module")
def group(hf_dask_cluster):
    with DaskBackend(cluster=hf_dask_cluster) as backend:
        wg = hf.WorkerGroup(hf.ResourcePool([2]), Producer, backend=backend)
        yield wg
        wg.shutdown()


def test_a_plain_result_is_held_by_the_driver_and_no_worker_keeps_it(group):
    futures = group.rank_times(10)
    assert hf.get(futures) == [0, 10]
    assert [f.result() for f in futures] == [0, 10]  # Future.result answers from the driver
    assert _known_to_scheduler(group.backend, [f.key for f in futures]) == {}


def test_a_result_larger_than_the_hold_threshold_is_kept_on_its_worker(group):
    futures = group.tensor(20_000)  # 80 kB, above the default 64 KiB
    values = hf.get(futures)
    assert [v.unique().tolist() for v in values] == [[0.0], [1.0]]
    known = _known_to_scheduler(group.backend, [f.key for f in futures])
    assert known == {f.key: [w.slot.address] for f, w in zip(futures, group.workers)}


def test_a_small_result_is_held_by_the_driver_as_a_copy_nobody_can_change(group):
    futures = group.rows()
    first = hf.get(futures)
    assert _known_to_scheduler(group.backend, [f.key for f in futures]) == {}
    assert [part.batch["x"].tolist() for part in first] == [[[1.0, 1.0]] * 4] * 2
    first[0].batch["x"] += 100  # the reader's copy: the held value stays as it came
    group.rows()  # and the instances change the tensors they returned
    again = hf.get(futures)
    assert [part.batch["x"].tolist() for part in again] == [[[1.0, 1.0]] * 4] * 2
    assert [f.result().meta_info["rank"] for f in futures] == [0, 1]


def test_a_small_result_given_to_a_later_call_is_kept_first_by_its_worker(group):
    made = group.tensor()
    hf.get(made)  # held in the driver now
    # rank i of the consumer reads rank (1 - i)'s tensor: a value from the other process
    assert group.total([made[1], made[0]]) == [3.0, 0.0]
    known = _known_to_scheduler(group.backend, [f.key for f in made])
    assert known == {f.key: [w.slot.address] for f, w in zip(made, group.workers)}


def test_a_hold_threshold_of_zero_keeps_every_result_that_is_not_plain_on_its_worker(
    hf_dask_cluster,
):
    with dask.config.set({"hybridflow.hold-threshold": 0}):
        backend = DaskBackend(cluster=hf_dask_cluster)
    with backend:
        wg = hf.WorkerGroup(hf.ResourcePool([2]), Producer, backend=backend)
        futures = wg.tensor()
        assert [v.tolist() for v in hf.get(futures)] == [[0.0] * 3, [1.0] * 3]
        known = _known_to_scheduler(backend, [f.key for f in futures])
        assert known == {f.key: [w.slot.address] for f, w in zip(futures, wg.workers)}
        assert hf.get(wg.rank_times(2)) == [0, 2]  # plain ones are still held
        wg.shutdown()


def test_a_held_result_given_to_a_later_call_is_kept_first_by_the_worker_that_made_it(group):
    made = group.rank_times(10)
    hf.get(made)  # held in the driver now
    # rank i of the consumer reads rank (1 - i)'s result: a value from the other process
    assert group.plus_one([made[1], made[0]]) == [11, 1]
    keys = [f.key for f in made]
    known = _known_to_scheduler(group.backend, keys)
    assert known == {f.key: [w.slot.address] for f, w in zip(made, group.workers)}
    del made  # dropped: the workers let them go, as any released Dask key
    deadline = time.monotonic() + 10
    while _known_to_scheduler(group.backend, keys) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _known_to_scheduler(group.backend, keys) == {}


def test_a_result_still_in_flight_given_to_a_later_call_arrives_as_its_value(group):
    made = group.rank_times(7)  # not waited for: the consumer's messages wait on the loop
    later = group.plus_one_later(list(made))
    assert hf.get(later) == [1, 8]


def test_held_results_inside_a_list_argument_arrive_as_their_values(group):
    made = group.rank_times(5)
    hf.get(made)
    assert group.sum_of(list(made)) == [5, 5]


def test_a_held_result_is_an_input_of_a_task_like_any_dask_future(group):
    made = group.rank_times(3)
    hf.get(made)
    backend = group.backend
    total = backend.submit(lambda a, b: a + b + 100, made[0], made[1], label="test.add")
    assert backend.gather([total]) == [103]


def test_result_of_a_call_still_running_waits_for_it_and_its_limit_holds(group):
    slow = group.sleep_then(0.5)
    with pytest.raises(TimeoutError):
        slow[0].result(timeout=0.05)
    assert [f.result(timeout=10) for f in slow] == [0, 1]
