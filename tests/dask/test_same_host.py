"""Large frames copied between two processes' memories instead of through the socket.

The copy itself, the trust check (a peer's memory must hold the lane's secret) and the
release rule run on a real socket pair and a real second process; the lane on the session
cluster's worker processes, with the copy on and off.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading

import dask
import numpy
import pytest
import torch
from distributed.protocol.serialize import Serialized, serialize

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver.lane import Lane
from hybridflow_dask.backends.dask.wire.messages import (
    LEAVE_MIN,
    ProtocolError,
    read_message,
    unpack,
    write_message,
)
from hybridflow_dask.backends.dask.wire.same_host import Probe, can_read, pull, supported
from hybridflow_dask.backends.dask.worker.lane_server import LaneServer

pytestmark = pytest.mark.skipif(not supported(), reason="process_vm_readv is Linux-only")

MiB = 1 << 20


def _message(*values):
    return {"id": 3, "args": Serialized(*serialize(values))}


def test_a_large_frame_stays_in_the_senders_memory_and_the_reader_copies_it():
    large = torch.arange(2 * MiB // 4, dtype=torch.float32)  # 2 MiB
    small = torch.arange(1000, dtype=torch.int64)
    chunks: list = []
    left = write_message(chunks.append, _message(large, small), leave_in_place=True)
    written = sum(memoryview(c).nbytes for c in chunks)
    assert [memoryview(f).nbytes for f in left] == [large.nbytes]
    assert written < 64 * 1024  # the small tensor and an address, not the 2 MiB
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(c) for c in chunks))
        msg, copied = read_message(b.makefile("rb"), pull_from=os.getpid())
    assert copied
    got_large, got_small = unpack(msg["args"])
    assert torch.equal(got_large, large) and torch.equal(got_small, small)
    assert got_large.data_ptr() != large.data_ptr()  # a copy, not the sender's memory


def test_a_call_past_its_deadline_is_read_without_touching_the_senders_memory():
    import time

    large = torch.arange(2 * MiB // 4, dtype=torch.float32)
    chunks: list = []
    late = {**_message(large), "deadline": time.time() - 1.0}  # its driver has given up
    write_message(chunks.append, late, leave_in_place=True)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(c) for c in chunks))
        msg, copied = read_message(b.makefile("rb"), pull_from=os.getpid())
    assert not copied and msg["args"].frames == [None]  # nothing read from the sender
    on_time = {**_message(large), "deadline": time.time() + 60.0}
    chunks.clear()
    write_message(chunks.append, on_time, leave_in_place=True)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(c) for c in chunks))
        msg, copied = read_message(b.makefile("rb"), pull_from=os.getpid())
    assert copied and torch.equal(unpack(msg["args"])[0], large)


def test_without_leave_in_place_every_byte_is_written():
    large = torch.ones(2 * MiB // 4)
    chunks: list = []
    assert write_message(chunks.append, _message(large), leave_in_place=False) == []
    assert sum(memoryview(c).nbytes for c in chunks) > large.nbytes


def test_frames_under_the_threshold_are_written_even_when_the_reader_could_copy():
    chunks: list = []
    tensor = torch.ones(LEAVE_MIN // 4 - 1024)
    assert write_message(chunks.append, _message(tensor), leave_in_place=True) == []


def test_a_reader_that_cannot_copy_refuses_a_frame_left_in_place():
    chunks: list = []
    write_message(chunks.append, _message(torch.ones(2 * MiB // 4)), leave_in_place=True)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(c) for c in chunks))
        with pytest.raises(ProtocolError, match="left in the sender's memory"):
            read_message(b.makefile("rb"), pull_from=None)


@pytest.mark.cluster
def test_another_process_is_trusted_only_when_its_memory_holds_the_secret():
    secret = os.urandom(16)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys
                from hybridflow_dask.backends.dask.wire.same_host import Probe
                probe = Probe(bytes.fromhex(sys.argv[1]))
                print(probe.pid, probe.address, flush=True)
                sys.stdin.read()
                """
            ),
            secret.hex(),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, address = map(int, holder.stdout.readline().split())
        assert pid == holder.pid
        assert can_read(pid, address, secret)
        assert not can_read(pid, address, os.urandom(16))  # not the peer's secret
        assert pull(pid, address, numpy.empty(16, numpy.uint8)).tobytes() == secret
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not can_read(pid, address, secret)  # it has ended
    assert not can_read(0, address, secret)  # the peer declined


def test_a_probe_is_readable_in_this_process():
    probe = Probe(b"s" * 16)
    assert can_read(probe.pid, probe.address, b"s" * 16)


# -- the lane's opening and the release rule, in one process -----------------------------------


def _lane_pair(handle, same_host=True):
    server = LaneServer("127.0.0.1", handle)
    replies: list = []
    got = threading.Event()

    def on_reply(ctx, reply):
        replies.append(reply)
        got.set()

    lane = Lane(
        "127.0.0.1",
        server.port,
        server.token_for("test-driver"),
        on_reply,
        lambda p: None,
        same_host,
    )
    return server, lane, replies, got


def test_both_ends_copy_only_where_the_driver_allows_it():
    for same_host in (True, False):
        server, lane, _, _ = _lane_pair(lambda msg, reply: None, same_host)
        try:
            assert lane._leave_in_place is same_host
            assert (lane._pull_from is not None) is same_host
        finally:
            lane.close()
            server.close()


def test_a_sender_keeps_its_result_unchanged_until_the_reader_has_copied_it():
    """The worker's reply returns only after the driver says it has copied the frames, so
    the instance cannot change a result it returned (here at once) while it is copied."""
    state = torch.zeros(64 * MiB // 4)
    received_args = []

    def handle(msg, reply):
        received_args.append(unpack(msg["args"]))

        def answer():
            reply({"id": msg["id"], "status": "OK", "result": Serialized(*serialize(state))})
            for value in range(1, 30):  # the instance's next calls change it in place
                state.fill_(-value)

        threading.Thread(target=answer).start()

    server, lane, replies, got = _lane_pair(handle)
    try:
        sent = torch.arange(2 * MiB // 4, dtype=torch.float32)
        lane.request(_message(sent), "ctx")
        assert got.wait(10)
        assert torch.equal(received_args[0][0], sent)  # the worker copied the argument
        result = unpack(replies[0]["result"])
        assert torch.equal(result, torch.zeros_like(result))
    finally:
        lane.close()
        server.close()


# -- on the cluster's worker processes ----------------------------------------------------------


class Twice(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def twice(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "socket"])
def test_large_calls_on_worker_processes_copy_between_memories_only_when_on(hf_dask_cluster, copy):
    with dask.config.set({"hybridflow.same-host-copy": copy}):
        backend = DaskBackend(cluster=hf_dask_cluster)
    try:
        with hf.WorkerGroup(hf.ResourcePool([2]), Twice, backend=backend) as group:
            x = torch.randn(256, 8192)  # 8 MiB: 4 MiB to each rank and back
            out = group.twice(hf.DataProto.from_dict({"x": x}))
            assert torch.equal(out.batch["x"], x * 2)
            lanes = [lane for lane in backend._direct._lanes.values() if lane is not None]
            assert len(lanes) == 2
            assert all(lane._leave_in_place is copy for lane in lanes)
            assert all((lane._pull_from is not None) is copy for lane in lanes)
    finally:
        backend.shutdown()
