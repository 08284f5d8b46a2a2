"""Zero-copy serialization of DataProto, TensorDict and torch tensors.

Why: verl ships a DataProto by ``torch.save``-ing its TensorDict into one bytes blob, which
copies every tensor at least twice on each side. Here every tensor and every numeric numpy
array becomes one contiguous byte buffer ("frame") that travels as is, and only a small
msgpack-friendly header describes how to put them back together.

Two entry points share one encoding:

* ``pickle`` protocol 5: :func:`reduce_dataproto` backs ``DataProto.__reduce_ex__``; with a
  ``buffer_callback`` each tensor/numeric array is one out-of-band ``pickle.PickleBuffer``.
  Without a callback the buffers are written in band; under protocol < 5 they become bytes.
* ``(header, frames)`` pairs for a Dask serializer: ``serialize_*``/``deserialize_*``. The
  header holds only dicts, lists, str, int, float, bool and None. Object arrays, meta_info
  and any leaf that is not a plain strided tensor are pickled together into one frame (numpy
  arrays inside them become extra frames through pickle's own out-of-band buffers).

What comes back:

* Zero copy when a frame is a writable buffer whose address suits the dtype (e.g. a
  ``bytearray`` a comm read into, or the original tensor's memory in an in-process round
  trip, where the result then shares memory with the input, as pickle-5 does for numpy).
  A read-only frame (``bytes``) or a misaligned one is copied once into a ``bytearray``, so
  every tensor and array returned is writable and torch never warns about read-only memory.
* Dtypes numpy lacks (bfloat16, float8, ...) need no special case: frames are raw bytes and
  ``torch.frombuffer`` takes the dtype. Conjugate/negative views are resolved first.
* A tensor on another device is copied to CPU for the frame; on load it goes back to the
  recorded device when this process has it, otherwise it stays on CPU (and a TensorDict
  whose device is unavailable comes back with device ``cpu``). ``requires_grad`` is kept.
* The device route (``device_frames=True``, for Dask's ``cuda`` serialization family)
  keeps a CUDA tensor's frame on its device: the frame is the tensor's bytes as a flat
  ``uint8`` CUDA tensor (which has ``__cuda_array_interface__``, so a comm that carries
  device memory sends it as such). Loading accepts such frames, and any other object
  with ``__cuda_array_interface__`` (what UCX receives into), without a host copy.
* Sparse, quantized, nested, meta-device tensors and tensor subclasses are pickled in the
  object frame instead (correct, not zero-copy).
"""

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from .data_proto import DataProto
from .large_memory import take
from .lazy_tensordict import tensordict
from .rows import CUT_MARK

__all__ = [
    "FORMAT_VERSION",
    "deserialize_dataproto",
    "deserialize_tensor",
    "deserialize_tensordict",
    "is_device_frame",
    "reduce_dataproto",
    "serialize_dataproto",
    "serialize_tensor",
    "serialize_tensordict",
    "sizeof_dataproto",
    "sizeof_tensor",
    "sizeof_tensordict",
]

logger = logging.getLogger(__name__)

#: Bumped when the header layout changes; deserializers refuse other versions.
FORMAT_VERSION = 1

Frame = memoryview | bytes | bytearray | pickle.PickleBuffer  # or a device frame (a tensor)

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_BUFFER_ARRAY_KINDS = frozenset("biufcmMSU")
_OBJECT_SAMPLE = 32


# ---------------------------------------------------------------------- frames


class _FrameWriter:
    """Collects raw buffers (one per tensor/array) and objects that must be pickled.

    ``on_device`` says which tensors keep their bytes on their device (the device route):
    their frame is a flat ``uint8`` tensor there instead of host bytes.
    """

    def __init__(self, on_device: Callable[[torch.Tensor], bool] | None = None) -> None:
        self.buffers: list[Any] = []  # memoryviews, and device frames (uint8 tensors)
        self.objects: list[Any] = []
        self.on_device = on_device

    def add_buffer(self, buffer: Any) -> int:
        self.buffers.append(buffer)
        return len(self.buffers) - 1

    def add_object(self, obj: Any) -> int:
        self.objects.append(obj)
        return len(self.objects) - 1

    def to_frames(self) -> tuple[dict | None, list[Frame]]:
        """Frames for the header/frames path: buffers, then one pickle frame and its buffers."""
        frames: list[Frame] = list(self.buffers)
        if not self.objects:
            return None, frames
        extra: list[pickle.PickleBuffer] = []
        blob = pickle.dumps(self.objects, protocol=5, buffer_callback=extra.append)
        frames.append(blob)
        first_extra = len(frames)
        frames.extend(buffer.raw() for buffer in extra)
        return {"frame": first_extra - 1, "buffers": list(range(first_extra, len(frames)))}, frames


class _FrameReader:
    """Gives back frames by index and the unpickled object list."""

    def __init__(self, frames: Sequence[Any], objects: list[Any] | None) -> None:
        self.frames = frames
        self.objects = objects if objects is not None else []

    @classmethod
    def from_header(cls, header: dict, frames: Sequence[Any]) -> _FrameReader:
        spec = header.get("objects")
        objects = None
        if spec is not None:
            blob = frames[spec["frame"]]
            objects = pickle.loads(blob, buffers=[frames[i] for i in spec["buffers"]])
        return cls(frames, objects)

    def frame(self, index: int) -> Any:
        return self.frames[index]

    def object(self, index: int) -> Any:
        return self.objects[index]


def _check_header(header: Any, expected_type: str) -> None:
    if not isinstance(header, dict):
        raise TypeError(f"header must be a dict, got {type(header).__name__}")
    if header.get("type") != expected_type:
        raise ValueError(f"header describes {header.get('type')!r}, expected {expected_type!r}")
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"header has format version {header.get('version')!r}; "
            f"this build reads {FORMAT_VERSION}"
        )


def _as_byte_view(frame: Any) -> memoryview:
    view = frame.raw() if isinstance(frame, pickle.PickleBuffer) else memoryview(frame)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    return view


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _writable_bytes(frame: Any, nbytes: int, alignment: int) -> memoryview:
    """The frame as writable, suitably aligned bytes: zero copy if possible, else one copy.

    Dask's TCP comm reads a message's first large frame into the buffer of its header, at
    an unaligned address: that copy goes into a reused block when large (``take``), as
    fresh memory is slow to touch (and a ``bytearray`` is zero-filled first)."""
    view = _as_byte_view(frame)
    if view.nbytes != nbytes:
        raise ValueError(f"frame holds {view.nbytes} bytes but the header describes {nbytes}")
    if view.readonly or _address(view) % alignment:
        out = take(nbytes)
        out[:] = np.frombuffer(view, np.uint8)
        view = memoryview(cast(Any, out))  # numpy types its buffer for 3.12+ only
    return view


# ---------------------------------------------------------------------- tensors


def _is_plain_tensor(value: Any) -> bool:
    return (
        type(value) in _PLAIN_TENSOR_TYPES
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.is_nested
        and value.device.type != "meta"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in header")
    return dtype


def _tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """C-contiguous CPU bytes of ``tensor``; no copy when it already is such a tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    tensor = tensor.contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` tensor on its own device (the device route)."""
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _encode_tensor(tensor: torch.Tensor, writer: _FrameWriter) -> dict:
    on_device = writer.on_device is not None and writer.on_device(tensor)
    buffer = _device_bytes(tensor) if on_device else _tensor_buffer(tensor)
    return {
        "kind": "tensor",
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "device": str(tensor.device),
        "requires_grad": bool(tensor.requires_grad),
        "frame": writer.add_buffer(buffer),
    }


def is_device_frame(frame: Any) -> bool:
    """A frame that holds device memory: a tensor, or an object with
    ``__cuda_array_interface__`` (what a comm that carries device memory receives into)."""
    return isinstance(frame, torch.Tensor) or (
        not isinstance(frame, (bytes, bytearray, memoryview, pickle.PickleBuffer))
        and hasattr(frame, "__cuda_array_interface__")
    )


def _from_device_frame(frame: Any, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over a device frame's memory (no copy)."""
    # GPU only past a tensor: __cuda_array_interface__ memory, wrapped where it lies
    raw = frame if isinstance(frame, torch.Tensor) else torch.as_tensor(frame)
    raw = raw.reshape(-1).view(torch.uint8)
    nbytes = math.prod(shape) * dtype.itemsize
    if raw.numel() != nbytes:
        raise ValueError(f"frame holds {raw.numel()} bytes but the header describes {nbytes}")
    return raw.view(dtype).reshape(shape)


def _device_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:
        return False


def _resolve_device(name: str | None) -> torch.device | None:
    """The recorded device if this process has it, else CPU (None stays None)."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return torch.device("cpu")
    if _device_available(device):
        return device
    logger.debug("device %s is not available here; keeping data on CPU", name)
    return torch.device("cpu")


def _decode_tensor(entry: dict, reader: _FrameReader) -> torch.Tensor:
    dtype = _torch_dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    numel = math.prod(shape)
    frame = None if numel == 0 else reader.frame(entry["frame"])
    if frame is None:
        tensor = torch.empty(shape, dtype=dtype)
    elif is_device_frame(frame):
        tensor = _from_device_frame(frame, dtype, shape)
    else:
        data = _writable_bytes(frame, numel * dtype.itemsize, dtype.itemsize)
        tensor = torch.frombuffer(data, dtype=dtype).reshape(shape)
    device = _resolve_device(entry["device"])
    if device is not None and device.type != "cpu":
        tensor = tensor.to(device)
    if entry.get("requires_grad"):
        tensor.requires_grad_(True)
    return tensor


# ---------------------------------------------------------------------- tensordicts


def _encode_tensordict(td: tensordict.TensorDictBase, writer: _FrameWriter) -> dict:
    entries = []
    for key, value in td.items():
        if isinstance(value, torch.Tensor) and _is_plain_tensor(value):
            entries.append({"key": key, **_encode_tensor(value, writer)})
        elif isinstance(value, tensordict.TensorDictBase) and not tensordict.is_non_tensor(value):
            entries.append({"key": key, **_encode_tensordict(value, writer)})
        else:
            entries.append({"key": key, "kind": "object", "index": writer.add_object(value)})
    return {
        "kind": "tensordict",
        "batch_size": list(td.batch_size),
        "device": None if td.device is None else str(td.device),
        "entries": entries,
    }


def _decode_tensordict(spec: dict, reader: _FrameReader) -> tensordict.TensorDict:
    source: dict[str, Any] = {}
    for entry in spec["entries"]:
        kind = entry["kind"]
        if kind == "tensor":
            source[entry["key"]] = _decode_tensor(entry, reader)
        elif kind == "tensordict":
            source[entry["key"]] = _decode_tensordict(entry, reader)
        elif kind == "object":
            source[entry["key"]] = reader.object(entry["index"])
        else:
            raise ValueError(f"unknown entry kind {kind!r} for key {entry['key']!r}")
    return tensordict.TensorDict(
        source, batch_size=spec["batch_size"], device=_resolve_device(spec["device"])
    )


# ---------------------------------------------------------------------- numpy arrays


def _is_buffer_array(array: np.ndarray) -> bool:
    dtype = array.dtype
    return not dtype.hasobject and dtype.fields is None and dtype.kind in _BUFFER_ARRAY_KINDS


def _array_buffer(array: np.ndarray) -> memoryview:
    array = np.ascontiguousarray(array)
    if array.size == 0:
        return memoryview(b"")
    # numpy types its arrays as buffers for Python 3.12+ only
    return memoryview(cast(Any, array.reshape(-1).view(np.uint8)))


def _decode_array(entry: dict, reader: _FrameReader) -> np.ndarray:
    dtype = np.dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    count = math.prod(shape)
    if count == 0:
        return np.empty(shape, dtype=dtype)
    data = _writable_bytes(reader.frame(entry["frame"]), count * dtype.itemsize, dtype.alignment)
    return np.frombuffer(data, dtype=dtype).reshape(shape)


# ---------------------------------------------------------------------- DataProto


#: What a DataProto's extra state (a subclass's own attributes) leaves out: its fields,
#: and the driver's note of where a dispatch chunk was cut from (not the chunk's data).
_NOT_EXTRA_STATE = frozenset({"batch", "non_tensor_batch", "meta_info", CUT_MARK})


def _encode_dataproto(data: DataProto, writer: _FrameWriter) -> dict:
    non_tensor = []
    for key, array in data.non_tensor_batch.items():
        if _is_buffer_array(array):
            non_tensor.append(
                {
                    "key": key,
                    "kind": "array",
                    "dtype": array.dtype.str,
                    "shape": list(array.shape),
                    "frame": writer.add_buffer(_array_buffer(array)),
                }
            )
        else:
            non_tensor.append({"key": key, "kind": "object", "index": writer.add_object(array)})
    extra_state = {
        name: value for name, value in vars(data).items() if name not in _NOT_EXTRA_STATE
    }
    return {
        "type": "DataProto",
        "version": FORMAT_VERSION,
        "batch": None if data.batch is None else _encode_tensordict(data.batch, writer),
        "non_tensor": non_tensor,
        "meta_info": writer.add_object(data.meta_info),
        "extra_state": writer.add_object(extra_state) if extra_state else None,
    }


def _decode_dataproto(header: dict, reader: _FrameReader, cls: type[DataProto]) -> DataProto:
    batch = None if header["batch"] is None else _decode_tensordict(header["batch"], reader)
    non_tensor: dict[str, np.ndarray] = {}
    for entry in header["non_tensor"]:
        if entry["kind"] == "array":
            non_tensor[entry["key"]] = _decode_array(entry, reader)
        else:
            non_tensor[entry["key"]] = reader.object(entry["index"])
    data = cls.__new__(cls)
    data.batch = batch
    data.non_tensor_batch = non_tensor
    data.meta_info = reader.object(header["meta_info"])
    if header.get("extra_state") is not None:
        vars(data).update(reader.object(header["extra_state"]))
    data.check_consistency()
    return data


def reduce_dataproto(data: DataProto, protocol: int) -> tuple:
    """``__reduce_ex__`` for DataProto: buffers as PickleBuffer (protocol 5) or bytes (< 5)."""
    writer = _FrameWriter()
    header = _encode_dataproto(data, writer)
    if protocol >= 5:
        buffers: list[Any] = [pickle.PickleBuffer(view) for view in writer.buffers]
    else:
        buffers = [view.tobytes() for view in writer.buffers]
    return _rebuild_dataproto, (type(data), header, buffers, writer.objects)


def _rebuild_dataproto(
    cls: type[DataProto], header: dict, buffers: list[Any], objects: list[Any]
) -> DataProto:
    return _decode_dataproto(header, _FrameReader(buffers, objects), cls)


def _on_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def serialize_dataproto(
    data: DataProto, *, device_frames: bool | Callable[[torch.Tensor], bool] = False
) -> tuple[dict, list[Frame]]:
    """``(header, frames)``: one frame per tensor / numeric array, one pickle frame for the rest.

    ``device_frames=True`` keeps each CUDA tensor's frame on its device (the device
    route); a function instead of ``True`` picks the tensors itself (tests use it).
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"expected a DataProto, got {type(data).__name__}")
    writer = _FrameWriter(_device_choice(device_frames))
    header = _encode_dataproto(data, writer)
    header["objects"], frames = writer.to_frames()
    return header, frames


def deserialize_dataproto(header: dict, frames: Sequence[Any]) -> DataProto:
    """Inverse of :func:`serialize_dataproto`; see the module docstring for copy behaviour."""
    _check_header(header, "DataProto")
    return _decode_dataproto(header, _FrameReader.from_header(header, frames), DataProto)


def _device_choice(
    device_frames: bool | Callable[[torch.Tensor], bool],
) -> Callable[[torch.Tensor], bool] | None:
    if callable(device_frames):
        return device_frames
    return _on_cuda if device_frames else None


def serialize_tensordict(
    td: tensordict.TensorDictBase, *, device_frames: bool | Callable[[torch.Tensor], bool] = False
) -> tuple[dict, list[Frame]]:
    """``(header, frames)`` for a bare TensorDict (nested TensorDicts included)."""
    if not isinstance(td, tensordict.TensorDictBase):
        raise TypeError(f"expected a TensorDict, got {type(td).__name__}")
    writer = _FrameWriter(_device_choice(device_frames))
    header = {
        "type": "TensorDict",
        "version": FORMAT_VERSION,
        "body": _encode_tensordict(td, writer),
    }
    header["objects"], frames = writer.to_frames()
    return header, frames


def deserialize_tensordict(header: dict, frames: Sequence[Any]) -> tensordict.TensorDict:
    """Inverse of :func:`serialize_tensordict`."""
    _check_header(header, "TensorDict")
    return _decode_tensordict(header["body"], _FrameReader.from_header(header, frames))


def serialize_tensor(
    tensor: torch.Tensor, *, device_frames: bool | Callable[[torch.Tensor], bool] = False
) -> tuple[dict, list[Frame]]:
    """``(header, frames)`` for one tensor: one frame, or a pickle frame for exotic layouts."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    writer = _FrameWriter(_device_choice(device_frames))
    if _is_plain_tensor(tensor):
        body = _encode_tensor(tensor, writer)
    else:
        body = {"kind": "object", "index": writer.add_object(tensor)}
    header = {"type": "torch.Tensor", "version": FORMAT_VERSION, "body": body}
    header["objects"], frames = writer.to_frames()
    return header, frames


def deserialize_tensor(header: dict, frames: Sequence[Any]) -> torch.Tensor:
    """Inverse of :func:`serialize_tensor`."""
    _check_header(header, "torch.Tensor")
    reader = _FrameReader.from_header(header, frames)
    body = header["body"]
    if body["kind"] == "object":
        return reader.object(body["index"])
    return _decode_tensor(body, reader)


# ---------------------------------------------------------------------- sizeof


def _sizeof_object(obj: Any) -> int:
    from dask.sizeof import sizeof

    return int(sizeof(obj))


def _sizeof_object_array(array: np.ndarray) -> int:
    """Pointer bytes plus the mean size of up to 32 evenly spaced cells times the cell count."""
    count = array.size
    if count == 0:
        return int(array.nbytes)
    flat = array.reshape(-1)
    picks = np.unique(np.linspace(0, count - 1, num=min(count, _OBJECT_SAMPLE)).astype(np.int64))
    sample = sum(_sizeof_object(flat[i]) for i in picks)
    return int(array.nbytes + sample * count / len(picks))


def sizeof_tensor(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (what travels), not of its whole storage."""
    if _is_plain_tensor(tensor):
        return int(tensor.numel() * tensor.element_size())
    try:
        return int(tensor.nbytes)
    except (RuntimeError, AttributeError, NotImplementedError):
        return _sizeof_object(tensor)


def sizeof_tensordict(td: tensordict.TensorDictBase) -> int:
    """Sum over leaves: tensor bytes, nested TensorDicts, and estimated non-tensor leaves."""
    total = 0
    for value in td.values():
        if isinstance(value, torch.Tensor):
            total += sizeof_tensor(value)
        elif isinstance(value, tensordict.TensorDictBase) and not tensordict.is_non_tensor(value):
            total += sizeof_tensordict(value)
        else:
            total += _sizeof_object(value)
    return total


def sizeof_dataproto(data: DataProto) -> int:
    """Bytes of all buffers plus an estimate for object arrays and meta_info."""
    total = 0 if data.batch is None else sizeof_tensordict(data.batch)
    for array in data.non_tensor_batch.values():
        total += _sizeof_object_array(array) if array.dtype.hasobject else int(array.nbytes)
    return total + _sizeof_object(data.meta_info)
