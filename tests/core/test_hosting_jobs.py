"""A method call's job (``hosting.jobs.Invoke``) is freed by reference counts alone.

A job that snapshots its result once kept its snapshot as a bound method of itself: a
reference cycle, so the call's inputs (a large batch, a block of the worker's memory
cache) stayed alive until the garbage collector's next full pass, and the next call
touched fresh memory instead. The collector is off here: only reference counts free.
"""

from __future__ import annotations

import gc
import weakref

import torch

from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.hosting.copies import PickleCopy
from hybridflow_dask.backends.hosting.jobs import Invoke
from hybridflow_dask.protocol import DataProto


class Echo:
    def echo(self, data: DataProto) -> DataProto:
        return data


class Hosted:
    def __init__(self) -> None:
        self.ref = InstanceRef("echo", 0, Slot(0, "local", "localhost"))
        self.obj = Echo()

    def start_loop(self) -> None:
        pass


def test_a_snapshotting_job_frees_its_inputs_and_result_once_dropped():
    data = DataProto.from_dict({"x": torch.ones(4)})
    gone = weakref.ref(data)
    gc.collect()
    gc.disable()
    try:
        job = Invoke("echo", (data,), {}, copy=PickleCopy())
        capture = job.capture
        assert capture is not None
        snapshot = capture(job(Hosted()))
        assert torch.equal(snapshot.batch["x"], data.batch["x"])
        assert snapshot.batch["x"].data_ptr() != data.batch["x"].data_ptr()
        del job, capture, data
        assert gone() is None
    finally:
        gc.enable()


def test_a_job_without_a_copy_captures_nothing():
    assert Invoke("echo", (), {}, copy=None).capture is None
