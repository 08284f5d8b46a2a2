"""What the driver's end of a lane has received and not read yet.

A buffer over the lane's socket that two kinds of reader share, one at a time: the
lane's reader thread, which reads it like any buffered stream (waiting for what is not
in yet), and a caller waiting for its replies, which only takes in what the socket holds
now and reads a message once the whole of it is in, so that a stopped worker cannot
hold the caller past its deadline. Whatever one reader took in beyond its last message
is there for the next.
"""

from __future__ import annotations

import socket
from typing import Any

from ..wire.lane_protocol import BUFFER
from ..wire.messages import PLAIN_HEAD, message_size, plain_size

__all__ = ["Inbox"]


class Inbox:
    """A lane socket's received bytes (``sock``: a plain socket, or a ``TLSChannel``)."""

    def __init__(self, sock: Any, size: int = BUFFER) -> None:
        self._sock = sock
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    @property
    def capacity(self) -> int:
        """The largest message a caller can read here (larger ones: the reader thread)."""
        return len(self._buffer)

    def read(self, size: int) -> bytes:
        """``size`` bytes (fewer only at the end of the stream), waiting for them: a
        message's header or fields, never more than the buffer holds (``readinto`` is
        for frames)."""
        if size > len(self._buffer):
            raise ValueError(f"read {size} bytes with readinto: the buffer holds {self.capacity}")
        while self._end - self._start < size and self._receive(0):
            pass
        start = self._start
        size = min(size, self._end - start)  # (no property: two reads per message)
        self._start = start + size
        return bytes(self._view[start : start + size])

    def readinto(self, buffer: Any) -> int:
        """What is buffered into ``buffer``, else (waiting) straight from the socket."""
        view = memoryview(buffer).cast("B")
        buffered = self.buffered
        if not buffered:
            return int(self._sock.recv_into(view))
        size = min(buffered, view.nbytes)
        view[:size] = self._view[self._start : self._start + size]
        self._start += size
        return size

    def receive_now(self) -> int | None:
        """Take in what the socket holds now, without waiting: the bytes taken, 0 at the
        end of the stream, ``None`` when it holds nothing or the buffer is full."""
        if self._start == 0 and self._end == len(self._buffer):
            return None  # whole messages only: a reader takes them first
        try:
            return self._receive(socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    def take_plain(self, most: int) -> bytes | None:
        """The next message's pickled fields, taken, when all of it is in, it carries no
        frames and its fields are at most ``most`` bytes (``plain_message`` reads them);
        else ``None``, and nothing is taken. (A caller's way through most replies: one
        call instead of a buffered reader's several.)"""
        size = plain_size(self._buffer, self._start, self._end)
        if size is None or size > most:
            return None
        begin = self._start + PLAIN_HEAD
        self._start = begin + size
        return bytes(self._view[begin : self._start])

    def next_size(self) -> int | None:
        """The size of the next message, once its header is in (see ``message_size``)."""
        return message_size(self._view[self._start : self._end])

    @property
    def buffered(self) -> int:
        return self._end - self._start

    @property
    def at_end(self) -> bool:
        """Whether what was taken in reaches the buffer's end (more may have arrived)."""
        return self._end == len(self._buffer)

    def _receive(self, flags: int) -> int:
        """Bytes from the socket at the buffer's free end (what is unread moves to the
        front first when that end is reached); 0 at the end of the stream."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        free = self._view[self._end :]
        got = self._sock.recv_into(free, 0, flags) if flags else self._sock.recv_into(free)
        self._end += got
        return int(got)
