"""A fresh worker's first batch does not stall its event loop on tensordict's import.

A fresh worker imports tensordict (which imports ``torch._dynamo``: seconds on a busy
machine) the first time it decodes a DataProto. A ``materialize_futures=False`` rank that
resolves its future has Dask's gather decode the rows on the worker's event loop, so the
loop used to stall in the import (1-9 s here), and every comm of the worker with it. The
import now happens off the loop, in the rank's own thread.
"""

from __future__ import annotations

import sys
import threading
import time

import dask
import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

pytestmark = pytest.mark.cluster

#: Generous: a worker's loop that is not stalled answers in milliseconds; the import
#: alone took 1.2-9 s on the 2-core machine.
LOOP_ANSWERS_S = 1.0


class Producer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        return hf.DataProto.from_dict({"x": data.batch["x"] + 1})


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def has_tensordict(self):
        return "tensordict" in sys.modules

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def resolve_itself(self, data):
        return data.get()


def _loop_time() -> float:
    return time.time()  # client.run calls it on the worker's event loop


@pytest.fixture
def fresh_backend():
    """A cluster of its own: the consumer's workers are new interpreters (Dask's spawn,
    not the suite's forked workers, which have tensordict imported already)."""
    fresh = {"distributed.worker.multiprocessing-method": "spawn", "hybridflow.worker-preload": []}
    with dask.config.set(fresh):
        backend = DaskBackend(n_workers=4)
        yield backend
        backend.shutdown()


def test_a_group_without_batches_never_imports_tensordict(fresh_backend):
    consumer = hf.WorkerGroup(hf.ResourcePool([2]), Consumer, backend=fresh_backend)
    assert consumer.has_tensordict() == [False, False]


def test_the_workers_loop_answers_while_its_first_batch_is_decoded(fresh_backend):
    producer = hf.WorkerGroup(hf.ResourcePool([2]), Producer, backend=fresh_backend)
    consumer = hf.WorkerGroup(hf.ResourcePool([2]), Consumer, backend=fresh_backend)
    made = producer.make(hf.DataProto.from_dict({"x": torch.arange(8.0)}))
    hf.get(made)  # the producer's side is done: what is watched is the consumer's
    assert consumer.has_tensordict() == [False, False]
    addresses = [ref.slot.address for ref in consumer.workers]
    client = fresh_backend.client
    out: list = []
    call = threading.Thread(target=lambda: out.append(consumer.resolve_itself(made)))
    call.start()
    slowest = 0.0
    while call.is_alive():
        start = time.monotonic()
        client.run(_loop_time, workers=addresses)
        slowest = max(slowest, time.monotonic() - start)
    call.join()
    assert torch.equal(out[0].batch["x"], torch.arange(8.0) + 1)
    assert consumer.has_tensordict() == [True, True]
    assert slowest < LOOP_ANSWERS_S, f"a worker's loop took {slowest:.1f} s to answer"
