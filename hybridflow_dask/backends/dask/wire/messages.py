"""How direct-path messages are written: which values travel as they are, and the frames
of the socket the calling thread writes to.

Dask's serializers (type dispatch, the pickle family's checks, sub-frames) cost tens of
microseconds per value, even for an empty tuple; msgpack writes a number or a short
string in well under one. Control calls (``init_model()``, ``save(path)``, ``step(3)``)
carry only such values and most return ``None`` or a number, so they skip Dask's
serializers on both legs. Only types msgpack gives back unchanged qualify: a tuple
would come back as a list and an ``IntEnum`` as an ``int``, so those go through Dask.
"""

from __future__ import annotations

import logging
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from distributed.protocol.serialize import Serialized, deserialize, serialize

from ....errors import ProtocolError
from ....protocol.large_memory import take
from .same_host import address_of, pull

logger = logging.getLogger(__name__)

__all__ = [
    "LEAVE_MIN",
    "PLAIN_HEAD",
    "Framed",
    "LaneLimits",
    "is_plain",
    "may_have_frames",
    "message_size",
    "own_framed",
    "pack",
    "plain_call",
    "plain_message",
    "plain_size",
    "read_message",
    "unpack",
    "write_message",
]

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can write
_STR_MAX = 1 << 16


def is_plain(value: Any) -> bool:
    """``value`` is ``None``, a ``bool``, ``float``, a 64-bit ``int`` or a short UTF-8 ``str``."""
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return True
    if kind is int:
        return _INT_MIN <= value <= _INT_MAX
    if kind is str:
        return len(value) <= _STR_MAX and (value.isascii() or _encodes(value))
    return False


def plain_call(args: Any, kwargs: Any) -> bool:
    """Every positional and keyword argument of a call is plain."""
    return (
        type(args) is tuple
        and type(kwargs) is dict
        and all(is_plain(a) for a in args)
        and all(type(k) is str and is_plain(v) for k, v in kwargs.items())
    )


def pack(
    value: Any,
    what: str,
    *,
    back: bool = False,
    serializers: tuple[str, ...] = ("dask", "pickle"),
) -> Serialized:
    """``value`` through Dask's serializers, in the thread that has it: a value that cannot
    travel fails there, at once, naming ``what`` (an argument, or with ``back`` a result),
    and the event loop or socket only writes ready frames (tensors stay zero-copy views).
    Only copies made within a process (``snapshot``) ask for other ``serializers``."""
    try:
        return Serialized(*serialize(value, serializers=serializers, on_error="raise"))
    except Exception as exc:
        where, verb = ("back to the driver", "return") if back else ("to a Dask worker", "pass")
        raise TypeError(
            f"{what} cannot be sent {where}: {exc!r}; {verb} picklable values "
            "(tensors, arrays, DataProto, plain Python objects)"
        ) from exc


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates: msgpack would fail on the event loop
        return False
    return True


# -- socket messages ---------------------------------------------------------------------------
#
# A message is a dict. Its ``Serialized`` values (Dask's header and frames), and those of
# the dicts in its lists (a batch's calls or replies, one level down), travel after it
# as raw frames, each written straight from the tensor's memory and read into one buffer
# of its exact size; everything else is in one pickle. On the wire:
# [meta length, frame count] [frame lengths] [pickled dict] [frame] [frame] ...
# A frame whose length has the top bit set stayed in the sender's memory: in its place is
# its address there, for the reader to copy itself (``same_host``).

_HEAD = struct.Struct("!QI")
#: Where a message's pickled fields begin when it carries no frames.
PLAIN_HEAD = _HEAD.size
_ADDRESS = struct.Struct("!Q")
_LEFT = 1 << 63
#: Messages up to this size are joined into one write (one system call, one TCP segment).
_JOIN_MAX = 1 << 16
#: Frames from this size on stay in the sender's memory when the reader can copy them.
LEAVE_MIN = 1 << 20


class Framed:
    """Stands in a socket message for a value sent as Dask frames after it."""

    __slots__ = ("count", "frames", "header")

    def __init__(self, header: dict, count: int) -> None:
        self.header, self.count = header, count
        self.frames: list[Any] = []

    def __reduce__(self) -> Any:
        return (Framed, (self.header, self.count))


#: How a pickle names the ``Framed`` class (in every pickle holding one).
_FRAMED_NAME = Framed.__qualname__.encode()


def write_message(write: Any, msg: dict, *, leave_in_place: bool = False) -> list[Any]:
    """Write ``msg`` with ``write`` (a socket's ``sendall``).

    With ``leave_in_place`` (the reader can copy from this process), frames of
    ``LEAVE_MIN`` bytes and more are not written, only their addresses. They are returned:
    the caller keeps them alive, and unchanged, until the reader says it has copied them.
    """
    if not may_have_frames(msg):
        body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        write(_HEAD.pack(len(body), 0) + body)
        return []
    frames: list[Any] = []
    meta = _framed(msg, frames)
    for name, value in meta.items():
        if _has_parts(value):  # a batch's calls or replies, each a dict
            meta[name] = [_framed(v, frames) if type(v) is dict else v for v in value]
    body = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [memoryview(f).nbytes for f in frames]
    left = [leave_in_place and size >= LEAVE_MIN for size in sizes]
    lengths = [size | _LEFT if keep else size for size, keep in zip(sizes, left)]
    head = _HEAD.pack(len(body), len(sizes)) + struct.pack(f"!{len(sizes)}Q", *lengths)
    small: list[Any] = [head, body]  # joined into one write, up to the next large frame
    small_bytes = len(head) + len(body)
    for frame, size, keep in zip(frames, sizes, left):
        if keep:
            small.append(_ADDRESS.pack(address_of(frame)))
            small_bytes += _ADDRESS.size
        elif small_bytes + size <= _JOIN_MAX:
            small.append(frame)
            small_bytes += size
        else:
            if small:
                write(b"".join(small))
                small, small_bytes = [], 0
            write(frame)
    if small:
        write(b"".join(small))
    return [frame for frame, keep in zip(frames, left) if keep]


def may_have_frames(msg: dict) -> bool:
    """Whether a value of ``msg`` is serialized (frames) or a batch's parts as dicts
    (which may hold some). (A loop: on the path of every call, where a generator costs
    a few µs more.)"""
    for value in msg.values():
        if isinstance(value, Serialized):
            return True
        if type(value) is list and value and type(value[0]) is dict:  # (``_has_parts``)
            return True
    return False


def _has_parts(value: Any) -> bool:
    """Whether ``value`` is a batch's parts written as dicts (a batch's parts are all
    dicts or all tuples: only its first is looked at, on a call to hundreds of ranks)."""
    return type(value) is list and bool(value) and type(value[0]) is dict


def _framed(values: dict, frames: list[Any]) -> dict[str, Any]:
    """``values`` with each ``Serialized`` one replaced by its ``Framed`` stand-in, its
    frames appended to ``frames``. (A plain function: a nested one calling itself is a
    reference cycle, which would keep the frames, views of tensors' memory, alive until
    the garbage collector, and have it release them in any order.)"""
    meta: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, Serialized):
            meta[name] = Framed(value.header, len(value.frames))
            frames += value.frames
        else:
            meta[name] = value
    return meta


@dataclass(frozen=True)
class LaneLimits:
    """What one message may declare, checked before any memory is taken for it.

    Defaults come from ``hybridflow.lane-max-message`` and ``hybridflow.lane-max-frames``
    (``from_config``); the pickled part of a message (everything but tensor and array
    frames: plain arguments, headers) is bounded apart, and smaller.
    """

    max_message_bytes: int = 64 << 30
    max_frames: int = 100_000
    max_meta_bytes: int = 256 << 20

    @classmethod
    def from_config(cls) -> LaneLimits:
        import dask.config
        from dask.utils import parse_bytes

        return cls(
            max_message_bytes=parse_bytes(dask.config.get("hybridflow.lane-max-message")),
            max_frames=int(dask.config.get("hybridflow.lane-max-frames")),
        )


def plain_size(buffer: Any, start: int, end: int) -> int | None:
    """The size of the pickled fields of the message at ``buffer[start:end]``, when all of
    it is there and it carries no frames (a reply with a small result: most replies);
    else ``None``. Those fields begin ``PLAIN_HEAD`` bytes after ``start``."""
    if end - start < _HEAD.size:
        return None
    body_size, count = _HEAD.unpack_from(buffer, start)
    if count or end - start - _HEAD.size < body_size:
        return None
    return int(body_size)


def plain_message(body: bytes) -> dict:
    """A message that carries no frames, from its pickled fields: what ``read_message``
    returns for it (its ``Framed`` values, serialized into no frames, given none)."""
    msg = pickle.loads(body)
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message is a {type(msg).__name__}, not a dict")
    if _FRAMED_NAME in body:  # (a pickle names the class of every object it holds)
        framed = _framed_values(msg)
        declared = sum(value.count for value in framed)
        if declared:
            raise ProtocolError(f"a message carries 0 frames but its values name {declared}")
        for value in framed:
            value.frames = []
    return msg


def message_size(head: Any) -> int | None:
    """How many bytes the message that starts with ``head`` takes on the wire: a lower
    bound while ``head`` lacks some of its frame lengths, ``None`` while it lacks the
    fixed header. (What lets a reader tell whether a whole message is in its buffer.)"""
    if len(head) < _HEAD.size:
        return None
    body_size, count = _HEAD.unpack_from(head)
    lengths_end = _HEAD.size + 8 * count
    size = lengths_end + body_size
    if len(head) < lengths_end:
        return size
    for length in struct.unpack_from(f"!{count}Q", head, _HEAD.size):
        size += _ADDRESS.size if length & _LEFT else length
    return size


class Readable(Protocol):
    """What ``read_message`` reads from: a buffered binary reader (``sock.makefile("rb")``,
    a lane's ``Inbox``)."""

    def readinto(self, buffer: Any, /) -> int | None: ...

    def read(self, size: int, /) -> bytes: ...


#: Reads up to this size are taken from the reader's buffer as ``bytes`` (a buffered
#: reader's ``read(n)`` returns fewer bytes only at the end of the stream).
_SMALL_READ = 1 << 12


_NO_LIMITS = LaneLimits()


def read_message(
    stream: Readable,
    pull_from: int | None = None,
    limits: LaneLimits = _NO_LIMITS,
    started: Callable[[], None] | None = None,
) -> tuple[dict, bool]:
    """The next message from a buffered reader, its ``Framed`` values still packed, and
    whether any frame was copied out of the sender's memory (process ``pull_from``).

    ``started`` is called once the message's header is in (the rest should follow
    promptly). Raises ``EOFError`` when the stream ends, also mid-message, ``OSError``
    when a frame left in the sender's memory cannot be copied, and ``ProtocolError``
    when the message is malformed or declares more than ``limits`` allow.
    """
    body_size, count = _HEAD.unpack(_read_fields(stream, _HEAD.size))
    if started is not None:
        started()
    if count > limits.max_frames:
        raise ProtocolError(f"a message declared {count} frames (limit {limits.max_frames})")
    if body_size > limits.max_meta_bytes:
        raise ProtocolError(
            f"a message declared {body_size} bytes of pickled data (limit {limits.max_meta_bytes})"
        )
    lengths = struct.unpack(f"!{count}Q", _read_fields(stream, 8 * count)) if count else ()
    total = body_size + sum(length & ~_LEFT for length in lengths)
    if total > limits.max_message_bytes:
        raise ProtocolError(
            f"a message declared {total} bytes (limit hybridflow.lane-max-message="
            f"{limits.max_message_bytes})"
        )
    body = _read_fields(stream, body_size)
    if not count:
        return plain_message(body), False
    msg = pickle.loads(body)
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message is a {type(msg).__name__}, not a dict")
    declared = sum(v.count for v in _framed_values(msg))
    if declared != count:
        raise ProtocolError(f"a message carries {count} frames but its values name {declared}")
    frames: list[Any] = []
    copied = False
    # A call whose deadline passed is refused unread: its sender has reported it failed
    # and may have changed or freed the memory its frames were left in.
    late = isinstance(msg.get("deadline"), float) and time.time() >= msg["deadline"]
    for length in lengths:
        if length & _LEFT:
            if pull_from is None:
                raise ProtocolError("a frame was left in the sender's memory, which is not allowed")
            (address,) = _ADDRESS.unpack(_read_fields(stream, _ADDRESS.size))
            if late:
                frames.append(None)
                continue
            try:
                frames.append(pull(pull_from, address, take(length & ~_LEFT)))
            except OSError as exc:
                logger.warning("a lane frame could not be copied from its sender: %s", exc)
                raise
            copied = True
        else:
            frames.append(_read(stream, length))
    parts = iter(frames)
    for value in _framed_values(msg):
        value.frames = [next(parts) for _ in range(value.count)]
    return msg, copied


def _framed_values(msg: dict) -> list[Framed]:
    """The ``Framed`` values of a message in the order their frames follow it (as
    ``write_message`` writes them): its own, then those of the dicts in its lists (a
    batch's calls or replies)."""
    found = [value for value in msg.values() if isinstance(value, Framed)]
    for value in msg.values():
        if _has_parts(value):
            for item in value:
                if type(item) is dict:
                    found += [v for v in item.values() if isinstance(v, Framed)]
    return found


def own_framed(value: Any) -> Any:
    """``value`` with frames of its own if it is ``Framed`` (a reader's copy of shared ones)."""
    if not isinstance(value, Framed):
        return value
    copy = Framed(value.header, value.count)
    copy.frames = [bytearray(memoryview(f).cast("B")) for f in value.frames]
    return copy


def unpack(value: Any) -> Any:
    """A message's value as sent: ``Framed`` ones deserialized."""
    return deserialize(value.header, value.frames) if isinstance(value, Framed) else value


def _read_fields(stream: Readable, size: int) -> Any:
    """A message's header or pickled fields (never a frame: frames must be writable)."""
    if size > _SMALL_READ:
        return _read(stream, size)
    data = stream.read(size)  # (from the reader's buffer: no buffer of our own to fill)
    if len(data) != size:
        raise EOFError("the stream ended")
    return data


def _read(stream: Readable, size: int) -> Any:
    # A large frame goes into numpy memory (not zero-filled first, unlike a bytearray), a
    # block of the process's cache when very large (see ``protocol.large_memory``).
    buffer = bytearray(size) if size < _JOIN_MAX else take(size)
    view = memoryview(cast(Any, buffer)).cast("B")  # numpy types its buffer for 3.12+ only
    done = 0
    while done < size:
        got = stream.readinto(view[done:])
        if not got:
            raise EOFError("the stream ended")
        done += got
    return buffer
