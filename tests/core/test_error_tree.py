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


def test_a_ray_address_where_nothing_listens_is_a_scheduler_unreachable_error():
    pytest.importorskip("ray", reason="RayBackend needs the optional ray package")
    from hybridflow_dask.backends.hosting import find_free_port
    from hybridflow_dask.backends.ray.driver.connect import check_answers

    address = f"127.0.0.1:{find_free_port()}"  # free now: nothing listens there
    with pytest.raises(hf.HybridFlowError) as caught:
        check_answers(address, timeout=1.0)
    assert isinstance(caught.value, errors.SchedulerUnreachableError)
    assert f"no Ray cluster answers at {address}" in str(caught.value)
    back = pickle.loads(pickle.dumps(caught.value))
    assert str(back) == str(caught.value)
