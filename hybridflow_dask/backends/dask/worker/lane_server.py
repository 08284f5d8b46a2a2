"""The worker's end of the socket lane: accepts drivers' connections, one reader each.

See ``driver.lane`` for what the lane is for and ``wire.lane_protocol`` for how it opens.
Each connection's thread only reads and hands messages over: replies are written by the
instance's thread (or a fetch thread) that has them, so the reader is always free to take
the driver's next message or a ``release``.

A stranger gets little: at most ``max_handshakes`` connections are opening at once (each
for at most ``CONNECT_TIMEOUT_S``, with nothing unpickled before the token is proven),
every message is bounded before memory is taken for it (``LaneLimits``), a message
started must arrive whole within ``STALL_TIMEOUT_S``, and a peer that breaks any of it
is dropped and logged once by address. The accept loop outlives transient errors (no
file descriptors left, say), backing off, and ends only when the server closes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import select
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from ....errors import LaneRefused, ProtocolError
from ..wire.lane_protocol import (
    BUFFER,
    CONNECT_TIMEOUT_S,
    RELEASE,
    STALL_TIMEOUT_S,
    bound_sends,
    drop,
    local_listener,
    new_token,
    nodelay,
    open_as_worker,
)
from ..wire.messages import LaneLimits, may_have_frames, read_message, write_message
from ..wire.tls import TLSChannel

__all__ = ["LaneServer"]

logger = logging.getLogger(__name__)

#: Tokens kept, one per driver that asked (the oldest is forgotten first).
MAX_TOKENS = 1024
#: The table may grow to this many while newer tokens are still within their handshake
#: window; past it the oldest go whatever their age (a flood of requests).
HARD_MAX_TOKENS = 4 * MAX_TOKENS
#: How long a token just handed out is kept whatever else is asked for: its driver may be
#: opening its lane with it.
TOKEN_SETTLE_S = CONNECT_TIMEOUT_S
#: Connections allowed to be opening at once.
MAX_HANDSHAKES = 16
#: The longest the accept loop waits after an error before it tries again.
MAX_BACKOFF_S = 1.0
#: How often the watchdog looks for messages that stalled half-way.
WATCH_S = 0.5


class LaneServer:
    """The worker's end: accepts drivers' connections, one reader thread each.

    ``handle(msg, reply)`` is called in the connection's thread for every message;
    ``reply(answer)`` may be called from any thread, once, when the answer is ready.
    """

    def __init__(
        self,
        host: str,
        handle: Callable[[dict, Callable[[dict], None]], None],
        *,
        limits: LaneLimits | None = None,
        stall_s: float = STALL_TIMEOUT_S,
        max_handshakes: int = MAX_HANDSHAKES,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family)
        self.port: int = listener.getsockname()[1]
        self._listeners = [listener]
        #: The name of the local socket drivers of this machine's namespace may use
        #: instead (``None``: none; a TLS cluster's lanes are TCP only).
        self.local_name: str | None = None
        local = local_listener() if tls is None else None
        if local is not None:
            self._listeners.append(local[0])
            self.local_name = local[1]
        self._tokens: OrderedDict[bytes, bytes] = OrderedDict()
        self._by_driver: dict[str, bytes] = {}
        #: Tokens with a lane open on them: never pushed out by others' requests.
        self._in_use: Counter[bytes] = Counter()
        #: When each token was handed out (``time.monotonic()``).
        self._issued: dict[bytes, float] = {}
        self._handle = handle
        #: The worker's server context on a TLS cluster: every lane runs TLS, both ends
        #: showing the cluster's certificates.
        self._tls = tls
        self._limits = limits or LaneLimits()
        self._stall_s = stall_s
        self._opening = threading.BoundedSemaphore(max_handshakes)
        self._conns: set[socket.socket] = set()
        #: connection -> when the message it is reading must be whole (mid-message only).
        self._deadlines: dict[socket.socket, float] = {}
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        for index in range(len(self._listeners)):
            threading.Thread(
                target=self._accept, args=(index,), name="hybridflow-lane-accept", daemon=True
            ).start()
        threading.Thread(target=self._watch, name="hybridflow-lane-watch", daemon=True).start()

    def token_for(self, driver: str) -> tuple[bytes, bytes]:
        """The token (id, secret) a driver presents when it opens lanes here; its own.

        About ``MAX_TOKENS`` are kept, the least recently asked for going first, but never
        one with a lane open on it, nor one handed out less than ``TOKEN_SETTLE_S`` ago
        (its driver may be opening its lane with it now): requests with ever new driver
        ids, which anyone who reaches the worker's comm may send, cannot push out a live
        driver's token, unless they come faster than ``HARD_MAX_TOKENS`` per handshake
        window (and a driver turned away asks again later).
        """
        with self._lock:
            now = time.monotonic()
            token_id = self._by_driver.get(driver)
            if token_id is not None and token_id in self._tokens:
                self._tokens.move_to_end(token_id)
                self._issued[token_id] = now
                return token_id, self._tokens[token_id]
            token_id, token = new_token()
            self._tokens[token_id] = token
            self._issued[token_id] = now
            self._by_driver[driver] = token_id
            if len(self._tokens) > MAX_TOKENS:
                self._drop_tokens(now)
            return token_id, token

    def _drop_tokens(self, now: float) -> None:
        """Bring the table back to ``MAX_TOKENS`` if it can (hold ``_lock``)."""
        settled = now - TOKEN_SETTLE_S
        spare = [
            t for t in self._tokens if not self._in_use[t] and self._issued.get(t, 0) < settled
        ]
        drop = spare[: len(self._tokens) - MAX_TOKENS]
        if len(self._tokens) - len(drop) > HARD_MAX_TOKENS:  # a flood: the oldest go
            extra = len(self._tokens) - len(drop) - HARD_MAX_TOKENS
            kept = [t for t in self._tokens if t not in set(drop) and not self._in_use[t]]
            drop += kept[:extra]
        gone = set(drop)
        for old in drop:
            del self._tokens[old]
            self._issued.pop(old, None)
        if gone:
            self._by_driver = {d: t for d, t in self._by_driver.items() if t not in gone}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for sock in [*self._listeners, *conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    # -- accepting -----------------------------------------------------------------------------

    def _accept(self, index: int) -> None:
        """Accept on ``self._listeners[index]`` (TCP first, then the local socket)."""
        backoff = 0.01
        while not self._closed:
            try:
                conn, peer = self._listeners[index].accept()
            except OSError as exc:
                if self._closed:
                    return
                logger.warning("lane accept failed (%r); retrying in %.2fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = 0.01
            if not self._opening.acquire(blocking=False):
                self._refuse(conn, peer, "too many connections opening at once")
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    self._opening.release()
                    return
                self._conns.add(conn)
            try:
                threading.Thread(
                    target=self._serve, args=(conn, peer), name="hybridflow-lane", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread could be started
                self._opening.release()
                self._forget(conn)
                self._refuse(conn, peer, f"no thread for it ({exc})")

    def _refuse(self, conn: socket.socket, peer: Any, why: str) -> None:
        """Drop a peer, logging the first refusal of each address."""
        address = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer or "local")
        with self._lock:
            first = address not in self._refused
            if first and len(self._refused) < MAX_TOKENS:
                self._refused.add(address)
        if first:
            logger.warning("lane refused a connection from %s: %s", address, why)
        with contextlib.suppress(OSError):
            conn.close()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._deadlines.pop(conn, None)

    # -- one connection -------------------------------------------------------------------------

    def _open(self, conn: socket.socket) -> tuple[Any, bytes, int | None, bool]:
        """TLS first on a TLS cluster, then the token: the connection to use, the token's
        id, the driver's process id to copy from (or ``None``) and whether to leave
        frames in place."""
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            link: Any = conn if self._tls is None else TLSChannel(conn, self._tls, server_side=True)
            with self._lock:
                tokens = dict(self._tokens)
            return (link, *open_as_worker(link, tokens, same_host=True))
        finally:
            self._opening.release()

    def _serve(self, raw: socket.socket, peer: Any) -> None:
        write_lock = threading.Lock()
        serving = threading.get_ident()
        held: dict[Any, list[Any]] = {}  # reply id -> [copied event, frames left in place]
        leave_in_place = False

        def reply(answer: dict) -> None:
            may_leave = leave_in_place and may_have_frames(answer)
            entry = None
            if may_leave:  # in the table before it is written: its release may come at once
                entry = held[answer["id"]] = [threading.Event(), None]
            left: list[Any] = []
            try:
                with write_lock:
                    left = write_message(conn.sendall, answer, leave_in_place=may_leave)
            except OSError as exc:  # the driver went away (or stopped reading)
                logger.debug("lane reply not sent: %r", exc)
                drop(conn)
            if entry is None:
                return
            entry[1] = left
            if not left:
                held.pop(answer["id"], None)
            elif threading.get_ident() != serving and not entry[0].wait(self._stall_s):
                # (the serving thread reads releases: it never waits for one)
                logger.warning("a driver did not release a reply in %gs", self._stall_s)
                drop(conn)  # nobody copies it now: the instance goes on

        def started() -> None:  # a message's header is in: the rest must follow in time
            with self._lock:
                self._deadlines[raw] = time.monotonic() + self._stall_s

        conn: Any = raw
        token_id = b""
        try:
            try:
                conn, token_id, pull_from, leave_in_place = self._open(raw)
            except (LaneRefused, OSError, ValueError) as exc:
                self._refuse(raw, peer, f"it did not open the lane properly ({exc})")
                return
            with self._lock:
                self._in_use[token_id] += 1
            conn.settimeout(None)
            nodelay(raw)
            bound_sends(conn, self._stall_s)
            stream = (
                io.BufferedReader(_DataWaits(raw), BUFFER)
                if conn is raw
                else conn.makefile("rb", buffering=BUFFER)
            )
            while True:
                msg = entry = None  # the last message's data is not kept while we wait
                msg, _ = read_message(stream, pull_from, self._limits, started)
                with self._lock:
                    self._deadlines.pop(raw, None)
                if msg.get("op") == RELEASE:
                    entry = held.pop(msg.get("id"), None)
                    if entry is not None:
                        entry[0].set()
                    continue
                try:
                    self._handle(msg, reply)
                except Exception as exc:  # a bug, or a malformed call: the caller is told
                    logger.exception("lane message %r failed", msg.get("id"))
                    error = RuntimeError(f"the worker could not take the call: {exc!r}")
                    reply({"id": msg.get("id"), "status": "error", "exception": error})
        except (EOFError, OSError):  # the driver closed, or this server did
            pass
        except ProtocolError as exc:  # out of bounds or malformed: this peer is done
            self._refuse(raw, peer, str(exc))
        except Exception as exc:  # anything else a peer's bytes caused
            self._refuse(raw, peer, f"unreadable message ({exc!r})")
        finally:
            if token_id:
                with self._lock:
                    self._in_use[token_id] -= 1
                    if not self._in_use[token_id]:
                        del self._in_use[token_id]
            self._forget(raw)
            with contextlib.suppress(OSError):
                raw.close()
            for entry in list(held.values()):  # nobody will copy them now
                entry[0].set()
            held.clear()

    def _watch(self) -> None:
        """Drop connections whose message stopped arriving half-way."""
        while not self._closed:
            time.sleep(WATCH_S)
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                logger.warning("a lane message stalled half-way for %gs: dropped", self._stall_s)
                drop(conn)


class _DataWaits(io.RawIOBase):
    """A plain socket's reads, each waiting for data in ``poll`` first. A thread blocked
    in a unix socket's ``recv`` is woken too whenever the peer reads what this end wrote
    (the kernel wakes the socket's sleepers when its send buffer frees up), so a lane's
    reader, waiting for the next call, was woken for nothing once per reply; ``poll``
    waits for data (or the end) alone."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._poll.poll()
        return self._sock.recv_into(buffer)
