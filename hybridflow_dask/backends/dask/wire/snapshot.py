"""Values captured when a call is made and when its method returns, as a Ray call captures them.

Dask's serializers hand a tensor over as a view of its memory (no copy), and Dask keeps a
result by reference until someone fetches it. Both are right for speed and wrong for a
caller, or an instance, that changes a tensor in place once the call has returned: the
worker would read the new values, or a later fetch would see the instance's later state.
So a value is copied exactly where its memory can still change before it has been read,
and nowhere else:

- **arguments** of a call that returns before they are written out (a non-blocking call,
  whose message leaves on the event loop later) have their frames copied in the calling
  thread (``own_frames``); a blocking call's caller waits until they are read, so its
  frames travel as views;
- **results** kept on the worker, or handed to Dask's comm to be written later, are copied
  in the instance's thread as the method returns (``snapshot``), before its next call
  can change them; a reply the instance's thread writes itself (the socket lane, which
  waits until the reader has the bytes) is not.

With the device route on (``device_route``), a snapshot's CUDA tensors are copied on
their device (their frames are device tensors, cloned); otherwise they go to host memory
and back, as they would to another process.
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
from dask.sizeof import sizeof
from distributed.protocol.serialize import Serialized, deserialize

from ....protocol.large_memory import LARGE_BYTES, take
from . import device_route
from .messages import is_plain, pack

__all__ = ["Captured", "Sealed", "SerializerCopy", "own_frames", "seal", "snapshot"]


def own_frames(packed: Serialized) -> Serialized:
    """``packed`` with frames of its own: later changes to the values it was made from
    no longer reach it."""
    return Serialized(packed.header, [_own(frame) for frame in packed.frames])


def _own(frame: Any) -> Any:
    if isinstance(frame, bytes):  # immutable already (pickled bytes, headers)
        return frame
    if isinstance(frame, torch.Tensor):  # a device frame (the device route): copied there
        return frame.clone()
    view = memoryview(frame).cast("B")
    if view.nbytes < LARGE_BYTES:
        return bytes(view)
    out = take(view.nbytes)  # a reused block: fresh memory is slow to touch here
    out[:] = numpy.frombuffer(view, numpy.uint8)
    return out


def snapshot(value: Any, what: str) -> Any:
    """A copy of ``value`` that shares no mutable memory with it (plain values as they are).

    Made the way the value would travel: serialized (tensors as views, no copy), its
    frames copied once (large ones into reused blocks: fresh memory is slow to touch on
    virtual machines) and deserialized as views of those copies. A value that cannot
    travel could not reach its caller either: ``TypeError`` naming ``what``.
    """
    if is_plain(value):
        return value
    packed = pack(value, what, back=True, serializers=device_route.serializers())
    return deserialize(packed.header, [_own(f) for f in packed.frames])


def seal(value: Any, what: str, limit: int) -> tuple[dict, list[bytes]] | None:
    """``value`` in its wire form, its frames immutable bytes of their own, when that is
    at most ``limit`` bytes; else ``None``. ``sizeof`` turns a large value away before
    anything is serialized; an object it underestimates is caught by its frames' size."""
    if sizeof(value) > limit:
        return None
    packed = pack(value, what, back=True)
    frames = [bytes(frame) for frame in packed.frames]
    if sum(map(len, frames)) > limit:
        return None
    return packed.header, frames


class Sealed:
    """A result the driver holds in its wire form (``seal``). Nobody can change it, and
    each ``open()`` is a copy of its own, as each fetch of a result kept on a worker is."""

    __slots__ = ("frames", "header")

    def __init__(self, header: dict, frames: list[bytes]) -> None:
        self.header, self.frames = header, frames

    def open(self) -> Any:
        return deserialize(self.header, list(self.frames))

    def packed(self) -> Serialized:
        """As a message carries a value it sends (its receiver reads it as it arrives)."""
        return Serialized(self.header, list(self.frames))


class SerializerCopy:
    """The Dask backend's copy policy (``hosting.CopyPolicy``): ``snapshot``."""

    def copy(self, value: Any, what: str) -> Any:
        return snapshot(value, what)


class Captured:
    """A driver value serialized, with frames of its own, when the call is made.

    It stands in a Dask task's arguments as bytes that no later change can reach, through
    the same serializers as everywhere else (plain pickling has no float8), and stays
    bytes on its way through the scheduler (which unpickles and pickles task arguments
    again); the task opens it on the worker (``opened``).
    """

    __slots__ = ("frames", "header")

    def __init__(self, value: Any, what: str) -> None:
        packed = pack(value, what)
        self.header = packed.header
        self.frames = [bytes(memoryview(f).cast("B")) for f in packed.frames]

    def __getstate__(self) -> Any:
        return self.header, self.frames

    def __setstate__(self, state: Any) -> None:
        self.header, self.frames = state

    @staticmethod
    def opened(values: Any) -> Any:
        """``values`` (a call's ``args`` tuple or ``kwargs`` dict) with each ``Captured``
        replaced by the value it holds."""
        if isinstance(values, dict):
            return {k: _open(v) for k, v in values.items()}
        return tuple(_open(v) for v in values)


def _open(value: Any) -> Any:
    return deserialize(value.header, value.frames) if isinstance(value, Captured) else value
