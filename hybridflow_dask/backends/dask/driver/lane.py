"""A plain socket between a driver's calling thread and a worker's instances: TCP, or
the worker's local socket when both are in one network namespace (no TCP stack on the
way: about 25 µs less per round trip here).

A blocking call whose arguments hold no futures needs nothing from Dask on its way: not
the scheduler, not the worker's event loop. On the socket lane the calling thread writes
the call, a thread of the worker reads it and hands it to the instance's actor, and the
actor's thread writes the reply, which the waiting caller reads itself
(``read_replies``). No event loop on either side, so no loop wake-ups and no cross-thread
hops beyond the one into the instance's own thread (about a third of a millisecond per
round trip here, against over a millisecond through the loops).

Each lane also has a reader thread, for the replies no caller reads: a caller that gave
up waiting, one that another thread's reading shut out, a reply too large for the
lane's buffer, a fetch. While a caller
reads, the thread sleeps, woken only when asked or when the connection ends, so a lane
whose worker died is still noticed at once. Handing a reply from a reader thread to its
caller cost ~35 µs of wake-ups per round trip here, and its GIL hand-offs held up the
calling thread's next writes.

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
behind a large request, always make progress. A caller reads its own replies only when
its call sends one request per lane: it writes nothing more there before it reads. A
driver's write that is still not done at its call's deadline (``hybridflow.call-timeout``
in force when the call was made), and a worker's that makes no progress for
``STALL_TIMEOUT_S``, break the lane instead of blocking forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import queue
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..wire.lane_protocol import (
    RELEASE,
    bound_sends,
    connect,
    open_as_driver,
)
from ..wire.messages import LaneLimits, plain_message, read_message, write_message
from ..wire.tls import TLSChannel
from .inbox import Inbox

__all__ = ["Lane", "read_replies"]

logger = logging.getLogger(__name__)


#: Whether a lane's reader thread can sleep while callers read (Linux's epoll, eventfd).
_CAN_SLEEP = hasattr(select, "epoll") and hasattr(os, "eventfd")
#: What wakes a sleeping reader thread besides being asked (never mere data).
_ENDED = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR if _CAN_SLEEP else 0


class Lane:
    """The driver's end of one worker's lane: requests written by the calling thread,
    replies read by whoever holds the lane's reading (a waiting caller, or the lane's
    reader thread), each handed to ``on_reply``.

    ``on_broken(pending)`` is called once, by whichever reader finds the connection ended
    (its worker died, or the lane was closed), with the requests still waiting.
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
        #: The largest message without frames a caller reads at once (a larger one goes
        #: through ``read_message``, which refuses it).
        self._plain_most = min(self._limits.max_meta_bytes, self._limits.max_message_bytes)
        #: Replies copied out of the worker's memory, to release: the reader never writes.
        self._releases: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        # id -> (context, request): a request's frames may stay in our memory until the
        # worker has copied them, which it does before it answers.
        self._waiting: dict[int, tuple[Any, dict]] = {}
        self.broken = False
        self._inbox = Inbox(self._sock)
        #: Whether a waiting caller may read this lane's replies itself (on Linux); else
        #: the reader thread always reads.
        self.callers_may_read = _CAN_SLEEP
        #: Someone holds the reading: the reader thread, or a caller in ``read_replies``.
        self._reading = not self.callers_may_read
        #: The reading was handed to the reader thread, which has not taken it up yet.
        self._asked = False
        self._turn = threading.Condition(self._lock)
        #: Threads waiting on ``_turn`` (the reader thread, once its connection ended).
        self._turn_waiters = 0
        self._wake = -1
        if self.callers_may_read:
            self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._reader = threading.Thread(target=self._serve, name="hybridflow-lane", daemon=True)
        self._reader.start()
        if self._pull_from is not None:
            threading.Thread(
                target=self._release, name="hybridflow-lane-release", daemon=True
            ).start()

    def request(self, msg: dict, context: Any, *, read_by_caller: bool = False) -> None:
        """Send ``msg``; its reply goes to ``on_reply(context, reply)``. A write that makes
        no progress until ``msg["deadline"]`` (``time.time()``: the limit in force when
        its call was made) breaks the lane rather than block its caller for good.

        ``read_by_caller``: the caller will wait for the reply in ``read_replies`` (or
        hand it over with ``hand_over``); else the reader thread reads it.
        Raises ``ConnectionError`` when the lane is already broken (nothing was sent).
        """
        with self._lock:
            if self.broken:
                raise ConnectionError("the lane is closed")
            ident = next(self._ids)
            self._waiting[ident] = (context, msg)
            if not read_by_caller:
                self._ask_reader()
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

    def hand_over(self) -> None:
        """The reader thread reads the replies still waiting (their callers will not)."""
        with self._lock:
            if self._waiting:
                self._ask_reader()

    # -- who reads ----------------------------------------------------------------------------

    def _ask_reader(self) -> None:
        """Give the reading to the reader thread if nobody holds it. Lock held."""
        if not self._reading and not self.broken:
            self._reading = self._asked = True
            os.eventfd_write(self._wake, 1)

    def _acquire_reading(self) -> bool:
        """Whether the calling thread may read now (it then gives the reading back)."""
        with self._lock:
            if self._reading or self.broken:
                return False
            self._reading = True
            return True

    def _release_reading(self) -> None:
        with self._lock:
            self._reading = False
            if self._waiting:  # replies no caller is reading: the reader thread's
                self._ask_reader()
            if self._turn_waiters:  # (rare: a notify is three Python calls, every call)
                self._turn.notify_all()

    # -- reading ------------------------------------------------------------------------------

    def _read_one(self) -> None:
        """The next reply from the inbox (waiting for it, if it is not all in), handed on."""
        reply, copied = read_message(self._inbox, self._pull_from, self._limits)
        self._hand_on(reply, copied)

    def _hand_on(self, reply: dict, copied: bool) -> None:
        """``reply`` to whoever waits for it; ``copied``: some frame of it was copied out
        of the worker's memory."""
        ident = reply.pop("id")
        if copied:  # the worker may drop them now
            self._releases.put(ident)
        with self._lock:
            waiting = self._waiting.pop(ident, None)
        if waiting is not None:
            self._on_reply(waiting[0], reply)

    def _read_now(self) -> bool:
        """(A caller holding the reading.) What the socket holds now taken in, and every
        whole reply in the inbox handed on. ``False`` when the caller cannot go on: the
        lane ended, or the next reply is too large for the inbox (the reader thread's)."""
        inbox = self._inbox
        try:
            while True:
                got = inbox.receive_now()
                if got == 0:
                    raise EOFError("the lane ended")
                while True:
                    body = inbox.take_plain(self._plain_most)
                    if body is not None:
                        self._hand_on(plain_message(body), False)
                        continue
                    size = inbox.next_size()  # a message with frames, or not all in yet
                    if size is None:
                        break
                    if size > inbox.capacity:
                        return False
                    if size > inbox.buffered:
                        break
                    self._read_one()
                if got is None or not inbox.at_end:
                    return True  # it took in all there was
        except (EOFError, OSError):
            pass
        except Exception:  # a reply that cannot be read: the lane is no longer usable
            logger.exception("lane to a worker failed")
        except BaseException:  # interrupted, maybe half way through a reply: out of step
            self._end()
            raise
        self._end()
        return False

    def _serve(self) -> None:
        """The reader thread: reads whenever the reading is handed to it, or for good on
        a lane callers cannot read. Between turns it sleeps until asked, or until the
        connection ends (then it reads up to that end)."""
        try:
            try:
                if not self.callers_may_read:
                    while True:
                        self._read_one()
                with select.epoll() as watch:
                    watch.register(self._wake, select.EPOLLIN)
                    watch.register(self._raw.fileno(), _ENDED)
                    while self._turn_to_read(watch):
                        self._read_while_waited_for()
            except (EOFError, OSError):
                pass
            except Exception:  # a reply that cannot be read: the lane is no longer usable
                logger.exception("lane to a worker failed")
            self._end()  # (a no-op when a caller ended it)
        finally:
            with self._lock:
                if self._wake >= 0:
                    os.close(self._wake)
                    self._wake = -1

    def _turn_to_read(self, watch: Any) -> bool:
        """Sleep until this thread holds the reading; ``False`` when the lane ended."""
        while True:
            with self._lock:
                if self.broken:
                    return False
                if self._asked:
                    self._asked = False
                    return True
            events = dict(watch.poll())
            if self._wake in events:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
            if self._raw.fileno() in events:  # the connection ended: read up to its end
                with self._lock:
                    while self._reading and not self._asked and not self.broken:
                        self._turn_waiters += 1
                        try:
                            self._turn.wait()
                        finally:
                            self._turn_waiters -= 1
                    if self.broken:
                        return False
                    self._reading, self._asked = True, False
                while True:
                    self._read_one()  # until the end: EOFError

    def _read_while_waited_for(self) -> None:
        """Read while replies are waited for; then give the reading back."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._reading = False
                    self._turn.notify_all()
                    return
            self._read_one()

    def _end(self) -> None:
        """The lane is over (by its reader, the only one then): its waiting requests are
        reported to ``on_broken``, the reader thread (if asleep) wakes and ends."""
        with self._lock:
            if self.broken:
                return
            self.broken = True
            pending = [context for context, _ in self._waiting.values()]
            self._waiting = {}
            self._turn.notify_all()
            if self._wake >= 0:  # the reader thread may sleep in its watch
                os.eventfd_write(self._wake, 1)
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


def read_replies(lanes: Sequence[Lane], done: Callable[[], bool], timeout: float) -> None:
    """Read replies on ``lanes`` in this thread until ``done()``, for up to ``timeout``
    seconds. Only whole messages already in are read, so a stopped worker cannot hold the
    caller past ``timeout``. It reads none when another thread reads one of ``lanes``,
    and stops early when a lane ends or a reply is too large for its lane's buffer: the
    lanes' reader threads then read what is still waited for, and the caller waits."""
    taken: list[Lane] = []
    try:
        for lane in lanes:
            if not lane._acquire_reading():
                break
            taken.append(lane)
        else:
            _read_until(taken, done, time.monotonic() + timeout)
    finally:
        for lane in taken:
            lane._release_reading()


def _read_until(lanes: list[Lane], done: Callable[[], bool], give_up: float) -> None:
    poller = select.poll()
    by_fd = {}
    for lane in lanes:
        by_fd[lane._raw.fileno()] = lane
        poller.register(lane._raw, select.POLLIN)
    ready = [lane for lane in lanes if lane._inbox.buffered]  # left by an earlier reader
    while True:
        for lane in ready:
            if not lane._read_now():
                return
        if done():
            return
        left = give_up - time.monotonic()
        if left <= 0:
            return
        ready = [by_fd[fd] for fd, _ in poller.poll(math.ceil(left * 1000))]
