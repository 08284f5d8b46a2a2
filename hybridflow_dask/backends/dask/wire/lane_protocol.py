"""The socket lane's protocol, shared by both ends: how a lane is opened and framed.

A lane is a TCP connection (or, within one network namespace, one on the worker's local
socket: ``local_listener``) between a driver's calling threads and a worker's instances
(``driver.lane`` is the driver's end, ``worker.lane_server`` the worker's). A driver gets
a token of its own from the worker over the worker's Dask comm (``hf_lane``: as
authenticated as Dask's own handlers, and encrypted on a TLS cluster). The token never
crosses the lane: opening one is a challenge-response bound to fresh nonces from both
ends, so nothing seen on a lane can be replayed to open another:

1. worker → driver: its nonce ``sn``;
2. driver → worker: the token's id, its nonce ``cn``, ``proof(token, "driver", sn, cn)``,
   and where its memory holds ``proof(token, "driver-memory", sn, cn)`` (process id and
   address; zeros when it will not be copied from);
3. worker → driver: ``proof(token, "worker", sn, cn)`` (the driver checks it: mutual),
   whether it could read the driver's memory proof (so the driver may leave large frames
   in place), and where its own memory proof lies;
4. driver → worker: whether it could read that.

A memory proof read out of process ``pid`` shows that ``pid`` is this connection's peer
(or acts for it): a value derived from this connection's nonces and the token is there,
so no other local process can be named in its place. Then messages (``messages``) flow
both ways, and ``release`` tells the worker that frames it left in its memory have been
copied. Nothing is unpickled before a peer has proven the token.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import sys

from distributed.comm.addressing import parse_address, parse_host_port

from ....errors import LaneRefused
from .same_host import Probe, can_read, supported

__all__ = [
    "BUFFER",
    "CONNECT_TIMEOUT_S",
    "RELEASE",
    "STALL_TIMEOUT_S",
    "bound_sends",
    "connect",
    "drop",
    "is_tls",
    "lane_host",
    "local_listener",
    "new_token",
    "nodelay",
    "open_as_driver",
    "open_as_worker",
    "recv_exactly",
]

CONNECT_TIMEOUT_S = 5.0
#: How long the worker's end waits for a write to progress, for the rest of a message
#: it started reading, or for the driver to release a reply's frames, before it drops
#: the connection (a driver that stopped reading or writing).
STALL_TIMEOUT_S = 60.0
TOKEN_BYTES = 32
TOKEN_ID_BYTES = 8
NONCE_BYTES = 16
BUFFER = 1 << 16
_PROOF_BYTES = 32
_WHERE = struct.Struct("!qQ")  # process id, address (0, 0: not offered)
_CLAIM = struct.Struct(f"!{TOKEN_ID_BYTES}s{NONCE_BYTES}s{_PROOF_BYTES}s")
_ANSWER = struct.Struct(f"!{_PROOF_BYTES}s?")
_YES = struct.Struct("!?")
RELEASE = "release"


def new_token() -> tuple[bytes, bytes]:
    """A token's public id and its secret, for one driver."""
    return secrets.token_bytes(TOKEN_ID_BYTES), secrets.token_bytes(TOKEN_BYTES)


def _proof(token: bytes, purpose: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, purpose + server_nonce + client_nonce, hashlib.sha256).digest()


def _where(probe: Probe | None) -> bytes:
    return _WHERE.pack(probe.pid, probe.address) if probe else _WHERE.pack(0, 0)


def open_as_worker(
    conn: socket.socket, tokens: dict[bytes, bytes], *, same_host: bool
) -> tuple[bytes, int | None, bool]:
    """The worker's half of opening a lane on ``conn`` (a timeout set on it bounds each
    read). ``tokens``: the tokens handed out, by id. Returns the id of the token the
    driver proved, the driver's process id when its frames may be copied out of its
    memory (else ``None``), and whether this end may leave its own frames in place.
    Raises ``LaneRefused``."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(server_nonce)
    token_id, client_nonce, claimed = _CLAIM.unpack(recv_exactly(conn, _CLAIM.size))
    token = tokens.get(token_id)
    if token is None or not hmac.compare_digest(
        claimed, _proof(token, b"driver", server_nonce, client_nonce)
    ):
        raise LaneRefused("the peer did not prove a token this worker handed out")
    pid, address = _WHERE.unpack(recv_exactly(conn, _WHERE.size))
    expected = _proof(token, b"driver-memory", server_nonce, client_nonce)
    pull_from = pid if same_host and pid and can_read(pid, address, expected) else None
    probe = (
        Probe(_proof(token, b"worker-memory", server_nonce, client_nonce))
        if same_host and pid and supported()
        else None
    )
    conn.sendall(
        _ANSWER.pack(_proof(token, b"worker", server_nonce, client_nonce), pull_from is not None)
        + _where(probe)
    )
    (leave_in_place,) = _YES.unpack(recv_exactly(conn, _YES.size))
    return token_id, pull_from, leave_in_place


def open_as_driver(
    sock: socket.socket, token_id: bytes, token: bytes, *, same_host: bool
) -> tuple[bool, int | None]:
    """The driver's half: whether it may leave its frames in place, and the worker's
    process id when the worker's frames may be copied out of its memory. Raises
    ``LaneRefused`` when the worker does not prove the token."""
    server_nonce = recv_exactly(sock, NONCE_BYTES)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    probe = (
        Probe(_proof(token, b"driver-memory", server_nonce, client_nonce))
        if same_host and supported()
        else None
    )
    claim = _proof(token, b"driver", server_nonce, client_nonce)
    sock.sendall(_CLAIM.pack(token_id, client_nonce, claim) + _where(probe))
    shown, copies = _ANSWER.unpack(recv_exactly(sock, _ANSWER.size))
    if not hmac.compare_digest(shown, _proof(token, b"worker", server_nonce, client_nonce)):
        raise LaneRefused("the worker's end did not prove the token")
    pid, address = _WHERE.unpack(recv_exactly(sock, _WHERE.size))
    expected = _proof(token, b"worker-memory", server_nonce, client_nonce)
    pull_from = pid if probe and pid and can_read(pid, address, expected) else None
    sock.sendall(_YES.pack(pull_from is not None))
    return copies, pull_from


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes of a lane's opening; ``LaneRefused`` when the other end breaks off."""
    try:
        data = sock.recv(size, socket.MSG_WAITALL)
    except ConnectionError as exc:
        raise LaneRefused(f"the lane was refused while opening: {exc!r}") from exc
    if len(data) != size:
        raise LaneRefused("the lane closed while opening")
    return data


def lane_host(address: str) -> str | None:
    """The host a worker at Dask ``address`` can offer a lane on, or ``None`` (neither
    TCP nor TLS: UCX, in-process). A ``tls://`` worker's lane runs TLS."""
    scheme, location = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return None
    return parse_host_port(location)[0]


def is_tls(address: str) -> bool:
    """Whether the worker at Dask ``address`` speaks TLS (so its lane must too)."""
    return parse_address(address)[0] == "tls"


def nodelay(sock: socket.socket) -> socket.socket:
    """``sock`` with Nagle's delay off (a TCP socket; a local one has none)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def local_listener() -> tuple[socket.socket, str] | None:
    """A listening socket in Linux's abstract namespace, and its name; ``None`` elsewhere.

    Only processes of the same network namespace (the same machine, or the same
    container) can reach it, and a message there skips the kernel's TCP stack: a round
    trip here took ~37 µs against ~62 µs on TCP loopback. The name is random, so a peer
    elsewhere cannot hit another lane by chance; it opens like any lane (the token).
    """
    if not sys.platform.startswith("linux"):
        return None
    name = f"\0hybridflow-lane-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        return None
    return listener, name


def connect(host: str, port: int, local: str | None) -> socket.socket:
    """A connection to a worker's lane: on ``local`` (its abstract socket) when this
    process can reach it (same network namespace), else over TCP to ``host:port``."""
    if local:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(local)
            return sock
        except OSError:  # not here: another machine, or another namespace
            sock.close()
    return nodelay(socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S))


def bound_sends(sock: socket.socket, seconds: float | None) -> None:
    """A blocking send that makes no progress for ``seconds`` raises ``OSError`` (``None``
    or 0: never); reads on the same socket stay unbounded (an idle lane is not a broken
    one)."""
    seconds = max(seconds, 1e-3) if seconds else 0.0  # a zero timeval means "never"
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def drop(conn: socket.socket) -> None:
    """End a connection from any thread: its reader sees the end and cleans up."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
