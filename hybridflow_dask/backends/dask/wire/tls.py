"""TLS for the socket lane, with one thread reading while others write.

An ``ssl.SSLSocket`` must not be read in one thread while another writes to it: OpenSSL
forbids using one connection's ``SSL`` object from two threads at once. The lane needs
exactly that (one thread reading, a waiting caller or the lane's reader, while callers
and instances write), so its TLS runs on memory buffers instead
(``SSLContext.wrap_bio``): every use of the TLS state holds a short lock, and the socket
is read and written outside it. Records reach the socket in
the order they were made (one sending lock), records the reader makes (TLS 1.3
post-handshake messages) go out with the next write, and the reader never writes.

``TLSChannel`` looks like the socket it wraps to the lane's code (``sendall``, ``recv``,
``makefile``, ``settimeout``, ``setsockopt``, ``shutdown``, ``close``), so the lane runs
the same over TLS and plain TCP. It uses the cluster's own ``distributed.Security``
contexts: mutual authentication with the cluster's certificates.
"""

from __future__ import annotations

import io
import socket
import ssl
import threading
from typing import Any, cast

__all__ = ["TLSChannel"]

_CHUNK = 1 << 18


class TLSChannel:
    """A TLS session over a connected socket; the handshake runs in the constructor
    (bounded by the socket's timeout). Raises ``ssl.SSLError`` when the peer's
    certificate is not the cluster's, ``OSError`` when the connection breaks."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> None:
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._state = threading.Lock()  # the TLS object
        self._sending = threading.Lock()  # the order of records on the socket
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._pull()
        self._flush()

    # -- what the lane's code calls, as on a socket ------------------------------------------

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        with self._sending:
            for start in range(0, len(view), _CHUNK):
                with self._state:
                    self._tls.write(view[start : start + _CHUNK])
                    records = self._outgoing.read()
                self._sock.sendall(records)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Decrypted bytes into ``buffer``; 0 at the end of the stream. One reader only.

        With ``MSG_DONTWAIT``, only what has arrived, as much of it as fits (what is left
        decrypted but unread here, a poll of the socket cannot see), and
        ``BlockingIOError`` when nothing has."""
        view = memoryview(buffer).cast("B")
        size = nbytes or len(view)
        if flags & socket.MSG_DONTWAIT:
            return self._recv_now(view[:size])
        while True:
            with self._state:
                try:
                    return cast(int, self._tls.read(size, view))  # a count, given a buffer
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
            if not self._pull():
                return 0

    def _recv_now(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            with self._state:
                try:
                    got += cast(int, self._tls.read(len(view) - got, view[got:]))
                    continue
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return got
            try:
                data = self._sock.recv(_CHUNK, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if got:
                    return got
                raise
            if not data:
                return got
            with self._state:
                self._incoming.write(data)
        return got

    def recv(self, size: int, flags: int = 0) -> bytes:
        """Up to ``size`` bytes; all of them with ``MSG_WAITALL`` (or fewer at the end)."""
        buffer = bytearray(size)
        got = self.recv_into(buffer)
        while flags & socket.MSG_WAITALL and 0 < got < size:
            more = self.recv_into(memoryview(buffer)[got:])
            if not more:
                break
            got += more
        return bytes(buffer[:got])

    def makefile(self, mode: str = "rb", buffering: int = io.DEFAULT_BUFFER_SIZE) -> Any:
        return io.BufferedReader(_Raw(self), buffering)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    # -- the socket underneath ---------------------------------------------------------------

    def _pull(self) -> bool:
        """Move what the socket has into the TLS object; ``False`` at the end of it."""
        data = self._sock.recv(_CHUNK)
        if not data:
            return False
        with self._state:
            self._incoming.write(data)
        return True

    def _flush(self) -> None:
        with self._sending:
            with self._state:
                records = self._outgoing.read()
            if records:
                self._sock.sendall(records)


class _Raw(io.RawIOBase):
    """The channel as a raw stream, for a ``BufferedReader``."""

    def __init__(self, channel: TLSChannel) -> None:
        self._channel = channel

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._channel.recv_into(buffer)
