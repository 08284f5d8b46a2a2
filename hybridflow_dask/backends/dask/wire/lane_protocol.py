"""The socket lane's protocol, shared by both ends: how a lane is opened and framed.

A lane is a plain TCP connection between a driver's calling threads and a worker's
instances (``driver.lane`` is the driver's end, ``worker.lane_server`` the worker's). It
opens with the worker's random token and an exchange of where each side holds a copy of
it (for same-host copies, see ``same_host``); then messages (``messages``) flow both ways,
and ``release`` tells the worker that frames it left in its memory have been copied.
"""

from __future__ import annotations

import contextlib
import socket
import struct

from distributed.comm.addressing import parse_address, parse_host_port

__all__ = [
    "ANSWER",
    "BUFFER",
    "CONNECT_TIMEOUT_S",
    "OFFER",
    "RELEASE",
    "STALL_TIMEOUT_S",
    "TOKEN_BYTES",
    "YES",
    "bound_sends",
    "drop",
    "lane_host",
    "nodelay",
    "recv_exactly",
]

CONNECT_TIMEOUT_S = 5.0
#: How long the worker's end waits for a write to progress, or for the driver to release
#: a reply's frames, before it drops the connection (a driver that stopped reading).
STALL_TIMEOUT_S = 60.0
TOKEN_BYTES = 16
BUFFER = 1 << 16
# Opening a lane: the driver sends the token and where its memory holds a copy of it
# (process id and address; 0, 0 when it will not copy); the worker answers whether it
# could read that, and offers the same; the driver answers whether it could.
OFFER = struct.Struct("!qQ")
ANSWER = struct.Struct("!?qQ")
YES = struct.Struct("!?")
RELEASE = "release"


def recv_exactly(sock: socket.socket, size: int) -> bytes:
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


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def bound_sends(sock: socket.socket, seconds: float | None) -> None:
    """A blocking send that makes no progress for ``seconds`` raises ``OSError``; reads
    on the same socket stay unbounded (an idle lane is not a broken one)."""
    if seconds:
        whole = int(seconds)
        timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def drop(conn: socket.socket) -> None:
    """End a connection from any thread: its reader sees the end and cleans up."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
