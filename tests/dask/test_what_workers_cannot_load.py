"""What the driver sends that a worker's process cannot load (a class whose module only the
driver has: the commonest slip with a cluster started apart from the driver) fails the
group's creation, or that call, at once with the worker's own error; the connection it
came on, and the calls after it, go on. Before, on the direct path the worker's stream
of calls from that driver stopped (every later call waited for good), and on the task
path the worker lost its connection to the scheduler and left the cluster.

The class here lives in a module made in the driver's memory (``sys.modules`` only), so
no worker process can import it, however it was started.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
from call_paths import backend_on

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

MODULE = "hybridflow_test_driver_only"

SOURCE = """
import hybridflow_dask as hf


class DriverOnly(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def rank_of(self):
        return self.rank


class Payload:
    def __init__(self, value):
        self.value = value
"""

NEEDS = "the worker's process must import every module those come from"


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def kind(self, value=None):
        return type(value).__name__

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def kind_later(self, value=None):
        return type(value).__name__


@pytest.fixture
def driver_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType(MODULE)
    exec(SOURCE, module.__dict__)
    monkeypatch.setitem(sys.modules, MODULE, module)
    yield module


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["lane", "comm", "task"])
def test_a_worker_class_no_worker_can_import_fails_the_group_at_once_and_the_backend_goes_on(
    hf_dask_cluster, driver_only, path
):
    with backend_on(path, hf_dask_cluster) as backend:
        with pytest.raises(ModuleNotFoundError, match=MODULE) as raised:
            hf.WorkerGroup(hf.ResourcePool([2]), driver_only.DriverOnly, backend=backend)
        assert any(NEEDS in note for note in getattr(raised.value, "__notes__", []))
        group = hf.WorkerGroup(hf.ResourcePool([2]), Echo, backend=backend)
        assert group.kind(1) == ["int", "int"]
        assert len(hf_dask_cluster.scheduler.workers) == len(hf_dask_cluster.workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("path", ["lane", "comm", "task"])
def test_an_argument_a_worker_cannot_load_fails_its_own_call_and_the_next_calls_run(
    hf_dask_cluster, driver_only, path, blocking
):
    with backend_on(path, hf_dask_cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([2]), Echo, backend=backend)
        call = group.kind if blocking else (lambda value=None: hf.get(group.kind_later(value)))
        earlier = [group.kind_later(i) for i in range(3)]  # queued on the same connections
        with pytest.raises(ModuleNotFoundError, match=MODULE) as raised:
            call(driver_only.Payload(7))
        assert any(NEEDS in note for note in getattr(raised.value, "__notes__", []))
        after = group.kind_later(2.5)
        assert [hf.get(f) for f in earlier] == [["int", "int"]] * 3
        assert hf.get(after) == ["float", "float"]
        assert call("x") == ["str", "str"]


@pytest.mark.timeout(60)
def test_a_batch_a_worker_cannot_load_fails_each_of_its_ranks_and_their_next_calls_run(
    hf_dask_cluster, driver_only
):
    """Light ranks: a non-blocking call's ranks in one process travel as one message."""
    with DaskBackend(cluster=hf_dask_cluster, ranks_per_worker=2) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([4]), Echo, backend=backend)
        futures = group.kind_later(driver_only.Payload(7))
        after = group.kind_later(1)
        for future in futures:
            with pytest.raises(ModuleNotFoundError, match=MODULE):
                hf.get(future)
        assert hf.get(after) == ["int"] * 4
