"""One tree of library errors: ``except HybridFlowError`` catches every failure of the
library itself, the standard-library bases users already catch still catch them, and
each survives the trip from a worker process (pickling) with what it carries."""

from __future__ import annotations

import pickle

import pytest

import hybridflow_dask as hf
from hybridflow_dask import errors


@pytest.mark.parametrize(
    ("cls", "std_base"),
    [
        (errors.WorkerLostError, RuntimeError),
        (errors.WorkerUnreachableError, ConnectionError),
        (errors.SchedulerLostError, ConnectionError),
        (errors.SchedulerUnreachableError, ConnectionError),
        (errors.CallTimeoutError, TimeoutError),
        (errors.CallWithdrawnError, RuntimeError),
        (errors.ProtocolError, ValueError),
        (errors.LaneRefused, ConnectionError),
    ],
)
def test_every_library_error_is_a_hybridflow_error_and_keeps_its_standard_base(cls, std_base):
    assert issubclass(cls, hf.HybridFlowError)
    assert issubclass(cls, std_base)


def test_an_unreachable_worker_is_handled_as_a_lost_one():
    assert issubclass(errors.WorkerUnreachableError, errors.WorkerLostError)


def test_errors_are_exported_at_the_top_level_and_from_backends():
    from hybridflow_dask import backends

    assert hf.WorkerLostError is errors.WorkerLostError is backends.WorkerLostError
    assert hf.SchedulerLostError is backends.SchedulerLostError
    assert hf.HybridFlowError is backends.HybridFlowError


def test_errors_with_fields_survive_pickling():
    timeout = errors.CallTimeoutError("late", queued=(1,), running=(0,), unknown=(2,))
    back = pickle.loads(pickle.dumps(timeout))
    assert (str(back), back.queued, back.running, back.unknown) == ("late", (1,), (0,), (2,))
    lost = pickle.loads(pickle.dumps(errors.SchedulerLostError("tcp://h:1", 3.0)))
    assert (lost.address, lost.timeout) == ("tcp://h:1", 3.0) and "tcp://h:1" in str(lost)
    unreachable = pickle.loads(pickle.dumps(errors.SchedulerUnreachableError("a", 1.0, "why")))
    assert unreachable.reason == "why"
