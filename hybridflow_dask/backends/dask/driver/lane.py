"""A plain socket between a driver's calling thread and a worker's instances: TCP, or
the worker's local socket when both are in one network namespace (no TCP stack on the
way: about 25 µs less per round trip here).

A blocking call whose arguments hold no futures needs nothing from Dask on its way: not
the scheduler, not the worker's event loop. On the socket lane the calling thread writes
the call, a thread of the worker reads it and hands it to the instance's actor, and the
actor's thread writes the reply, which a reader thread of the driver hands to the
waiting caller. No event loop on either side, so no loop wake-ups and no cross-thread
hops beyond the one into the instance's own thread (about a third of a millisecond per
round trip here, against over a millisecond through the loops).

The lane is learned over the worker's Dask comm (its port and a random token the
connecting side must present first), so it is no more open than that comm. On a cluster
whose comms are encrypted (``tls://``) the lane runs TLS with the cluster's own
certificates; clusters whose comms are not TCP keep every call on the Dask comm.

When both ends share a host and may read each other's memory (checked as the lane
opens, see ``same_host``), large frames are not written to the socket at all: the reader
copies them out of the sender's memory, then sends ``release`` so that the sender may
drop (or change) them. A worker's instance waits for that, as it would wait for a
socket write to finish, so the next call cannot change a result still being copied.

Neither end ever waits to write while it should be reading: each side's reader only
reads and hands over (releases go out from a thread of their own, fetch replies from
the worker's fetch threads), so two large transfers in opposite directions, or a release
behind a large request, always make progress. A driver's write that is still not done
at its call's deadline (``hybridflow.call-timeout`` in force when the call was made),
and a worker's that makes no progress for ``STALL_TIMEOUT_S``, break the lane instead of
blocking forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from ..wire.lane_protocol import (
    BUFFER,
    RELEASE,
    bound_sends,
    connect,
    open_as_driver,
)
from ..wire.messages import LaneLimits, read_message, write_message
from ..wire.tls import TLSChannel

__all__ = ["Lane"]

logger = logging.getLogger(__name__)


class Lane:
    """The driver's end of one worker's lane: requests written by the calling thread,
    replies read by a thread of its own that settles each request's future.

    ``on_broken(pending)`` is called once, in the reader thread, with the requests still
    waiting when the connection ends (their worker died, or the lane was closed).
    ``same_host=False`` never copies frames between the processes' memories. ``local``:
    the name of the worker's local socket, tried before ``host:port``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: tuple[bytes, bytes],
        on_reply: Callable[[Any, dict], None],
        on_broken: Callable[[list[Any]], None],
        same_host: bool = True,
        send_timeout: float | None = None,
        limits: LaneLimits | None = None,
        tls: ssl.SSLContext | None = None,
        local: str | None = None,
    ) -> None:
        raw = connect(host, port, local)
        self._sock: Any = raw
        self._raw = raw
        #: Whether the lane runs TLS (on a TLS cluster, with the cluster's certificates).
        self.tls = tls is not None
        try:
            if tls is not None:
                self._sock = TLSChannel(raw, tls, server_side=False)
            token_id, secret = token
            self._leave_in_place, self._pull_from = open_as_driver(
                self._sock, token_id, secret, same_host=same_host
            )
        except BaseException:
            raw.close()
            raise
        self._sock.settimeout(None)
        #: A write that makes no progress this long breaks the lane, deadline or none.
        self._stall = send_timeout
        bound_sends(self._sock, send_timeout)
        self._on_reply, self._on_broken = on_reply, on_broken
        self._limits = limits or LaneLimits()
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

    def request(self, msg: dict, context: Any) -> None:
        """Send ``msg``; its reply goes to ``on_reply(context, reply)``. A write that makes
        no progress until ``msg["deadline"]`` (``time.time()``: the limit in force when
        its call was made) breaks the lane rather than block its caller for good.

        Raises ``ConnectionError`` when the lane is already broken (nothing was sent).
        """
        with self._lock:
            if self.broken:
                raise ConnectionError("the lane is closed")
            ident = next(self._ids)
            self._waiting[ident] = (context, msg)
        msg["id"] = ident
        deadline = msg.get("deadline")
        write = (
            self._sock.sendall if deadline is None else _until(self._sock, deadline, self._stall)
        )
        try:
            with self._write_lock:
                write_message(write, msg, leave_in_place=self._leave_in_place)
        except OSError:
            self.close()  # the reader ends and reports this request with the others

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def reset(self) -> None:
        """End the lane dropping what is still queued for the worker (its host is cut
        off): the reader's close of the socket then resets the connection instead of
        delivering the rest when the link comes back."""
        with contextlib.suppress(OSError):
            self._raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def _read(self) -> None:
        try:
            stream = self._sock.makefile("rb", buffering=BUFFER)
            while True:
                reply = waiting = None  # the last reply's data is not kept while we wait
                reply, copied = read_message(stream, self._pull_from, self._limits)
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
                    write_message(self._sock.sendall, {"op": RELEASE, "id": ident})
            except OSError:
                self.close()
                return


#: How much of a frame is written between two looks at the clock, on a call with a deadline.
WRITE_CHUNK = 4 << 20


def _until(sock: Any, deadline: float, stall: float | None) -> Callable[[Any], None]:
    """A ``sendall`` that gives up at ``deadline`` (``time.time()``) with ``OSError``:
    chunk by chunk, each write bounded by the time left (a stopped reader makes a blocked
    write wait for good, and the kernel's per-write timeout restarts with every byte that
    gets through)."""

    def bound() -> None:
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError("the call's hybridflow.call-timeout passed while writing")
        bound_sends(sock, left if stall is None else min(left, stall))

    def write(data: Any) -> None:
        view = memoryview(data).cast("B")
        try:
            for start in range(0, max(view.nbytes, 1), WRITE_CHUNK):
                chunk = view[start : start + WRITE_CHUNK]
                if not isinstance(sock, socket.socket):  # TLS: whole chunks
                    bound()
                    sock.sendall(chunk)
                    continue
                # A plain socket's sends, each bounded anew: a send that got part of the
                # chunk through returns, and the next may only wait for what is left.
                while chunk.nbytes:
                    bound()
                    chunk = chunk[sock.send(chunk) :]
        finally:
            bound_sends(sock, stall)

    return write
