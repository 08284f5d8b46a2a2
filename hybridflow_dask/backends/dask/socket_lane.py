"""A plain TCP socket between a driver's calling thread and a worker's instances.

A blocking call whose arguments hold no futures needs nothing from Dask on its way: not
the scheduler, not the worker's event loop. On the socket lane the calling thread writes
the call, a thread of the worker reads it and hands it to the instance's actor, and the
actor's thread writes the reply, which a reader thread of the driver hands to the
waiting caller. No event loop on either side, so no loop wake-ups and no cross-thread
hops beyond the one into the instance's own thread (about a third of a millisecond per
round trip here, against over a millisecond through the loops).

The lane is learned over the worker's Dask comm (its port and a random token the
connecting side must present first), so it is no more open than that comm. Clusters
whose comms are encrypted (``tls://``) or not TCP keep every call on the Dask comm.

When both ends share a host and may read each other's memory (checked as the lane
opens, see ``same_host``), large frames are not written to the socket at all: the reader
copies them out of the sender's memory, then sends ``release`` so that the sender may
drop (or change) them. A worker's instance waits for that, as it would wait for a
socket write to finish, so the next call cannot change a result still being copied.

Neither end ever waits to write while it should be reading: each side's reader only
reads and hands over (releases go out from a thread of their own, fetch replies from
the worker's fetch threads), so two large transfers in opposite directions, or a release
behind a large request, always make progress. Writes that make no progress for
``send_timeout`` seconds (the driver's ``hybridflow.call-timeout``; ``STALL_TIMEOUT_S``
on the worker) break the lane instead of blocking forever.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from distributed.comm.addressing import parse_address, parse_host_port

from .same_host import Probe, can_read, supported
from .wire import read_message, write_message

__all__ = ["Lane", "LaneServer", "lane_host"]

logger = logging.getLogger(__name__)

#: How long connecting to a lane (and presenting the token) may take.
CONNECT_TIMEOUT_S = 5.0
#: How long the worker's end waits for a write to progress, or for the driver to release
#: a reply's frames, before it drops the connection (a driver that stopped reading).
STALL_TIMEOUT_S = 60.0
TOKEN_BYTES = 16
_BUFFER = 1 << 16
# Opening a lane: the driver sends the token and where its memory holds a copy of it
# (process id and address; 0, 0 when it will not copy); the worker answers whether it
# could read that, and offers the same; the driver answers whether it could.
_OFFER = struct.Struct("!qQ")
_ANSWER = struct.Struct("!?qQ")
_YES = struct.Struct("!?")
_RELEASE = "release"


def _recv(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) != size:
        raise ConnectionError("the lane closed while opening")
    return data


def lane_host(address: str) -> str | None:
    """The host a worker at Dask ``address`` can offer a lane on, or ``None`` (not TCP)."""
    scheme, location = parse_address(address)
    if scheme != "tcp":
        return None
    return parse_host_port(location)[0]


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _bound_sends(sock: socket.socket, seconds: float | None) -> None:
    """A blocking send that makes no progress for ``seconds`` raises ``OSError``; reads
    on the same socket stay unbounded (an idle lane is not a broken one)."""
    if seconds:
        whole = int(seconds)
        timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class LaneServer:
    """The worker's end: accepts drivers' connections, one reader thread each.

    ``handle(msg, reply)`` is called in the connection's thread for every message;
    ``reply(answer)`` may be called from any thread, once, when the answer is ready.
    """

    def __init__(self, host: str, handle: Callable[[dict, Callable[[dict], None]], None]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self.port: int = self._listener.getsockname()[1]
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._probe = Probe(self.token) if supported() else None
        self._handle = handle
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="hybridflow-lane-accept", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for sock in [self._listener, *conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="hybridflow-lane", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        write_lock = threading.Lock()
        serving = threading.get_ident()
        held: dict[Any, list[Any]] = {}  # reply id -> [copied event, frames left in place]
        leave_in_place = False

        def reply(answer: dict) -> None:
            entry = held[answer["id"]] = [threading.Event(), None]
            try:
                with write_lock:
                    entry[1] = write_message(conn.sendall, answer, leave_in_place=leave_in_place)
            except OSError as exc:  # the driver went away (or stopped reading)
                logger.debug("lane reply not sent: %r", exc)
                _drop(conn)
            if not entry[1]:
                held.pop(answer["id"], None)
            elif threading.get_ident() != serving and not entry[0].wait(STALL_TIMEOUT_S):
                # (the serving thread reads releases: it never waits for one)
                logger.warning("a driver did not release a reply in %gs", STALL_TIMEOUT_S)
                _drop(conn)  # nobody copies it now: the instance goes on

        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            if not hmac.compare_digest(_recv(conn, TOKEN_BYTES), self.token):
                return
            pid, address = _OFFER.unpack(_recv(conn, _OFFER.size))
            pull_from = pid if can_read(pid, address, self.token) else None
            probe = self._probe if pid else None
            conn.sendall(
                _ANSWER.pack(
                    pull_from is not None, probe.pid if probe else 0, probe.address if probe else 0
                )
            )
            (leave_in_place,) = _YES.unpack(_recv(conn, _YES.size))
            conn.settimeout(None)
            _nodelay(conn)
            _bound_sends(conn, STALL_TIMEOUT_S)
            stream = conn.makefile("rb", buffering=_BUFFER)
            while True:
                msg, _ = read_message(stream, pull_from)
                if msg.get("op") == _RELEASE:
                    entry = held.pop(msg["id"], None)
                    if entry is not None:
                        entry[0].set()
                    continue
                try:
                    self._handle(msg, reply)
                except Exception as exc:  # a bug on our side: the caller still gets an answer
                    logger.exception("lane message %s failed", msg.get("id"))
                    error = RuntimeError(f"the worker could not take the call: {exc!r}")
                    reply({"id": msg.get("id"), "status": "error", "exception": error})
        except (EOFError, OSError):  # the driver closed, or this server did
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()
            for entry in list(held.values()):  # nobody will copy them now
                entry[0].set()
            held.clear()


def _drop(conn: socket.socket) -> None:
    """End a connection from any thread: its reader sees the end and cleans up."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class Lane:
    """The driver's end of one worker's lane: requests written by the calling thread,
    replies read by a thread of its own that settles each request's future.

    ``on_broken(pending)`` is called once, in the reader thread, with the requests still
    waiting when the connection ends (their worker died, or the lane was closed).
    ``same_host=False`` never copies frames between the processes' memories.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        on_reply: Callable[[Any, dict], None],
        on_broken: Callable[[list[Any]], None],
        same_host: bool = True,
        send_timeout: float | None = None,
    ) -> None:
        self._sock = _nodelay(socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S))
        try:
            self._leave_in_place, self._pull_from = self._open(token, same_host)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        _bound_sends(self._sock, send_timeout)
        self._on_reply, self._on_broken = on_reply, on_broken
        #: Replies copied out of the worker's memory, to release: the reader never writes.
        self._releases: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        # id -> (context, request): a request's frames may stay in our memory until the
        # worker has copied them, which it does before it answers.
        self._waiting: dict[int, tuple[Any, dict]] = {}
        self.broken = False
        self._reader = threading.Thread(target=self._read, name="hybridflow-lane", daemon=True)
        self._reader.start()
        if self._pull_from is not None:
            threading.Thread(
                target=self._release, name="hybridflow-lane-release", daemon=True
            ).start()

    def _open(self, token: bytes, same_host: bool) -> tuple[bool, int | None]:
        """Present the token; learn whether the worker copies from us and we from it."""
        probe = Probe(token) if same_host and supported() else None
        offer = _OFFER.pack(probe.pid, probe.address) if probe else _OFFER.pack(0, 0)
        self._sock.sendall(token + offer)
        copies, pid, address = _ANSWER.unpack(_recv(self._sock, _ANSWER.size))
        pull_from = pid if probe and can_read(pid, address, token) else None
        self._sock.sendall(_YES.pack(pull_from is not None))
        return copies, pull_from

    def request(self, msg: dict, context: Any) -> None:
        """Send ``msg``; its reply goes to ``on_reply(context, reply)``.

        Raises ``ConnectionError`` when the lane is already broken (nothing was sent).
        """
        with self._lock:
            if self.broken:
                raise ConnectionError("the lane is closed")
            ident = next(self._ids)
            self._waiting[ident] = (context, msg)
        msg["id"] = ident
        try:
            with self._write_lock:
                write_message(self._sock.sendall, msg, leave_in_place=self._leave_in_place)
        except OSError:
            self.close()  # the reader ends and reports this request with the others

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        try:
            stream = self._sock.makefile("rb", buffering=_BUFFER)
            while True:
                reply, copied = read_message(stream, self._pull_from)
                ident = reply.pop("id")
                if copied:  # the worker may drop them now
                    self._releases.put(ident)
                with self._lock:
                    waiting = self._waiting.pop(ident, None)
                if waiting is not None:
                    self._on_reply(waiting[0], reply)
        except (EOFError, OSError):
            pass
        except Exception:  # a reply that cannot be read: the lane is no longer usable
            logger.exception("lane to a worker failed")
        with self._lock:
            self.broken = True
            pending = [context for context, _ in self._waiting.values()]
            self._waiting = {}
        self._releases.put(None)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._on_broken(pending)

    def _release(self) -> None:
        """Send the releases the reader queued, in their own thread: a release may wait
        behind a large request being written, while the reader goes on reading."""
        while (ident := self._releases.get()) is not None:
            try:
                with self._write_lock:
                    write_message(self._sock.sendall, {"op": _RELEASE, "id": ident})
            except OSError:
                self.close()
                return
