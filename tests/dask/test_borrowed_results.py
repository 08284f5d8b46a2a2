"""A kept result reaching a consumer on another worker of the same host: its frames are
copied out of the keeper's memory (``worker.borrow``) instead of through Dask's comm.

Real worker processes: the consumer gets the producer's values, as its own, the keeper's
loans are all given back, and with ``hybridflow.same-host-copy`` off the result travels
through Dask as before.
"""

from __future__ import annotations

import dask
import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.wire.same_host import supported
from hybridflow_dask.backends.dask.worker.plugin import PLUGIN_NAME

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not supported(), reason="process_vm_readv is Linux-only"),
]


class Keeper(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def twice(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_one_in_place(self, data: hf.DataProto) -> hf.DataProto:
        x = data.batch["x"]
        x.add_(1)  # its own copy: the keeper's result must not change
        return hf.DataProto.from_dict({"x": x})


def _counts(backend: DaskBackend) -> dict:
    def read(dask_worker=None):  # Dask passes the worker
        plugin = dask_worker.plugins[PLUGIN_NAME]
        return plugin._borrower.borrowed, plugin._lender.on_loan()

    return backend.client.run(read)


@pytest.fixture(scope="module", params=[True, False], ids=["copy", "socket"])
def backend(request):
    with dask.config.set({"hybridflow.same-host-copy": request.param}):
        backend = DaskBackend(n_workers=2)
    yield backend, request.param
    backend.shutdown()


def test_a_kept_result_reaches_a_consumer_on_another_worker_copied_out_of_the_keepers_memory(
    backend, hf_worker_group
):
    backend, copy = backend
    keeper = hf_worker_group(Keeper, [1], backend=backend)
    consumer = hf_worker_group(Consumer, [1], backend=backend)
    x = torch.arange(2048 * 1024.0).reshape(2048, 1024)
    made = keeper.twice(hf.DataProto.from_dict({"x": x}))  # 8 MiB, kept on the keeper's worker
    out = hf.get(consumer.add_one_in_place(made))
    assert torch.equal(out.batch["x"], x * 2 + 1)
    assert torch.equal(hf.get(made).batch["x"], x * 2)  # the keeper's, unchanged
    counts = sorted(_counts(backend).values())
    # one key borrowed where the copy is on, none through the socket; no loan left out
    assert counts == ([(0, 0), (1, 0)] if copy else [(0, 0), (0, 0)])
