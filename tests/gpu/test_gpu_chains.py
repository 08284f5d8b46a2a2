"""DataProtoFuture chains with CUDA tensors: colocated groups, two processes, both routes.

Marked ``gpu``. The host route (the default) moves a CUDA result's bytes through host
memory whenever it is copied (the snapshot at return, a colocated consumer's private
input); the device route (``device_transfer="device"``) copies it on the device. Each
test counts, in the worker, how many CUDA tensors the serializer copied to the host.
"""

from __future__ import annotations

import dask
import pytest
import torch
from distributed import LocalCluster
from gpu_helpers import Consumer, Producer

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

pytestmark = [pytest.mark.gpu, pytest.mark.cluster]  # a GPU cluster (tests/conftest.py)

ROWS = 16


def _chain(backend: DaskBackend, *, colocated: bool) -> tuple[hf.DataProto, int, int]:
    """A.produce -> B.consume on one GPU; B's report, A's kept pointer, A's host copies."""
    pool_a = hf.ResourcePool([1], use_gpu=True)
    pool_b = pool_a if colocated else hf.ResourcePool([1], use_gpu=True)
    a = hf.WorkerGroup(pool_a, Producer, backend=backend)
    b = hf.WorkerGroup(pool_b, Consumer, backend=backend)
    try:
        a.count_host_copies()
        seeds = hf.DataProto.from_dict({"seed": torch.zeros(ROWS)})
        report = hf.get(b.consume(a.produce(seeds)))
        return report, a.kept_pointer()[0], a.host_copies()[0]
    finally:
        b.shutdown()
        a.shutdown()


def _expected_row_sums() -> torch.Tensor:
    return torch.arange(ROWS * 1024, dtype=torch.float32).reshape(ROWS, -1).sum(dim=1)


def test_colocated_chain_on_the_host_route_arrives_on_the_device_through_host_copies():
    with DaskBackend() as backend:
        assert backend.transfer_route.name == "host"
        report, _, host_copies = _chain(backend, colocated=True)
    assert bool(report.batch["on_cuda"].all())
    assert torch.equal(report.batch["row_sum"], _expected_row_sums())
    assert host_copies >= 2  # A's result snapshot and B's private input, each via the host


def test_colocated_chain_on_the_device_route_keeps_tensors_on_the_device():
    with DaskBackend(device_transfer="device") as backend:
        route = backend.transfer_route
        report, kept, host_copies = _chain(backend, colocated=True)
    assert route.name == "device"
    assert route.between_workers == "host"  # a tcp:// cluster: host bytes between workers
    assert bool(report.batch["on_cuda"].all())
    assert torch.equal(report.batch["row_sum"], _expected_row_sums())
    assert host_copies == 0  # every copy of the batch was made on the device
    assert int(report.batch["pointer"][0]) != kept  # still a private copy


def test_colocated_chain_sharing_inputs_hands_over_the_very_device_memory():
    with dask.config.set({"hybridflow.share-colocated-inputs": True}):
        backend = DaskBackend(device_transfer="device")
    try:
        report, kept, host_copies = _chain(backend, colocated=True)
    finally:
        backend.shutdown()
    assert int(report.batch["pointer"][0]) == kept  # zero copy: A's tensor itself
    assert host_copies == 0


def test_chain_between_two_processes_on_one_gpu_arrives_on_the_device():
    # A plain LocalCluster of two processes, both seeing the one GPU: a producer and a
    # consumer in different processes on the same device (tcp:// between them).
    with LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    ) as cluster:
        for route in ("host", "device"):
            with DaskBackend(cluster=cluster, device_transfer=route) as backend:
                report, _, _ = _chain(backend, colocated=False)
            assert bool(report.batch["on_cuda"].all()), route
            assert torch.equal(report.batch["row_sum"], _expected_row_sums()), route
