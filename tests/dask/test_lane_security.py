"""The socket lane against strangers, confused peers and malformed frames (loopback only).

Opening a lane is a challenge-response on fresh nonces with a token of the driver's own,
so nothing seen on one connection opens another; a same-host copy needs the peer's own
memory to hold this connection's proof; every message is bounded before memory is taken;
and whatever a peer sends, the worker's end stays up, drops that peer and serves others.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from distributed.protocol.serialize import Serialized, serialize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow_dask.backends.dask.driver.lane import Lane
from hybridflow_dask.backends.dask.wire.messages import LaneLimits, write_message
from hybridflow_dask.backends.dask.worker.lane_server import LaneServer
from hybridflow_dask.errors import LaneRefused

pytestmark = pytest.mark.timeout(120)


def _echo(msg, reply):
    threading.Thread(
        target=reply, args=({"id": msg["id"], "status": "OK", "n": msg.get("n")},)
    ).start()


@contextlib.contextmanager
def _server(**options):
    server = LaneServer("127.0.0.1", _echo, **options)
    try:
        yield server
    finally:
        server.close()


def _lane(server, driver="driver-a", **options):
    replies: list = []
    broken: list = []
    lane = Lane(
        "127.0.0.1",
        server.port,
        server.token_for(driver),
        on_reply=lambda ctx, reply: replies.append(reply),
        on_broken=broken.append,
        **options,
    )
    return lane, replies, broken


def _served(server, driver="driver-a") -> bool:
    """Whether a proper driver still gets an answer on a new lane."""
    lane, replies, _ = _lane(server, driver)
    try:
        lane.request({"op": "call", "n": 7}, None)
        deadline = time.monotonic() + 5
        while not replies and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(replies) and replies[0]["n"] == 7
    finally:
        lane.close()


def _proof(token: bytes, purpose: bytes, sn: bytes, cn: bytes) -> bytes:
    return hmac.new(token, purpose + sn + cn, hashlib.sha256).digest()


def _claim(sock, token_id: bytes, token: bytes, cn: bytes, where=(0, 0)) -> bytes:
    """Open a lane by hand: read the challenge, send a claim; the bytes sent."""
    sn = sock.recv(16, socket.MSG_WAITALL)
    sent = token_id + cn + _proof(token, b"driver", sn, cn) + struct.pack("!qQ", *where)
    sock.sendall(sent)
    return sent


def _closed(sock) -> bool:
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _answered(sock) -> bool:
    """Whether the worker's end proved the token back (it answers a valid claim)."""
    sock.settimeout(5)
    return len(sock.recv(33 + 16, socket.MSG_WAITALL)) == 49


def test_every_driver_gets_a_token_of_its_own():
    with _server() as server:
        a, b = server.token_for("driver-a"), server.token_for("driver-b")
        assert a != b and server.token_for("driver-a") == a
        assert _served(server, "driver-a") and _served(server, "driver-b")


def test_a_claim_seen_once_cannot_be_replayed_on_another_connection():
    with _server() as server:
        token_id, token = server.token_for("driver-a")
        cn = os.urandom(16)
        with socket.create_connection(("127.0.0.1", server.port)) as first:
            seen = _claim(first, token_id, token, cn)
            assert _answered(first)
        with socket.create_connection(("127.0.0.1", server.port)) as second:
            second.recv(16, socket.MSG_WAITALL)  # a new challenge
            second.sendall(seen)  # the eavesdropped bytes
            assert _closed(second)
        assert _served(server)


def test_a_token_from_another_worker_does_not_open_a_lane():
    with _server() as server, _server() as other:
        with pytest.raises(LaneRefused):
            Lane(
                "127.0.0.1",
                server.port,
                other.token_for("driver-a"),
                on_reply=lambda *_: None,
                on_broken=lambda _: None,
            )
        assert _served(server)


def test_the_worker_must_prove_the_token_too():
    """A stranger listening where the driver expects a worker learns nothing and is refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(os.urandom(16))
            conn.recv(72, socket.MSG_WAITALL)
            conn.sendall(os.urandom(33) + struct.pack("!qQ", 0, 0))
            time.sleep(1)

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(LaneRefused, match="did not prove"):
        Lane("127.0.0.1", port, (b"i" * 8, b"t" * 32), lambda *_: None, lambda _: None)
    listener.close()


@pytest.mark.cluster
def test_another_local_process_cannot_be_named_as_the_peer_to_copy_from():
    """The claim proves the token but names another process's memory (which holds the
    token itself): the worker refuses to copy from it, and refuses frames left there."""
    with _server() as server:
        token_id, token = server.token_for("driver-a")
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import ctypes, sys, time\n"
                f"b = ctypes.create_string_buffer({token!r}, {len(token)})\n"
                "print(ctypes.addressof(b), flush=True)\ntime.sleep(60)\n",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            address = int(holder.stdout.readline())
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                _claim(sock, token_id, token, os.urandom(16), where=(holder.pid, address))
                sock.settimeout(5)
                answer = sock.recv(33 + 16, socket.MSG_WAITALL)
                assert answer[32] == 0  # "I will not copy from you"
                sock.sendall(b"\x00")
                chunks: list = []
                big = Serialized(*serialize(torch.ones(1 << 19)))
                write_message(chunks.append, {"id": 1, "args": big}, leave_in_place=True)
                sock.sendall(b"".join(bytes(c) for c in chunks))
                assert _closed(sock)
            assert _served(server)
        finally:
            holder.kill()
            holder.wait()


def test_connections_that_never_open_are_capped_and_others_still_get_in():
    with _server(max_handshakes=2) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        try:
            time.sleep(0.2)
            refused = 0
            for sock in idle[2:]:
                sock.settimeout(1)
                with contextlib.suppress(OSError):
                    sock.recv(16, socket.MSG_WAITALL)
                    if sock.recv(1) == b"":
                        refused += 1
            assert refused == 4
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert _served(server)


def test_the_accept_loop_outlives_transient_errors():
    with _server() as server:
        real = server._listeners[0]  # the TCP one
        failures = iter([OSError(24, "Too many open files")] * 3)

        class Flaky:
            def accept(self):
                failure = next(failures, None)
                if failure is not None:
                    raise failure
                return real.accept()

            def __getattr__(self, name):  # shutdown(), close() at the end
                return getattr(real, name)

        server._listeners[0] = Flaky()  # what the accept loop calls next time
        # The loop is blocked in the real accept now: the first connection goes through,
        # the next accepts fail three times, then the loop accepts again.
        assert _served(server) and _served(server)


def test_a_message_declaring_more_than_the_limits_drops_that_peer_only():
    with _server(limits=LaneLimits(max_message_bytes=1 << 20, max_frames=4)) as server:
        lane, _, broken = _lane(server)
        head = struct.pack("!QI", 10, 1) + struct.pack("!Q", 4 << 30)  # a 4 GiB frame
        with lane._write_lock:
            lane._sock.sendall(head)
        deadline = time.monotonic() + 5
        while not broken and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broken, "the worker kept a peer that declared a 4 GiB frame"
        assert _served(server)


def test_a_message_that_stalls_half_way_is_dropped_after_the_stall_timeout():
    with _server(stall_s=1.0) as server:
        lane, _, broken = _lane(server)
        with lane._write_lock:
            lane._sock.sendall(struct.pack("!QI", 1000, 0) + b"\x80")  # then nothing
        deadline = time.monotonic() + 5
        while not broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broken
        assert _served(server)


def test_a_reply_the_driver_never_releases_does_not_wedge_the_instance():
    released = threading.Event()

    def handle(msg, reply):
        def answer():
            reply({"id": msg["id"], "result": Serialized(*serialize(torch.ones(1 << 19)))})
            released.set()  # reply() returned: the instance may go on

        threading.Thread(target=answer, daemon=True).start()

    server = LaneServer("127.0.0.1", handle, stall_s=1.0)
    try:
        lane, _, broken = _lane(server)
        assert lane._pull_from is not None  # the reply's 2 MiB frame is left in place
        lane._releases = types.SimpleNamespace(put=lambda ident: None)  # never releases
        lane.request({"op": "call"}, None)
        assert released.wait(5)
        deadline = time.monotonic() + 5
        while not broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broken  # and the connection was dropped
    finally:
        server.close()


_junk = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda n, c: struct.pack("!QI", n, c), st.integers(0, 2**40), st.integers(0, 2**20)),
    st.builds(
        lambda obj: (lambda body: struct.pack("!QI", len(body), 0) + body)(
            __import__("pickle").dumps(obj)
        ),
        st.one_of(st.integers(), st.text(), st.lists(st.integers()), st.just({"op": "release"})),
    ),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chunks=st.lists(_junk, min_size=1, max_size=4), close_early=st.booleans())
def test_whatever_a_proven_peer_sends_the_worker_stays_up_and_serves_others(
    lane_server, chunks, close_early
):
    lane, _, _ = _lane(lane_server, driver="fuzzer")
    with contextlib.suppress(OSError), lane._write_lock:
        for chunk in chunks:
            lane._sock.sendall(chunk)
        if close_early:
            lane._sock.shutdown(socket.SHUT_WR)
    lane.close()
    assert _served(lane_server, "a-proper-driver")


@settings(max_examples=30, deadline=None)
@given(chunks=st.lists(_junk, min_size=1, max_size=4))
def test_whatever_a_worker_end_sends_back_the_driver_end_closes_cleanly(chunks):
    """A peer posing as a worker after a valid opening: the driver's reader ends, reports
    its pending requests broken, and nothing escapes into the process."""
    with _server() as server:
        lane, _, broken = _lane(server)
        pending = object()
        with lane._lock:
            lane._waiting[999] = (pending, {})
        conn = next(iter(server._conns))
        with contextlib.suppress(OSError):
            for chunk in chunks:
                conn.sendall(chunk)
            conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        while not broken and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broken and pending in broken[0]


@pytest.fixture(scope="module")
def lane_server():
    with _server(stall_s=2.0, limits=LaneLimits(max_message_bytes=64 << 20)) as server:
        yield server


def test_a_token_just_handed_out_survives_a_flood_of_requests_with_new_driver_ids():
    from hybridflow_dask.backends.dask.worker.lane_server import MAX_TOKENS

    with _server() as server:
        offered = server.token_for("driver-a")  # the driver is about to open its lane
        for i in range(MAX_TOKENS + 10):  # what anyone reaching the comm may ask for
            server.token_for(f"flood-{i}")
        lane = Lane("127.0.0.1", server.port, offered, lambda *_: None, lambda *_: None)
        lane.close()  # it opened with the token it was given


def test_a_token_with_a_lane_open_outlives_idle_ones(monkeypatch):
    from hybridflow_dask.backends.dask.worker import lane_server

    monkeypatch.setattr(lane_server, "TOKEN_SETTLE_S", 0.0)  # every token settled at once
    with _server() as server:
        live = server.token_for("driver-live")
        lane, _, _ = _lane(server, "driver-live")  # open on its token
        assert _served(server, "driver-live")  # (and the worker's end is serving it)
        idle = server.token_for("driver-idle")
        try:
            for i in range(lane_server.MAX_TOKENS + 10):
                server.token_for(f"flood-{i}")
            assert server.token_for("driver-live") == live, "a live driver's token went"
            assert server.token_for("driver-idle") != idle, "idle tokens must go first"
        finally:
            lane.close()
