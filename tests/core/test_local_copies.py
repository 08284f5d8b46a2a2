"""``LocalBackend`` copies what it passes as a value would travel to a worker process:
what Dask and Ray send with cloudpickle (a lambda, a class defined in a function) goes
through, what nothing can send (a lock) is refused naming the group, method and rank."""

from __future__ import annotations

import threading

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import LocalBackend


class Applier(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def apply(self, fn, value):
        return fn(value)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def make_local(self):
        class Made:  # defined in the method: plain pickle cannot name it
            def __init__(self) -> None:
                self.value = 7

        return Made()


def test_a_lambda_argument_and_a_local_class_result_travel_as_on_dask():
    with LocalBackend() as backend:
        group = hf.WorkerGroup(hf.ResourcePool([2]), Applier, backend=backend)
        assert group.apply(lambda x: x * 3, 2) == [6, 6]
        assert [made.value for made in group.make_local()] == [7, 7]


def test_an_argument_nothing_can_pickle_is_refused_naming_the_rank():
    with LocalBackend() as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Applier, backend=backend)
        with pytest.raises(TypeError, match=r"\.apply for rank 0 cannot be sent"):
            group.apply(print, threading.Lock())
