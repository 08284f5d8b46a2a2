"""The device route without a GPU: the setting, the choice, its errors, and its frames.

Not marked ``gpu``: what runs on a GPU only (CUDA memory itself) is stood in for by CPU
tensors that an injected predicate treats as device tensors, and those tests say so in
their names. tests/gpu/test_gpu_chains.py runs the real thing on a GPU.
"""

from __future__ import annotations

import dask
import numpy as np
import pytest
import torch
from distributed.protocol import deserialize, serialize

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask import config
from hybridflow_dask.backends.dask.driver import cluster
from hybridflow_dask.backends.dask.wire import device_route
from hybridflow_dask.backends.dask.wire.snapshot import snapshot
from hybridflow_dask.protocol import serialization as proto

CUDA_FAMILY = ("cuda", "dask", "pickle")


def _batch() -> hf.DataProto:
    return hf.DataProto.from_dict(
        {
            "x": torch.arange(12.0).reshape(4, 3),
            "half": torch.linspace(0, 1, 4).to(torch.bfloat16),
            "ids": torch.arange(8).reshape(4, 2),
        },
        {"uid": np.array(list("abcd"), dtype=object), "score": np.arange(4.0)},
        {"step": 3},
    )


def _equal(a: hf.DataProto, b: hf.DataProto) -> bool:
    return (
        all(torch.equal(a.batch[k], b.batch[k]) for k in list(a.batch.keys()))
        and all(
            np.array_equal(a.non_tensor_batch[k], b.non_tensor_batch[k]) for k in ("uid", "score")
        )
        and a.meta_info == b.meta_info
    )


@pytest.fixture
def route_on(monkeypatch):
    """The device route on in this process for one test only (it is for good otherwise)."""
    monkeypatch.setitem(device_route._state, "on", True)


@pytest.fixture
def cpu_as_device(monkeypatch):
    """CPU tensors taken for device tensors by the device route's serializers."""
    monkeypatch.setattr(proto, "_on_cuda", lambda tensor: True)


# -- the setting ------------------------------------------------------------------------


def test_device_transfer_defaults_to_host():
    assert config.device_transfer() == "host"
    assert dask.config.get("hybridflow.device-transfer") == "host"


def test_device_transfer_reads_the_setting_and_the_keyword_over_it():
    with dask.config.set({"hybridflow.device-transfer": "Device"}):
        assert config.device_transfer() == "device"
        assert config.device_transfer("host") == "host"


@pytest.mark.parametrize("value", ["gpu", "ucx", "", "true"])
def test_device_transfer_refuses_other_values_naming_both_ways_to_set_it(value):
    with pytest.raises(ValueError, match=r"'host' or 'device'.*device_transfer="):
        config.device_transfer(value)


def test_daskbackend_refuses_an_unknown_route_before_starting_anything(monkeypatch):
    monkeypatch.setattr(cluster, "start_local_cluster", _never_called)
    with pytest.raises(ValueError, match=r"hybridflow\.device-transfer must be"):
        DaskBackend(device_transfer="nvlink")


def _never_called(*args, **kwargs):
    raise AssertionError("a cluster was started")


# -- the choice -------------------------------------------------------------------------


def test_host_route_is_the_host_route_on_any_cluster():
    for protocol in ("tcp", "tls", "ucx", "inproc"):
        route = device_route.choose_transfer_route("host", protocol=protocol, gpus=0)
        assert (route.name, route.between_workers) == ("host", "host")


def test_device_route_moves_device_memory_between_workers_only_on_ucx():
    on_ucx = device_route.choose_transfer_route("device", protocol="ucx", gpus=2)
    on_tcp = device_route.choose_transfer_route("device", protocol="tcp", gpus=2)
    assert (on_ucx.name, on_ucx.between_workers) == ("device", "device")
    assert (on_tcp.name, on_tcp.between_workers) == ("device", "host")
    assert "protocol='ucx'" in on_tcp.reason and "distributed-ucxx" in on_tcp.reason


def test_device_route_with_gpus_not_known_yet_is_taken():
    route = device_route.choose_transfer_route("device", protocol="tcp", gpus=None)
    assert route.name == "device"


def test_device_route_on_a_cluster_without_gpus_is_a_value_error_that_says_why():
    with pytest.raises(ValueError, match=r"no worker of this cluster has a GPU.*'host'"):
        device_route.choose_transfer_route("device", protocol="tcp", gpus=0)


def test_daskbackend_device_route_on_a_cpu_cluster_is_a_value_error(hf_dask_backend):
    client = hf_dask_backend.client  # the session's CPU cluster, through a second backend
    with pytest.raises(ValueError, match="no worker of this cluster has a GPU"):
        DaskBackend(client=client, device_transfer="device")
    assert client.status == "running"  # the given client and its cluster live on
    assert not device_route.enabled()


def test_daskbackend_takes_the_host_route_by_default(hf_dask_backend):
    assert hf_dask_backend.transfer_route.name == "host"


def test_ucx_without_distributed_ucxx_is_a_value_error_before_a_cluster_starts(monkeypatch):
    monkeypatch.setattr(cluster, "ucx_available", lambda: False)
    monkeypatch.setattr(cluster, "probe_local_cluster", _never_called)
    with pytest.raises(ValueError, match=r"distributed-ucxx.*pip install distributed-ucxx-cu13"):
        DaskBackend(protocol="ucx")
    cluster.check_protocol("tcp://")  # other comms pass
    cluster.check_protocol(None)


# -- the frames -------------------------------------------------------------------------


def test_device_frames_round_trip_without_a_host_copy_with_cpu_tensors_standing_in():
    data = _batch()
    header, frames = proto.serialize_dataproto(data, device_frames=lambda tensor: True)
    tensor_frames = [f for f in frames if isinstance(f, torch.Tensor)]
    assert len(tensor_frames) == 3 and all(f.dtype == torch.uint8 for f in tensor_frames)
    back = proto.deserialize_dataproto(header, frames)
    assert _equal(back, data)
    assert back.batch["half"].dtype == torch.bfloat16
    # the tensors are the frames' memory: nothing was copied on the way
    assert back.batch["x"].data_ptr() == data.batch["x"].data_ptr()


def test_device_frames_keep_only_cuda_tensors_on_the_device_by_default():
    _, frames = proto.serialize_dataproto(_batch(), device_frames=True)
    assert not any(isinstance(f, torch.Tensor) for f in frames)  # no CUDA tensor here


def test_device_frame_of_the_wrong_size_is_refused():
    header, frames = proto.serialize_tensor(torch.arange(4.0), device_frames=lambda t: True)
    with pytest.raises(ValueError, match="frame holds 8 bytes"):
        proto.deserialize_tensor(header, [frames[0][:8]])


def test_cuda_family_declines_while_the_device_route_is_off():
    assert not device_route.enabled()
    header, _ = serialize(_batch(), serializers=CUDA_FAMILY)
    assert header["serializer"] == "dask"


def test_cuda_family_serializes_dataprotos_tensors_and_tensordicts_on_the_device_route(route_on):
    for value in (_batch(), torch.arange(6.0), _batch().batch):
        header, frames = serialize(value, serializers=CUDA_FAMILY)
        assert header["serializer"] == "cuda", type(value)
        back = deserialize(header, frames)
        assert type(back) is type(value)


def test_cuda_family_keeps_device_frames_with_cpu_tensors_standing_in(route_on, cpu_as_device):
    data = _batch()
    header, frames = serialize(data, serializers=CUDA_FAMILY)
    assert header["serializer"] == "cuda"
    assert sum(isinstance(f, torch.Tensor) for f in frames) == 3
    assert _equal(deserialize(header, frames), data)


def test_snapshot_on_the_device_route_copies_device_frames_with_cpu_tensors_standing_in(
    route_on, cpu_as_device
):
    data = _batch()
    copy = snapshot(data, "a result")
    assert _equal(copy, data)
    assert copy.batch["x"].data_ptr() != data.batch["x"].data_ptr()
    data.batch["x"].add_(100)  # the producer changes its tensor afterwards
    assert float(copy.batch["x"][0, 0]) == 0.0


def test_snapshot_on_the_host_route_is_unchanged():
    data = _batch()
    copy = snapshot(data, "a result")
    assert _equal(copy, data)
    assert copy.batch["x"].data_ptr() != data.batch["x"].data_ptr()


def test_device_route_plugin_turns_the_route_on(monkeypatch):
    monkeypatch.setitem(device_route._state, "on", False)
    device_route.DeviceRoutePlugin().setup(worker=None)
    assert device_route.enabled()
    assert device_route.serializers() == CUDA_FAMILY
