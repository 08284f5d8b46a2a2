"""The socket lane: blocking direct calls from the calling thread to the instance's thread.

The framing is checked over a real socket pair; the lane itself on the session cluster
(real worker processes), with and without it, so the two ways of travelling cannot drift
apart. Killing a worker during a lane call is in ``test_failures``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import dask
import pytest
import torch
from call_paths import backend_on
from distributed.protocol.serialize import Serialized, serialize

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError
from hybridflow_dask.backends.dask.driver.lane import Lane
from hybridflow_dask.backends.dask.wire.lane_protocol import lane_host
from hybridflow_dask.backends.dask.wire.messages import Framed, read_message, unpack, write_message
from hybridflow_dask.backends.dask.worker.lane_server import LaneServer, _DataWaits


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


class Lanes(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def where(self):
        return os.getpid(), threading.current_thread().name

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail(self):
        raise KeyError("no such thing")

    @hf.register(hf.Dispatch.RANK_ZERO)
    def odd(self):
        return Unpicklable()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, value):
        return value

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_later(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})


# -- framing -------------------------------------------------------------------------------------


def _pair():
    a, b = socket.socketpair()
    return a, b, b.makefile("rb")


def test_a_message_with_frames_arrives_whole_and_deserializes():
    a, b, stream = _pair()
    tensor = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: written frame by frame
    msg = {"id": 7, "method": "m", "args": Serialized(*serialize((tensor,))), "small": None}
    writer = threading.Thread(target=write_message, args=(a.sendall, msg))
    writer.start()
    got, copied = read_message(stream)
    writer.join()
    assert got["id"] == 7 and got["small"] is None and not copied
    assert isinstance(got["args"], Framed)
    (back,) = unpack(got["args"])
    assert torch.equal(back, tensor)
    a.close(), b.close()


def test_a_stream_ending_mid_message_is_an_eof_error():
    a, b, stream = _pair()
    chunks = []
    write_message(chunks.append, {"id": 1, "args": Serialized(*serialize(b"x" * 100_000))})
    a.sendall(b"".join(bytes(c) for c in chunks)[:5000])
    a.close()
    with pytest.raises(EOFError):
        read_message(stream)
    b.close()


def test_tcp_and_tls_workers_offer_a_lane():
    assert lane_host("tcp://127.0.0.1:8786") == "127.0.0.1"
    assert lane_host("tcp://[::1]:8786") == "::1"
    assert lane_host("tls://127.0.0.1:8786") == "127.0.0.1"  # its lane runs TLS
    assert lane_host("inproc://10.0.0.1/1/2") is None


def test_a_connection_without_the_token_is_closed_unanswered():
    handled = []
    server = LaneServer("127.0.0.1", lambda msg, reply: handled.append(msg))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            assert len(sock.recv(16, socket.MSG_WAITALL)) == 16  # the server's challenge
            sock.sendall(b"0" * 72)  # a claim that proves no token, and no memory offer
            # closed by the server: a message sent now meets a reset or a broken pipe,
            # and the stream ends (or is reset: our message was left unread)
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                write_message(sock.sendall, {"id": 1})
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
        assert handled == []
        replies = threading.Event()
        lane = Lane(
            "127.0.0.1",
            server.port,
            server.token_for("test-driver"),
            on_reply=lambda ctx, reply: replies.set(),
            on_broken=lambda pending: None,
        )
        lane.request({"n": 1}, "ctx")
        for _ in range(100):
            if handled:
                break
            threading.Event().wait(0.05)
        assert handled and handled[0]["n"] == 1
        lane.close()
    finally:
        server.close()


def test_a_local_socket_this_process_cannot_reach_falls_back_to_tcp():
    """A worker's local socket is only reachable in its own network namespace: a driver
    elsewhere (another machine, another namespace) connects over TCP instead."""
    replies: list = []
    server = LaneServer("127.0.0.1", lambda msg, reply: reply({"id": msg["id"], "n": msg["n"]}))
    try:
        assert server.local_name is not None  # Linux: the server offers one
        for local, family in [
            (server.local_name, socket.AF_UNIX),
            ("\0hybridflow-lane-nobody-listens-here", socket.AF_INET),
        ]:
            got = threading.Event()
            lane = Lane(
                "127.0.0.1",
                server.port,
                server.token_for("test-driver"),
                on_reply=lambda ctx, reply, got=got: (replies.append(reply["n"]), got.set()),
                on_broken=lambda pending: None,
                local=local,
            )
            try:
                assert lane._raw.family == family
                lane.request({"n": family}, "ctx")
                assert got.wait(5), f"no reply over {family!r}"
            finally:
                lane.close()
        assert replies == [socket.AF_UNIX, socket.AF_INET]
    finally:
        server.close()


# -- on real workers, with and without the lane ---------------------------------------------


@pytest.fixture(scope="module", params=["lane", "comm"])
def lanes(request, hf_dask_cluster):
    with dask.config.set({"hybridflow.socket-lane": request.param == "lane"}):
        backend = DaskBackend(cluster=hf_dask_cluster)
    group = hf.WorkerGroup(hf.ResourcePool([2]), Lanes, backend=backend)
    yield request.param, backend, group
    group.shutdown()
    backend.shutdown()


def test_blocking_calls_take_the_lane_only_where_it_is_on(lanes):
    path, backend, group = lanes
    pids = [pid for pid, _ in group.where()]
    assert len(set(pids)) == 2
    opened = [lane for lane in (backend._direct._lanes or {}).values() if lane is not None]
    assert len(opened) == (2 if path == "lane" else 0)


def test_lanes_to_workers_of_the_drivers_own_network_namespace_use_the_local_socket(lanes):
    path, backend, group = lanes
    group.where()
    opened = [lane for lane in (backend._direct._lanes or {}).values() if lane is not None]
    families = [lane._raw.family for lane in opened]
    assert families == ([socket.AF_UNIX] * 2 if path == "lane" else [])


def test_the_method_runs_in_the_instance_thread_either_way(lanes):
    _, _, group = lanes
    threads = [name for _, name in group.where()]
    assert all(name.startswith("hf-") for name in threads), threads


def test_data_and_errors_come_back_the_same_either_way(lanes):
    _, _, group = lanes
    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    out = group.double(hf.DataProto.from_dict({"x": x}))
    assert torch.equal(out.batch["x"], x * 2)
    with pytest.raises(KeyError, match="no such thing") as info:
        group.fail()
    assert "fail" in "".join(getattr(info.value, "__notes__", []))


def test_a_result_that_cannot_travel_is_a_type_error_and_the_instance_goes_on(lanes):
    _, _, group = lanes
    with pytest.raises(TypeError, match="odd"):
        group.odd()
    assert len(group.where()) == 2


def test_a_plain_result_of_a_non_blocking_call_comes_back_with_its_reply(lanes):
    _, backend, group = lanes
    futures = group.later(41)
    # The replies travel on the workers' streams, apart from the scheduler's word that the
    # futures are done, so they may arrive a moment after a gather could return.
    deadline = time.monotonic() + 5
    plain = [backend._direct.plain_result(f, "fetch") for f in futures]
    while "fetch" in plain and time.monotonic() < deadline:
        time.sleep(0.01)
        plain = [backend._direct.plain_result(f, "fetch") for f in futures]
    assert plain == [41, 41]
    assert backend.gather(futures) == [41, 41]
    tensors = group.later(torch.ones(3))  # not plain: fetched from the workers
    assert [backend._direct.plain_result(f, "fetch") for f in tensors] == ["fetch", "fetch"]
    assert all(torch.equal(t, torch.ones(3)) for t in backend.gather(tensors))


def test_the_driver_counts_the_bytes_it_sends_and_receives_either_way(lanes):
    _, backend, group = lanes
    x = torch.ones(64, 256)  # 64 KiB: half to each rank, and back
    sent, got = backend.driver_bytes["scattered"], backend.driver_bytes["gathered"]
    group.double(hf.DataProto.from_dict({"x": x}))
    # each rank's half once (and a header), not the whole batch beside each half
    assert x.nbytes <= backend.driver_bytes["scattered"] - sent < 1.25 * x.nbytes
    assert x.nbytes <= backend.driver_bytes["gathered"] - got < 1.25 * x.nbytes


class Queue(hf.Worker):
    def __init__(self):
        super().__init__()
        self.ran: list[str] = []

    @hf.register(hf.Dispatch.RANK_ZERO)
    def hold(self, name: str, seconds: float) -> list[str]:
        time.sleep(seconds)
        self.ran.append(name)
        return self.ran


def test_a_lane_cut_while_its_worker_lives_fails_the_waiting_calls_and_skips_them(
    hf_dask_cluster,
):
    """Calls in flight on a lane that breaks (the worker stays up) fail with
    WorkerLostError saying the worker is alive; one still waiting its turn there does not
    run, and the next call does not wait behind it."""
    with dask.config.set({"hybridflow.socket-lane": True}):
        backend = DaskBackend(cluster=hf_dask_cluster)
    group = hf.WorkerGroup(hf.ResourcePool([1]), Queue, backend=backend)
    try:
        assert group.hold("warm", 0) == ["warm"]
        outcomes: dict[str, BaseException | list] = {}

        def call(name: str, seconds: float) -> None:
            try:
                outcomes[name] = group.hold(name, seconds)
            except BaseException as exc:
                outcomes[name] = exc

        # "first" outlasts the wait for the scheduler's word on the worker (2 s), so the
        # skip reaches the worker while "second" still waits there
        first = threading.Thread(target=call, args=("first", 3.5))
        first.start()
        time.sleep(0.3)  # "first" runs; "second" will wait behind it
        second = threading.Thread(target=call, args=("second", 0))
        second.start()
        time.sleep(0.3)
        (lane,) = [lane for lane in backend._direct._lanes.values() if lane is not None]
        lane.close()  # the connection breaks; the worker process is untouched
        first.join(10)
        second.join(10)
        for name in ("first", "second"):
            assert isinstance(outcomes[name], WorkerLostError), outcomes
            assert "the worker is alive" in str(outcomes[name])
        start = time.monotonic()
        ran = group.hold("third", 0)  # a new lane; waits only for "first" to end
        assert time.monotonic() - start < 5
        assert ran == ["warm", "first", "third"]  # "second" was skipped, not run late
    finally:
        group.shutdown()
        backend.shutdown()


@pytest.fixture
def lane_ops(monkeypatch):
    """The ``op`` of every message the driver writes on a lane (``None`` for a call)."""
    ops: list[str | None] = []
    request = Lane.request

    def spy(self, msg, context, **options):
        ops.append(msg.get("op"))
        return request(self, msg, context, **options)

    monkeypatch.setattr(Lane, "request", spy)
    return ops


def test_results_kept_on_workers_are_fetched_on_the_lane_where_there_is_one(lanes, lane_ops):
    path, _, group = lanes
    x = torch.arange(32768, dtype=torch.float32).reshape(128, 256)  # above hold-threshold
    future = group.double_later(hf.DataProto.from_dict({"x": x}))
    assert lane_ops == []  # a non-blocking call goes through the loop's stream
    out = hf.get(future)
    assert torch.equal(out.batch["x"], x * 2)
    assert lane_ops == (["fetch", "fetch"] if path == "lane" else [])


def test_a_result_its_lane_worker_does_not_hold_is_gathered_by_dask(lanes, lane_ops, monkeypatch):
    """The driver asks the wrong worker (as if the key had moved): that worker answers
    without it, and Dask's gather brings it."""
    path, backend, group = lanes
    future = group.double_later(hf.DataProto.from_dict({"x": torch.ones(64, 512)}))
    parts = future.parts
    backend.gather(parts[:0])  # nothing: no message at all
    assert lane_ops == []
    placed = [backend._live.placed(part) for part in parts]
    swapped = dict(zip([p.key for p in parts], reversed(placed)))
    monkeypatch.setattr(backend._live, "placed", lambda future: swapped.get(future.key))
    halves = backend.gather(parts)
    assert [torch.equal(h.batch["x"], torch.full((32, 512), 2.0)) for h in halves] == [
        True,
        True,
    ]
    assert lane_ops == (["fetch", "fetch"] if path == "lane" else [])


def test_the_drivers_reader_goes_on_reading_while_a_caller_holds_the_write_lock():
    """The reader never writes: a release it owes waits for the lock in a thread of its
    own, so replies keep arriving while a caller is stuck writing a large request (that
    reader blocking on the lock was one edge of a deadlock between driver threads)."""
    go = threading.Event()

    def handle(msg, reply):
        def answer():
            go.wait(10)
            payload = Serialized(*serialize(torch.ones(1 << 19)))  # 2 MiB: left in place
            reply({"id": msg["id"], "status": "OK", "result": payload})

        threading.Thread(target=answer, daemon=True).start()

    server = LaneServer("127.0.0.1", handle)
    replies: list[int] = []
    lane = Lane(
        "127.0.0.1",
        server.port,
        server.token_for("test-driver"),
        on_reply=lambda ctx, reply: replies.append(ctx),
        on_broken=lambda pending: None,
    )
    try:
        assert lane._pull_from is not None  # same host: the reply frames are copied
        lane.request({"n": 1}, 1)
        lane.request({"n": 2}, 2)
        with lane._write_lock:  # a caller writing a large request holds it
            go.set()
            deadline = time.monotonic() + 5
            while len(replies) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sorted(replies) == [1, 2]
    finally:
        lane.close()
        server.close()


def test_a_driver_turned_away_from_a_lane_asks_again_later(hf_dask_cluster, monkeypatch):
    from hybridflow_dask.backends.dask.driver import direct_path

    monkeypatch.setattr(direct_path, "LANE_RETRY_S", 0.3)
    with backend_on("lane", hf_dask_cluster) as backend:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Lanes, backend=backend)
        path = backend._direct
        real = path._open_lane
        turned_away: list[str] = []

        def busy_once(slot):
            if not turned_away:
                turned_away.append(slot.address)
                raise ConnectionError("too many connections opening at once")
            return real(slot)

        monkeypatch.setattr(path, "_open_lane", busy_once)
        assert group.where()  # on the Dask comm: the lane turned it away
        assert turned_away and not [x for x in path._lanes.values() if isinstance(x, Lane)]
        time.sleep(0.4)
        assert group.where()  # asked again: the lane carries it now
        assert [x for x in path._lanes.values() if isinstance(x, Lane)]
        group.shutdown()


def _voluntary_switches(thread: int) -> int:
    with open(f"/proc/self/task/{thread}/status") as status:
        return int(status.read().split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_a_lane_reader_waiting_for_a_call_sleeps_while_the_driver_reads_replies():
    """A thread blocked in a unix socket's ``recv`` is woken, for nothing, each time the
    peer reads what its end wrote (a plain ``recv_into`` here: ~20 wake-ups for the 20
    replies below); the worker's lane reader waits in ``poll`` instead, so the driver
    reading replies does not wake it while it waits for the next call."""
    worker_end, driver_end = socket.socketpair()
    got = bytearray(16)
    started: list[int] = []

    def wait_for_a_call() -> None:
        started.append(threading.get_native_id())
        _DataWaits(worker_end).readinto(got)

    thread = threading.Thread(target=wait_for_a_call)
    thread.start()
    try:
        while not started:
            time.sleep(0.01)
        time.sleep(0.2)  # asleep in its wait
        before = _voluntary_switches(started[0])
        for _ in range(20):  # replies the worker's end wrote, read by the driver's
            worker_end.sendall(b"reply")
            driver_end.recv(64)
            time.sleep(0.005)
        woken = _voluntary_switches(started[0]) - before
        driver_end.sendall(b"call")
        thread.join(5)
        assert bytes(got[:4]) == b"call"
        assert woken <= 3
    finally:
        worker_end.close()
        driver_end.close()
