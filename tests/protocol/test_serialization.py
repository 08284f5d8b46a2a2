"""Zero-copy serialization: pickle protocol 5 out of band, header/frames, sizeof."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import msgpack
import numpy as np
import pytest
import torch
from protocol_helpers import (
    assert_arrays_equal,
    assert_dataproto_equal,
    assert_tensordicts_equal,
    assert_tensors_equal,
    make_dataproto,
)
from tensordict import NonTensorData, TensorDict

from hybridflow_dask.protocol import (
    DataProto,
    deserialize_dataproto,
    deserialize_tensor,
    deserialize_tensordict,
    serialize_dataproto,
    serialize_tensor,
    serialize_tensordict,
    sizeof_dataproto,
    sizeof_tensor,
    sizeof_tensordict,
)

MiB = 1024 * 1024


def pickle_out_of_band(obj):
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def as_bytes_frames(frames):
    """What a transport that hands back immutable bytes would give."""
    return [bytes(memoryview(f)) for f in frames]


def as_bytearray_frames(frames):
    """What a comm that reads into fresh writable buffers would give."""
    return [bytearray(memoryview(f)) for f in frames]


def count_buffers(dp: DataProto) -> int:
    tensors = (
        0 if dp.batch is None else len(list(dp.batch.keys(include_nested=True, leaves_only=True)))
    )
    arrays = sum(1 for a in dp.non_tensor_batch.values() if a.dtype != object)
    return tensors + arrays


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------------- pickle


def test_pickle5_puts_every_tensor_and_numeric_array_out_of_band(no_warnings):
    dp = make_dataproto(8, meta_info={"step": 1})
    data, buffers = pickle_out_of_band(dp)
    assert len(buffers) == count_buffers(dp) == 5
    back = pickle.loads(data, buffers=buffers)
    assert_dataproto_equal(back, dp)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_in_band_every_protocol(protocol, no_warnings):
    dp = make_dataproto(6, meta_info={"k": [1, 2]})
    back = pickle.loads(pickle.dumps(dp, protocol=protocol))
    assert_dataproto_equal(back, dp)
    back.batch["obs"].add_(1)  # writable, and not shared with the original
    assert not torch.equal(back.batch["obs"], dp.batch["obs"])
    assert back.non_tensor_batch["score"].flags.writeable


def test_pickle5_out_of_band_is_zero_copy_in_process(no_warnings):
    dp = make_dataproto(4)
    data, buffers = pickle_out_of_band(dp)
    back = pickle.loads(data, buffers=buffers)
    assert back.batch["obs"].data_ptr() == dp.batch["obs"].data_ptr()
    assert back.non_tensor_batch["score"].ctypes.data == dp.non_tensor_batch["score"].ctypes.data


def test_pickle5_from_readonly_bytes_gives_writable_tensors(no_warnings):
    dp = make_dataproto(4)
    data, buffers = pickle_out_of_band(dp)
    back = pickle.loads(data, buffers=as_bytes_frames(buffers))
    assert_dataproto_equal(back, dp)
    back.batch["obs"].mul_(2)
    back.non_tensor_batch["score"][0] = 42.0


def test_in_band_part_of_64mib_dataproto_is_small():
    n = 64 * 1024
    dp = DataProto.from_dict(
        {
            "a": torch.zeros(n, 128, dtype=torch.float32),  # 32 MiB
            "b": torch.zeros(n, 128, dtype=torch.bfloat16),  # 16 MiB
            "c": torch.zeros(n, 32, dtype=torch.int64),  # 16 MiB
            "d": torch.zeros(n, dtype=torch.bool),
        },
        {"uid": np.array([str(i) for i in range(n)], dtype=object), "r": np.zeros(n)},
    )
    assert sizeof_dataproto(dp) > 64 * MiB
    data, buffers = pickle_out_of_band(dp)
    assert len(data) < 1 * MiB
    assert len(buffers) == 5 == count_buffers(dp)
    assert sum(b.raw().nbytes for b in buffers) >= 64 * MiB
    header, _frames = serialize_dataproto(dp)
    assert len(msgpack.packb(header)) < 64 * 1024


def test_views_send_only_their_rows():
    dp = make_dataproto(100)
    part = dp.chunk(10)[3]
    data, buffers = pickle_out_of_band(part)
    row_bytes = 3 * 4 + 2 * 2 + 4 * 8 + 1 + 8  # obs, logp, ids, mask, score
    assert sum(b.raw().nbytes for b in buffers) == 10 * row_bytes
    back = pickle.loads(data, buffers=buffers)
    assert_dataproto_equal(back, part)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.uint16,
    ],
)
def test_all_dtypes_round_trip(dtype, no_warnings):
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4) - 10
    tensor = (
        (base != 0)
        if dtype == torch.bool
        else base.to(dtype)
        if dtype != torch.uint16
        else base.abs().to(dtype)
    )
    dp = DataProto.from_dict({"x": tensor})
    data, buffers = pickle_out_of_band(dp)
    back = pickle.loads(data, buffers=as_bytearray_frames(buffers))
    assert back.batch["x"].dtype == dtype
    assert torch.equal(back.batch["x"].view(torch.uint8), tensor.view(torch.uint8))
    header, frames = serialize_tensor(tensor)
    assert torch.equal(
        deserialize_tensor(header, as_bytes_frames(frames)).view(torch.uint8),
        tensor.view(torch.uint8),
    )


def test_non_contiguous_conj_and_requires_grad(no_warnings):
    base = torch.arange(12.0).reshape(3, 4)
    td = TensorDict(
        {
            "t": base.t().contiguous().t(),  # column-major, non-contiguous view
            "c": torch.complex(base, base).conj(),
            "g": torch.ones(3, 2, requires_grad=True),
            "e": torch.zeros(3, 0),
        },
        batch_size=[3],
    )
    dp = DataProto(batch=td)
    back = pickle.loads(*pickle_out_of_band(dp)[:1], buffers=pickle_out_of_band(dp)[1])
    assert torch.equal(back.batch["t"], base)
    assert torch.equal(back.batch["c"], torch.complex(base, -base))
    assert back.batch["g"].requires_grad
    assert back.batch["e"].shape == (3, 0)


def test_object_and_numeric_arrays(no_warnings):
    n = 4
    non_tensors = {
        "obj": np.array([{"a": 1}, None, [1, 2], "s"], dtype=object),
        "nested": np.array([np.arange(i) for i in range(n)] + [None], dtype=object)[:n],
        "words": np.array(["ab", "c", "def", ""]),
        "when": np.array(["2024-01-01", "2024-01-02", "NaT", "2024-01-04"], dtype="datetime64[ns]"),
        "grid": np.arange(n * 6, dtype=np.int32).reshape(n, 2, 3),
        "big_endian": np.arange(n, dtype=">f8"),
    }
    dp = DataProto.from_dict({"x": torch.zeros(n)}, non_tensors)
    data, buffers = pickle_out_of_band(dp)
    assert len(buffers) >= 5
    assert_dataproto_equal(pickle.loads(data, buffers=buffers), dp)
    header, frames = serialize_dataproto(dp)
    assert_dataproto_equal(deserialize_dataproto(header, as_bytes_frames(frames)), dp)


# ---------------------------------------------------------------------- header / frames


def test_header_frames_round_trip_and_msgpack_header(no_warnings):
    dp = make_dataproto(7, meta_info={"metrics": {"loss": [1.0]}, "step": 2})
    header, frames = serialize_dataproto(dp)
    packed = msgpack.packb(header)
    header2 = msgpack.unpackb(packed)
    assert all(isinstance(f, (memoryview, bytes)) for f in frames)
    # The original's own frames: zero copy, so the result shares memory with ``dp``.
    assert_dataproto_equal(deserialize_dataproto(header2, frames), dp)
    for frames_in in (as_bytes_frames(frames), as_bytearray_frames(frames)):
        back = deserialize_dataproto(header2, frames_in)
        assert_dataproto_equal(back, dp)
        back.batch["obs"].add_(1)
        back.non_tensor_batch["score"][0] = -1.0
    assert dp.non_tensor_batch["score"][0] == 0.0


def test_writable_frames_are_used_without_copy(no_warnings):
    dp = make_dataproto(5)
    header, frames = serialize_dataproto(dp)
    received = as_bytearray_frames(frames)
    back = deserialize_dataproto(header, received)
    index = next(e["frame"] for e in header["batch"]["entries"] if e["key"] == "obs")
    address = np.frombuffer(received[index], dtype=np.uint8).ctypes.data
    assert back.batch["obs"].data_ptr() == address


def test_misaligned_frame_is_copied_and_correct(no_warnings):
    tensor = torch.arange(10, dtype=torch.float64)
    header, frames = serialize_tensor(tensor)
    storage = bytearray(tensor.numel() * 8 + 1)
    view = memoryview(storage)[1:]
    view[:] = memoryview(frames[0])
    back = deserialize_tensor(header, [view])
    assert torch.equal(back, tensor)
    assert back.data_ptr() % 8 == 0


def test_tensordict_and_tensor_pairs(no_warnings):
    td = TensorDict(
        {
            "a": torch.randn(4, 2),
            "sub": TensorDict({"b": torch.arange(8).reshape(4, 2)}, batch_size=[4, 2]),
            "note": NonTensorData("hello", batch_size=[4]),
        },
        batch_size=[4],
    )
    header, frames = serialize_tensordict(td)
    msgpack.packb(header)
    back = deserialize_tensordict(header, as_bytes_frames(frames))
    assert back["sub"].batch_size == torch.Size([4, 2])
    assert back["note"] == "hello"
    assert_tensors_equal(back["a"], td["a"])
    assert_tensors_equal(back["sub", "b"], td["sub", "b"])
    tensor = torch.randn(3, 5).to(torch.bfloat16)
    header, frames = serialize_tensor(tensor)
    assert len(frames) == 1
    assert_tensors_equal(deserialize_tensor(header, frames), tensor)


def test_exotic_tensors_fall_back_to_pickle():
    sparse = torch.eye(3).to_sparse()
    header, frames = serialize_tensor(sparse)
    back = deserialize_tensor(header, frames)
    assert back.is_sparse and torch.equal(back.to_dense(), torch.eye(3))


def test_dataproto_without_batch_and_empty(no_warnings):
    for dp in (
        DataProto.from_dict(non_tensors={"a": np.arange(3)}),
        DataProto(),
        make_dataproto(0),
    ):
        assert_dataproto_equal(pickle.loads(pickle.dumps(dp, protocol=5)), dp)
        data, buffers = pickle_out_of_band(dp)
        assert_dataproto_equal(pickle.loads(data, buffers=buffers), dp)
        header, frames = serialize_dataproto(dp)
        assert_dataproto_equal(deserialize_dataproto(header, frames), dp)


def test_padding_flag_survives():
    dp = make_dataproto(3, auto_padding=True)
    assert pickle.loads(pickle.dumps(dp, protocol=5)).is_padding_enabled()


def test_header_errors():
    tensor_header, tensor_frames = serialize_tensor(torch.zeros(4))
    with pytest.raises(ValueError, match="expected 'DataProto'"):
        deserialize_dataproto(tensor_header, tensor_frames)
    with pytest.raises(ValueError, match="frame holds 15 bytes but the header describes 16"):
        deserialize_tensor(tensor_header, [b"x" * 15])
    with pytest.raises(ValueError, match="version"):
        deserialize_tensor({**tensor_header, "version": 999}, tensor_frames)
    with pytest.raises(TypeError):
        serialize_dataproto({"a": 1})


def test_unavailable_device_falls_back_to_cpu():
    header, frames = serialize_tensor(torch.arange(3.0))
    header["body"]["device"] = "cuda:7" if not torch.cuda.is_available() else "cuda:999"
    back = deserialize_tensor(header, frames)
    assert back.device.type == "cpu" and torch.equal(back, torch.arange(3.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_come_back_on_cuda():
    dp = make_dataproto(4).to("cuda:0")
    back = pickle.loads(*pickle_out_of_band(dp)[:1], buffers=pickle_out_of_band(dp)[1])
    assert back.batch["obs"].device.type == "cuda"
    assert back.batch.device == dp.batch.device
    assert_dataproto_equal(back.to("cpu"), make_dataproto(4))


# ---------------------------------------------------------------------- subclass, copies, sizeof


@dataclasses.dataclass(eq=False, repr=False)
class TaggedProto(DataProto):
    tag: str = "none"


def test_subclass_and_extra_fields_survive():
    dp = TaggedProto(batch=make_dataproto(2).batch, tag="hello")
    back = pickle.loads(pickle.dumps(dp, protocol=5))
    assert type(back) is TaggedProto and back.tag == "hello"


def test_deepcopy_is_independent():
    dp = make_dataproto(3)
    clone = copy.deepcopy(dp)
    clone.batch["obs"].zero_()
    assert dp.batch["obs"].abs().sum() > 0


def test_sizeof_counts_buffers_and_estimates_objects():
    tensor = torch.zeros(10, 10)
    assert sizeof_tensor(tensor) == 400
    assert sizeof_tensor(tensor[:5]) == 200
    td = TensorDict(
        {"a": tensor, "s": TensorDict({"b": torch.zeros(10, dtype=torch.int64)}, [10])}, [10]
    )
    assert sizeof_tensordict(td) == 480
    words = np.array(["x" * 1000] * 10, dtype=object)
    dp = DataProto(batch=td, non_tensor_batch={"w": words, "f": np.zeros(10)})
    size = sizeof_dataproto(dp)
    assert 480 + 80 + 10 * 1000 <= size < 480 + 80 + 10 * 1200 + 2000


def test_arrays_compare_helper():
    assert_arrays_equal(np.array([1.0, np.nan]), np.array([1.0, np.nan]))
    assert_tensordicts_equal(TensorDict({}, [2]), TensorDict({}, [2]))
