"""Arguments and results come back exactly as sent, whichever way they travel.

Plain values (None, bool, float, 64-bit int, short UTF-8 str) ride inside the direct
path's messages; everything else goes through Dask's serializers. The boundary must not
show: a tuple stays a tuple, an IntEnum stays an IntEnum, a huge int or a lone surrogate
still arrives.
"""

from __future__ import annotations

import enum
import socket
import threading

import pytest
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends.dask.wire.messages import (
    is_plain,
    pack,
    plain_call,
    read_message,
    unpack,
    write_message,
)


class Level(enum.IntEnum):
    HIGH = 2


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, *args, **kwargs):
        return [(type(a).__name__, a) for a in args], {
            k: (type(v).__name__, v) for k, v in kwargs.items()
        }

    @hf.register(hf.Dispatch.RANK_ZERO)
    def give(self, value):
        return value


VALUES = [
    None,
    True,
    0,
    -(2**63),
    2**64 - 1,
    2**64,  # too big for msgpack: must take the other way
    -(2**63) - 1,
    1.5,
    "",
    "path/to/checkpoint",
    "x" * 70_000,  # longer than the plain limit
    "caf\u00e9 \u2603",
    "\ud800",  # a lone surrogate: not UTF-8
    b"raw",
    (1, 2),
    [1, (2, 3)],
    {"a": (1,)},
    Level.HIGH,
]


@pytest.fixture(scope="module")
def echo(hf_dask_backend):
    group = hf.WorkerGroup(hf.ResourcePool([2]), Echo, backend=hf_dask_backend)
    yield group
    group.shutdown()


@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{type(v).__name__}:{str(v)[:12]!r}")
def test_an_argument_and_a_result_arrive_with_their_type_and_value(echo, value):
    for args, kwargs in echo.echo(value, named=value):
        assert args == [(type(value).__name__, value)]
        assert kwargs == {"named": (type(value).__name__, value)}
    back = echo.give(value)
    assert type(back) is type(value) and back == value


def test_only_values_msgpack_returns_unchanged_count_as_plain():
    assert all(is_plain(v) for v in (None, True, 3, 1.5, "s", 2**64 - 1, -(2**63)))
    assert not any(is_plain(v) for v in (2**64, (1,), [1], b"x", Level.HIGH, "\ud800"))
    assert plain_call((1, "a"), {"step": 3})
    assert not plain_call(([1],), {})
    assert not plain_call((), {"step": (3,)})


def test_a_lane_message_read_back_has_its_fields_and_small_frames_it_may_change():
    """Read over a real socket: a message without frames arrives whole, and a tensor of
    a few bytes (its frame read like the message's own fields would be) is writable."""
    sender, receiver = socket.socketpair()
    stream = receiver.makefile("rb", buffering=1 << 16)
    plain = {"op": "hf_call", "seq": 3, "args": (), "kwargs": {}, "deadline": None}
    framed = {"op": "hf_call", "args": pack((torch.arange(4.0),), "a test tensor")}

    def send() -> None:
        write_message(sender.sendall, plain)
        write_message(sender.sendall, framed)

    writer = threading.Thread(target=send)
    writer.start()
    try:
        got, copied = read_message(stream)
        assert (got, copied) == (plain, False)
        got, _ = read_message(stream)
        assert got["args"].frames and not any(memoryview(f).readonly for f in got["args"].frames)
        (tensor,) = unpack(got["args"])
        tensor += 1  # a frame read back is the receiver's own, writable memory
        assert tensor.tolist() == [1.0, 2.0, 3.0, 4.0]
    finally:
        writer.join()
        sender.close()
        receiver.close()


def test_a_batch_of_tuple_parts_is_one_write_and_one_of_dict_parts_brings_their_frames():
    """A batch whose ranks share their arguments lists each rank as a tuple: nothing to
    frame, so it is one pickle in one write; a batch whose parts are dicts carrying
    serialized arguments still sends each part's frames after it, matched up on reading."""
    sender, receiver = socket.socketpair()
    stream = receiver.makefile("rb", buffering=1 << 16)
    shared = {"op": "calls", "args": (), "kwargs": {}, "calls": [("g/0#a", 1, "k-0")] * 32}
    parts = {
        "op": "calls",
        "calls": [
            {"instance": f"g/{rank}#a", "args": pack((torch.full((2,), rank),), "a test")}
            for rank in range(3)
        ],
    }
    writes: list[int] = []

    def send() -> None:
        write_message(lambda data: (writes.append(len(data)), sender.sendall(data)), shared)
        write_message(sender.sendall, parts)

    writer = threading.Thread(target=send)
    writer.start()
    try:
        got, _ = read_message(stream)
        assert got == shared and len(writes) == 1
        got, _ = read_message(stream)
        assert [unpack(part["args"])[0].tolist() for part in got["calls"]] == [
            [0, 0],
            [1, 1],
            [2, 2],
        ]
    finally:
        writer.join()
        sender.close()
        receiver.close()
