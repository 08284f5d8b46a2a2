"""Who reads a lane's replies: the caller waiting for them, in its own thread, with the
lane's reader thread taking over what no caller can read (a reply too large for the
lane's buffer, one stopped half way, a caller that gave up), and the shared buffer both
read from (real sockets, a real worker end on loopback).
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

import pytest
import torch
from distributed.protocol.serialize import Serialized, serialize
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver.inbox import Inbox
from hybridflow_dask.backends.dask.driver.lane import Lane, read_replies
from hybridflow_dask.backends.dask.wire.messages import (
    LEAVE_MIN,
    message_size,
    plain_message,
    read_message,
    unpack,
    write_message,
)
from hybridflow_dask.backends.dask.worker.lane_server import LaneServer

pytestmark = pytest.mark.timeout(120)


def _wire(msg: dict, *, leave_in_place: bool = False) -> tuple[bytes, list]:
    """What ``write_message`` writes for ``msg``, and the frames it left in place."""
    chunks: list[bytes] = []
    left = write_message(
        lambda data: chunks.append(bytes(data)), msg, leave_in_place=leave_in_place
    )
    return b"".join(chunks), left


class _Recorder:
    """A lane's ``on_reply``/``on_broken``, noting the thread each reply was read in."""

    def __init__(self) -> None:
        self.replies: list[tuple[dict, int]] = []
        self.broken: list[list] = []
        self.changed = threading.Condition()

    def on_reply(self, context, reply) -> None:
        with self.changed:
            self.replies.append((reply, threading.get_ident()))
            self.changed.notify_all()

    def on_broken(self, pending) -> None:
        with self.changed:
            self.broken.append(pending)
            self.changed.notify_all()

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)


@contextlib.contextmanager
def _lane_to(handle):
    """A lane from this process to a worker end on loopback whose ``handle(msg, reply)``
    answers (or not); yields the lane, its recorder and the server."""
    server = LaneServer("127.0.0.1", handle)
    recorder = _Recorder()
    lane = Lane(
        "127.0.0.1",
        server.port,
        server.token_for("driver-a"),
        on_reply=recorder.on_reply,
        on_broken=recorder.on_broken,
        same_host=False,
    )
    try:
        yield lane, recorder, server
    finally:
        lane.close()
        server.close()


def _echo(msg, reply):
    threading.Thread(target=reply, args=({"id": msg["id"], "n": msg.get("n")},)).start()


def test_a_waiting_caller_reads_its_replies_in_its_own_thread():
    with _lane_to(_echo) as (lane, recorder, _):
        assert lane.callers_may_read
        for n in range(3):
            lane.request({"op": "call", "n": n}, n, read_by_caller=True)
        read_replies([lane], lambda: len(recorder.replies) == 3, 5.0)
        assert sorted(reply["n"] for reply, _ in recorder.replies) == [0, 1, 2]
        assert {thread for _, thread in recorder.replies} == {threading.get_ident()}


def test_a_request_no_caller_reads_is_read_by_the_lane_thread():
    with _lane_to(_echo) as (lane, recorder, _):
        lane.request({"op": "call", "n": 1}, None)
        assert recorder.wait_for(lambda: recorder.replies)
        assert recorder.replies[0][1] == lane._reader.ident


def test_a_reply_too_large_for_the_lanes_buffer_reaches_its_caller_through_the_lane_thread():
    big = b"x" * (4 << 20)

    def handle(msg, reply):
        threading.Thread(target=reply, args=({"id": msg["id"], "data": big},)).start()

    with _lane_to(handle) as (lane, recorder, _):
        lane.request({"op": "call"}, None, read_by_caller=True)
        read_replies([lane], lambda: bool(recorder.replies), 5.0)  # gives up on it
        assert recorder.wait_for(lambda: recorder.replies)
        reply, thread = recorder.replies[0]
        assert reply["data"] == big and thread == lane._reader.ident


def test_a_reply_stopped_half_way_neither_holds_the_caller_past_its_timeout_nor_is_lost():
    with _lane_to(lambda msg, reply: None) as (lane, recorder, server):
        lane.request({"op": "call"}, None, read_by_caller=True)  # the lane's first: id 0
        wire, _ = _wire({"id": 0, "n": 42, "pad": b"p" * 1000})
        conn = next(iter(server._conns))  # the worker's end of this lane
        conn.sendall(wire[:500])  # then the worker stops
        start = time.monotonic()
        read_replies([lane], lambda: bool(recorder.replies), 0.3)
        assert 0.25 <= time.monotonic() - start < 2.0
        assert not recorder.replies
        conn.sendall(wire[500:])  # it goes on: the lane's thread has taken over
        assert recorder.wait_for(lambda: recorder.replies)
        assert recorder.replies[0][0]["n"] == 42
        assert recorder.replies[0][1] == lane._reader.ident


def test_a_caller_shut_out_by_another_reader_reads_nothing_and_returns():
    with _lane_to(_echo) as (lane, recorder, _):
        assert lane._acquire_reading()  # someone else reads this lane now
        lane.request({"op": "call", "n": 1}, None, read_by_caller=True)
        start = time.monotonic()
        read_replies([lane], lambda: False, 5.0)
        assert time.monotonic() - start < 1.0  # not waiting out its timeout
        lane._release_reading()  # a reply still waited for: the lane's thread reads it
        assert recorder.wait_for(lambda: recorder.replies)
        assert recorder.replies[0][1] == lane._reader.ident


def test_a_lane_its_worker_drops_while_idle_is_noticed_at_once_and_its_thread_ends():
    with _lane_to(_echo) as (lane, recorder, server):
        conn = next(iter(server._conns))
        conn.shutdown(socket.SHUT_RDWR)
        assert recorder.wait_for(lambda: recorder.broken)
        lane._reader.join(5)
        assert not lane._reader.is_alive() and lane.broken and lane._wake == -1


def test_closing_an_idle_lane_ends_its_thread():
    with _lane_to(_echo) as (lane, recorder, _):
        lane.close()
        lane._reader.join(5)
        assert not lane._reader.is_alive() and recorder.broken == [[]]


def test_a_caller_reading_when_the_worker_dies_reports_its_calls_broken():
    with _lane_to(lambda msg, reply: None) as (lane, recorder, server):
        lane.request({"op": "call"}, "mine", read_by_caller=True)
        threading.Timer(0.2, next(iter(server._conns)).shutdown, (socket.SHUT_RDWR,)).start()
        read_replies([lane], lambda: bool(recorder.broken), 5.0)
        assert recorder.broken == [["mine"]] and not recorder.replies


def test_a_lane_that_ends_wakes_a_caller_waiting_on_another_at_once():
    silent = _lane_to(lambda msg, reply: None)
    with _lane_to(lambda msg, reply: None) as (dying, broken, server), silent as (other, _, _):
        dying.request({"op": "call"}, "mine", read_by_caller=True)
        other.request({"op": "call"}, "theirs", read_by_caller=True)  # the one watched
        threading.Timer(0.2, next(iter(server._conns)).shutdown, (socket.SHUT_RDWR,)).start()
        start = time.monotonic()
        read_replies([dying, other], lambda: bool(broken.broken), 10.0)
        assert time.monotonic() - start < 2.0  # not the 10 s the other lane could take
        assert broken.broken == [["mine"]]


def test_message_size_names_the_bytes_write_message_writes():
    frame = torch.arange(LEAVE_MIN // 4 + 7, dtype=torch.int32)
    messages = [
        {"id": 1},
        {"id": 2, "result": Serialized(*serialize(torch.ones(10)))},
        {"id": 3, "replies": [{"result": Serialized(*serialize(frame))}, {"result": None}]},
    ]
    for msg in messages:
        for leave in (False, True):
            wire, left = _wire(dict(msg), leave_in_place=leave)
            assert message_size(wire) == len(wire) == message_size(wire + b"next")
            for cut in [*range(min(len(wire), 400)), len(wire) // 2, len(wire) - 1]:
                size = message_size(wire[:cut])
                assert (size is None) == (cut < 12)  # the fixed header: 12 bytes
                assert size is None or size <= len(wire)
            del left


def test_a_caller_takes_a_message_at_once_only_when_all_of_it_is_in_and_it_has_no_frames():
    a, b = socket.socketpair()
    framed = {"id": 1, "result": Serialized(*serialize(torch.ones(10)))}
    plain = {"id": 2, "result": "ok"}
    tail, _ = _wire({"id": 3, "result": None})
    try:
        b.sendall(_wire(framed)[0] + _wire(plain)[0] + tail[:-1])
        inbox = Inbox(a)
        while inbox.receive_now():
            pass
        assert inbox.take_plain(1 << 20) is None  # frames follow it: the buffered reader's
        msg, _ = read_message(inbox)
        assert torch.equal(unpack(msg["result"]), torch.ones(10))
        assert inbox.take_plain(10) is None  # more than the caller may take at once
        assert plain_message(inbox.take_plain(1 << 20)) == plain
        assert inbox.take_plain(1 << 20) is None and inbox.buffered == len(tail) - 1
    finally:
        a.close()
        b.close()


_values = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.one_of(st.integers(), st.text(max_size=50), st.binary(max_size=200_000)),
    max_size=3,
)


@settings(max_examples=30, deadline=None)
@given(
    messages=st.lists(_values, min_size=1, max_size=6),
    chunk=st.integers(1, 70_000),
    seed=st.integers(0, 2**16),
)
def test_the_inbox_reads_the_same_messages_whoever_reads_each_and_however_they_arrive(
    messages, chunk, seed
):
    """Messages written in arbitrary pieces come out whole and in order, whether each is
    read waiting (the lane's thread) or only once wholly in (a caller)."""
    choose = random.Random(seed)
    a, b = socket.socketpair()
    wire = b"".join(_wire({"id": i, **m})[0] for i, m in enumerate(messages))

    def write() -> None:
        for start in range(0, len(wire), chunk):
            b.sendall(wire[start : start + chunk])
            time.sleep(choose.random() / 2000)
        b.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write)
    writer.start()
    inbox = Inbox(a)
    got: list[dict] = []
    try:
        while len(got) < len(messages):
            size = inbox.next_size()
            as_caller = choose.random() < 0.5 and (size is None or size <= inbox.capacity)
            if as_caller and (body := inbox.take_plain(1 << 30)) is not None:  # whole
                got.append(plain_message(body))
                continue
            if as_caller and (size is None or size > inbox.buffered):  # take in, never wait
                inbox.receive_now()
                time.sleep(0.0002)
                continue
            got.append(read_message(inbox)[0])  # whole, or read waiting for the rest
    finally:
        writer.join()
        a.close()
        b.close()
    assert got == [{"id": i, **m} for i, m in enumerate(messages)]


class Big(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def big(self):
        return torch.ones(1 << 19)  # 2 MiB: left in the worker's memory on one host

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def after(self):
        time.sleep(0.2)
        return 1


def test_a_blocking_calls_replies_gathered_with_other_futures_are_still_read(hf_dask_cluster):
    """Gathered together with a later call's Dask futures, a blocking call's replies are
    read by the lanes' threads: unread, their instances would wait for the driver to
    copy the results, and the later call behind them for good."""
    backend = DaskBackend(cluster=hf_dask_cluster)
    group = hf.WorkerGroup(hf.ResourcePool([2]), Big, backend=backend)
    try:
        group.big()  # the lanes are open
        refs = group._refs
        replies = backend.call_ranks(refs, "big", [()] * 2, [{}] * 2, label="big", blocking=True)
        later = list(group.after())
        start = time.monotonic()
        values = backend.gather([*replies, *later])
        assert time.monotonic() - start < 10
        assert [v.shape[0] for v in values[:2]] == [1 << 19] * 2 and values[2:] == [1, 1]
    finally:
        group.shutdown()
        backend.shutdown()
