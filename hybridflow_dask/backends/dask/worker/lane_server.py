"""The worker's end of the socket lane: accepts drivers' connections, one reader each.

See ``driver.lane`` for what the lane is for and ``wire.lane_protocol`` for how it opens.
Each connection's thread only reads and hands messages over: replies are written by the
instance's thread (or a fetch thread) that has them, so the reader is always free to take
the driver's next message or a ``release``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..wire.lane_protocol import (
    ANSWER,
    BUFFER,
    CONNECT_TIMEOUT_S,
    OFFER,
    RELEASE,
    STALL_TIMEOUT_S,
    TOKEN_BYTES,
    YES,
    bound_sends,
    drop,
    nodelay,
    recv_exactly,
)
from ..wire.messages import read_message, write_message
from ..wire.same_host import Probe, can_read, supported

__all__ = ["LaneServer"]

logger = logging.getLogger(__name__)


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
                drop(conn)
            if not entry[1]:
                held.pop(answer["id"], None)
            elif threading.get_ident() != serving and not entry[0].wait(STALL_TIMEOUT_S):
                # (the serving thread reads releases: it never waits for one)
                logger.warning("a driver did not release a reply in %gs", STALL_TIMEOUT_S)
                drop(conn)  # nobody copies it now: the instance goes on

        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            if not hmac.compare_digest(recv_exactly(conn, TOKEN_BYTES), self.token):
                return
            pid, address = OFFER.unpack(recv_exactly(conn, OFFER.size))
            pull_from = pid if can_read(pid, address, self.token) else None
            probe = self._probe if pid else None
            conn.sendall(
                ANSWER.pack(
                    pull_from is not None, probe.pid if probe else 0, probe.address if probe else 0
                )
            )
            (leave_in_place,) = YES.unpack(recv_exactly(conn, YES.size))
            conn.settimeout(None)
            nodelay(conn)
            bound_sends(conn, STALL_TIMEOUT_S)
            stream = conn.makefile("rb", buffering=BUFFER)
            while True:
                msg, _ = read_message(stream, pull_from)
                if msg.get("op") == RELEASE:
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
