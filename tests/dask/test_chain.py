"""DataProtoFutures flowing between groups on Dask: row counts, values, and locality."""

from __future__ import annotations

import os

import dask
import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend


class Stage(hf.Worker):
    """Adds its ``step`` to ``x`` and records which process saw which rows."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.seen_rows = 0
        self.made_ptrs: list[int] = []

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def forward(self, data):
        self.seen_rows += len(data)
        out = hf.DataProto.from_dict({"x": data.batch["x"] + self.step, "idx": data.batch["idx"]})
        self.made_ptrs.append(out.batch["x"].data_ptr())
        return out

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def forward_blocking(self, data):
        return hf.DataProto.from_dict({"x": data.batch["x"] + self.step, "idx": data.batch["idx"]})

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def pointer_of_input(self, data):
        ptr = data.batch["x"].data_ptr()
        return hf.DataProto.from_dict(
            {"ptr": torch.full((len(data),), ptr, dtype=torch.int64)},
            non_tensors={"pid": [os.getpid()] * len(data)},
        )

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def stats(self):
        return {"pid": os.getpid(), "seen_rows": self.seen_rows, "made_ptrs": list(self.made_ptrs)}


def batch(n: int) -> hf.DataProto:
    return hf.DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32) * 10, "idx": torch.arange(n)}, auto_padding=True
    )


@pytest.fixture(scope="module")
def wide_backend():
    """Eight worker processes: producer and consumer pools of up to 4 ranks each."""
    backend = DaskBackend(n_workers=8)
    yield backend
    backend.shutdown()


@pytest.mark.cluster
@pytest.mark.parametrize("producers", [1, 2, 3, 4])
@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
def test_chain_keeps_rows_and_values_for_every_world_size_pair(
    wide_backend, hf_worker_group, producers, consumers, monkeypatch
):
    # The blocking reference path re-splits the producer's output in the driver, which
    # needs auto padding on globally (the non-blocking chain pads on its own).
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    a = hf_worker_group(hf.ClassWithInitArgs(Stage, 1.0), [producers], backend=wide_backend)
    b = hf_worker_group(hf.ClassWithInitArgs(Stage, 100.0), [consumers], backend=wide_backend)
    for n in range(1, 14):
        data = batch(n)
        chained = hf.get(b.forward(a.forward(data)))
        blocking = b.forward_blocking(a.forward_blocking(data))
        assert len(chained) == n, f"{producers}->{consumers} with {n} rows"
        assert torch.equal(chained.batch["idx"], torch.arange(n))
        assert torch.equal(chained.batch["x"], data.batch["x"] + 101)
        assert torch.equal(chained.batch["x"], blocking.batch["x"])
    # Each consumer rank received only its share of rows (plus at most one padding row per
    # call), never the whole batch as a verl consumer would.
    seen = [s["seen_rows"] for s in b.stats()]
    total = sum(range(1, 14))
    assert sum(seen) <= total + 13 * (consumers - 1)
    if consumers > 1:
        assert max(seen) < total


def test_colocated_chain_does_not_move_shards_and_hands_the_consumer_a_private_copy(
    hf_dask_backend, hf_worker_group
):
    pool = hf.ResourcePool([2])
    producer = hf_worker_group(hf.ClassWithInitArgs(Stage, 1.0), pool, backend=hf_dask_backend)
    consumer = hf_worker_group(hf.ClassWithInitArgs(Stage, 0.0), pool, backend=hf_dask_backend)
    seen = hf.get(consumer.pointer_of_input(producer.forward(batch(8))))
    made = producer.stats()
    for rank in range(2):
        rows = seen[rank * 4 : (rank + 1) * 4]
        # The consumer's rank read its shard in the very process the producer's rank wrote
        # it in (nothing crossed a worker boundary), from a copy of its own: the producer's
        # stored result is not the consumer's to change.
        assert set(rows.non_tensor_batch["pid"]) == {made[rank]["pid"]}
        assert set(rows.batch["ptr"].tolist()) != {made[rank]["made_ptrs"][-1]}


def test_share_colocated_inputs_hands_over_the_very_tensors(hf_dask_cluster):
    with dask.config.set({"hybridflow.share-colocated-inputs": True}):
        backend = DaskBackend(cluster=hf_dask_cluster)
    try:
        pool = hf.ResourcePool([2])
        producer = hf.WorkerGroup(pool, hf.ClassWithInitArgs(Stage, 1.0), backend=backend)
        consumer = hf.WorkerGroup(pool, hf.ClassWithInitArgs(Stage, 0.0), backend=backend)
        seen = hf.get(consumer.pointer_of_input(producer.forward(batch(8))))
        made = producer.stats()
        for rank in range(2):
            rows = seen[rank * 4 : (rank + 1) * 4]
            assert set(rows.batch["ptr"].tolist()) == {made[rank]["made_ptrs"][-1]}
        consumer.shutdown()
        producer.shutdown()
    finally:
        backend.shutdown()


@pytest.mark.cluster
def test_the_routing_tasks_of_a_chain_are_named_after_the_consumer_group(wide_backend):
    a = hf.WorkerGroup(hf.ResourcePool([2]), hf.ClassWithInitArgs(Stage, 1.0), backend=wide_backend)
    b = hf.WorkerGroup(hf.ResourcePool([3]), hf.ClassWithInitArgs(Stage, 2.0), backend=wide_backend)
    out = hf.get(b.forward(a.forward(batch(7))))
    assert len(out) == 7
    prefixes = wide_backend.client.run_on_scheduler(
        lambda dask_scheduler: sorted(dask_scheduler.task_prefixes)
    )
    consumer, producer = b.name_prefix.replace("-", "_"), a.name_prefix.replace("-", "_")
    routing = [p for p in prefixes if p.rsplit(".", 1)[-1] in ("rows", "route", "assemble")]
    assert any(p.startswith(f"{consumer}.") for p in routing), (routing, consumer)
    assert not any(p.startswith(f"{producer}.") for p in routing), (routing, producer)
    a.shutdown(), b.shutdown()
