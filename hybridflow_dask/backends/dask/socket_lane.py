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
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from distributed.comm.addressing import parse_address, parse_host_port

from .wire import read_message, write_message

__all__ = ["Lane", "LaneServer", "lane_host"]

logger = logging.getLogger(__name__)

#: How long connecting to a lane (and presenting the token) may take.
CONNECT_TIMEOUT_S = 5.0
TOKEN_BYTES = 16
_BUFFER = 1 << 16


def lane_host(address: str) -> str | None:
    """The host a worker at Dask ``address`` can offer a lane on, or ``None`` (not TCP)."""
    scheme, location = parse_address(address)
    if scheme != "tcp":
        return None
    return parse_host_port(location)[0]


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


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

        def reply(answer: dict) -> None:
            try:
                with write_lock:
                    write_message(conn.sendall, answer)
            except OSError as exc:  # the driver went away; nobody waits for this answer
                logger.debug("lane reply not sent: %r", exc)

        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            token = conn.recv(TOKEN_BYTES, socket.MSG_WAITALL)
            if not hmac.compare_digest(token, self.token):
                return
            conn.settimeout(None)
            _nodelay(conn)
            stream = conn.makefile("rb", buffering=_BUFFER)
            while True:
                msg = read_message(stream)
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


class Lane:
    """The driver's end of one worker's lane: requests written by the calling thread,
    replies read by a thread of its own that settles each request's future.

    ``on_broken(pending)`` is called once, in the reader thread, with the requests still
    waiting when the connection ends (their worker died, or the lane was closed).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        on_reply: Callable[[Any, dict], None],
        on_broken: Callable[[list[Any]], None],
    ) -> None:
        self._sock = _nodelay(socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S))
        self._sock.sendall(token)
        self._sock.settimeout(None)
        self._on_reply, self._on_broken = on_reply, on_broken
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._waiting: dict[int, Any] = {}
        self.broken = False
        self._reader = threading.Thread(target=self._read, name="hybridflow-lane", daemon=True)
        self._reader.start()

    def request(self, msg: dict, context: Any) -> None:
        """Send ``msg``; its reply goes to ``on_reply(context, reply)``.

        Raises ``ConnectionError`` when the lane is already broken (nothing was sent).
        """
        with self._lock:
            if self.broken:
                raise ConnectionError("the lane is closed")
            ident = next(self._ids)
            self._waiting[ident] = context
        msg["id"] = ident
        try:
            with self._write_lock:
                write_message(self._sock.sendall, msg)
        except OSError:
            self.close()  # the reader ends and reports this request with the others

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        try:
            stream = self._sock.makefile("rb", buffering=_BUFFER)
            while True:
                reply = read_message(stream)
                with self._lock:
                    context = self._waiting.pop(reply.pop("id"), None)
                if context is not None:
                    self._on_reply(context, reply)
        except (EOFError, OSError):
            pass
        except Exception:  # a reply that cannot be read: the lane is no longer usable
            logger.exception("lane to a worker failed")
        with self._lock:
            self.broken = True
            pending, self._waiting = list(self._waiting.values()), {}
        with contextlib.suppress(OSError):
            self._sock.close()
        self._on_broken(pending)
