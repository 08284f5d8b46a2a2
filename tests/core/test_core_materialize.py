"""``materialize_futures``: where a DataProtoFuture argument becomes data."""

from __future__ import annotations

import torch

import hybridflow_dask as hf


class Producer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def eager(self, data):
        # default materialize_futures=True: the rank receives its rows as a DataProto
        return hf.DataProto.from_dict(
            {"x": data.batch["x"] + 1}, non_tensors={"kind": [type(data).__name__] * len(data)}
        )

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def lazy(self, data):
        # materialize_futures=False: the rank receives a DataProtoFuture of its rows and
        # decides itself when to fetch them
        kind = type(data).__name__
        rows = data.get()
        return hf.DataProto.from_dict(
            {"x": rows.batch["x"] + 1}, non_tensors={"kind": [kind] * len(rows)}
        )


def test_futures_are_materialized_on_the_ranks_by_default_or_left_to_them(backend, hf_worker_group):
    producer = hf_worker_group(Producer, [2], backend=backend)
    consumer = hf_worker_group(Consumer, [2], backend=backend)
    data = hf.DataProto.from_dict({"x": torch.arange(6.0)})
    expected = torch.arange(6.0) * 2 + 1
    eager = consumer.eager(producer.make(data))
    lazy = consumer.lazy(producer.make(data))
    assert torch.equal(eager.batch["x"], expected)
    assert torch.equal(lazy.batch["x"], expected)
    assert set(eager.non_tensor_batch["kind"]) == {"DataProto"}
    assert set(lazy.non_tensor_batch["kind"]) == {"DataProtoFuture"}
