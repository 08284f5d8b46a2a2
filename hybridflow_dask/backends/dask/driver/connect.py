"""Opening a ``distributed.Client``: a bad address fails at once, an unreachable one fast.

``distributed.Client("notanaddress")`` raises only after it has started its event loop,
and the half-made client then blocks the interpreter in ``__del__`` at exit; an address
nobody answers on retries for Dask's 30 s connect timeout and ends in a long traceback.
Here a malformed address is a ``ValueError`` before anything starts (checked by plain
parsing, without importing ``distributed``, so the CLI can check it instantly), and a
reachable scheduler is proven with one comm handshake bounded by
``hybridflow.connect-timeout`` before a ``Client`` is built, with the same TLS
credentials (``security=``) the client will use. A ``Client`` that still fails to start
is closed on the spot, so nothing is left to hang at exit. When TLS is what went wrong
(a ``tls://`` address without credentials, credentials for a ``tcp://`` address, a failed
handshake, a ``tcp://`` address where the scheduler speaks TLS) the error says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import re
import socket
import ssl
from typing import Any

from ....errors import SchedulerLostError, SchedulerUnreachableError

__all__ = [
    "SchedulerLostError",
    "SchedulerUnreachableError",
    "open_client",
    "resolve_security",
    "validate_address",
]

logger = logging.getLogger(__name__)

#: Protocols whose addresses are ``HOST:PORT`` (Dask's built-in ones and UCX).
HOST_PORT_SCHEMES = frozenset({"tcp", "tls", "ws", "wss", "ucx", "ucxx"})
EXAMPLE = "tcp://10.0.0.5:8786"
#: How long a Client that failed to start gets to close itself.
DISCARD_WAIT_S = 2.0


def validate_address(address: object) -> str:
    """``address`` stripped if it looks like a scheduler address, else a ``ValueError``.

    Accepts what Dask accepts: ``PROTOCOL://HOST:PORT`` (``tcp``, ``tls``, ``ws``,
    ``wss``, ``ucx``), a bare ``HOST:PORT`` (``tcp``), ``inproc://...``, and any protocol
    registered with ``distributed``'s comm registry.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(
            f"not a Dask scheduler address: {address!r}; expected PROTOCOL://HOST:PORT, "
            f"e.g. {EXAMPLE}"
        )
    address = address.strip()
    why = _problem(address)
    if why:
        raise ValueError(
            f"not a Dask scheduler address: {address!r} ({why}); expected "
            f"PROTOCOL://HOST:PORT, e.g. {EXAMPLE}"
        )
    return address


def _problem(address: str) -> str | None:
    scheme, sep, location = address.partition("://")
    if not sep:
        scheme, location = "tcp", address
    scheme = scheme.lower()
    if scheme in ("http", "https"):
        return "that is a web URL, such as the dashboard's; give the scheduler's address"
    if scheme == "inproc":
        return None if location else "nothing after inproc://"
    if scheme not in HOST_PORT_SCHEMES:
        return _unknown_scheme(scheme)
    host, port = _split_host_port(location)
    if port is None:
        return "no port"
    if not host:
        return "no host"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not a number from 1 to 65535"
    return None


def _split_host_port(location: str) -> tuple[str, str | None]:
    if location.startswith("["):  # [IPv6]:port
        host, _, rest = location[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    host, sep, port = location.rpartition(":")
    if not sep or ":" in host:  # no colon at all, or an IPv6 address without brackets
        return location, None
    return host, port


def _unknown_scheme(scheme: str) -> str | None:
    from distributed.comm.registry import get_backend  # only for unusual protocols

    try:
        get_backend(scheme)
    except ValueError:
        return f"unknown protocol {scheme!r}"
    return None


def resolve_security(security: Any) -> Any:
    """``None`` for no TLS, a ``Security`` as given, or a temporary one for ``True``."""
    if security is None or security is False:
        return None
    from distributed.security import Security

    if security is True:
        try:
            return Security.temporary()
        except ImportError as exc:
            raise ImportError(
                "security=True makes a temporary self-signed certificate, which needs the "
                "`cryptography` package (pip install cryptography); or pass a "
                "distributed.security.Security made from your own certificate files"
            ) from exc
    if not isinstance(security, Security):
        raise TypeError(
            "security must be a distributed.security.Security or True, not "
            f"{type(security).__name__}"
        )
    return security


def open_client(
    target: Any, *, timeout: float | None = None, security: Any = None, **client_kwargs: Any
) -> Any:
    """A ``distributed.Client`` on ``target``: a scheduler address or a cluster object.

    An address is validated (``ValueError``) and probed within ``timeout`` seconds
    (default ``hybridflow.connect-timeout``; ``SchedulerUnreachableError`` naming it)
    before the client is built. ``security`` (a ``Security``) is used by the probe and the
    client alike; ``client_kwargs`` go to ``Client``.
    """
    from distributed import Client

    if security is not None:
        client_kwargs["security"] = security
    if isinstance(target, str):
        target = validate_address(target)
        if timeout is None:
            from ..config import connect_timeout

            timeout = connect_timeout()
        _probe(target, timeout, security)
    client = Client.__new__(Client)
    try:
        client.__init__(target, **client_kwargs)
    except BaseException as exc:
        _discard(client)
        if isinstance(target, str) and isinstance(exc, OSError):
            why = _reason(exc, target, security)
            raise SchedulerUnreachableError(target, timeout or 0.0, why) from exc
        raise
    return client


def _probe(address: str, timeout: float, security: Any = None) -> None:
    """One comm connection and handshake with the scheduler, or the error that says why."""
    try:
        _run(_connect_once(address, timeout, security))
    except Exception as exc:
        why = _reason(exc, address, security)
        raise SchedulerUnreachableError(address, timeout, why) from None


async def _connect_once(address: str, timeout: float, security: Any = None) -> None:
    from distributed.comm import connect
    from distributed.security import Security

    args = (security or Security()).get_connection_args("client")
    comm = await asyncio.wait_for(connect(address, timeout=timeout, **args), timeout + 1)
    await comm.close()


def _run(coro: Any) -> None:
    """Run ``coro`` to completion, also from a thread whose event loop is running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()


def _reason(exc: BaseException, address: str, security: Any = None) -> str:
    """The cause, in words a user can act on (the chain first, then a quick look)."""
    chain = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    mismatch = _tls_mismatch(address, security)
    if mismatch:
        return mismatch
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return REFUSED
    if any(isinstance(e, socket.gaierror) for e in chain):
        return UNRESOLVED
    failed = _tls_failure(chain)
    if failed:
        return TLS_HANDSHAKE.format(detail=failed)
    # Dask retries until the timeout, so the last error may be a cancelled attempt:
    # look once more, briefly, at what answers there.
    found = _look(address)
    if found:
        return found
    if _scheme(address) not in TLS_SCHEMES and _speaks_tls(address):
        return TLS_EXPECTED
    if any(isinstance(e, TimeoutError) or "Timed out" in str(e) for e in chain):
        return "timed out"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


REFUSED = "connection refused: nothing listens on that port"
UNRESOLVED = "the host name does not resolve"
TLS_SCHEMES = frozenset({"tls", "wss"})
TLS_NO_CREDENTIALS = (
    "TLS: the address asks for TLS but no TLS credentials were given: pass security=, a "
    "distributed.security.Security with the CA that signed the scheduler's certificate "
    "(tls_ca_file) and a client certificate and key (tls_client_cert, tls_client_key)"
)
TLS_NOT_ENCRYPTED = (
    "TLS: the credentials given (security=) require encryption but {scheme}:// is not "
    "encrypted: use the scheduler's tls:// address"
)
TLS_HANDSHAKE = (
    "TLS handshake failed ({detail}): check that the scheduler uses TLS, that security='s "
    "tls_ca_file is the CA that signed the scheduler's certificate, and that its client "
    "certificate and key (tls_client_cert, tls_client_key) are signed by a CA the scheduler "
    "trusts"
)
TLS_EXPECTED = (
    "TLS: the scheduler there speaks TLS: use its tls:// address and pass security= with "
    "the cluster's CA and a client certificate and key"
)


def _scheme(address: str) -> str:
    scheme, sep, _ = address.partition("://")
    return scheme.lower() if sep else "tcp"


def _tls_mismatch(address: str, security: Any) -> str | None:
    """A TLS address without credentials, or credentials that refuse a plain address."""
    args = security.get_connection_args("client") if security is not None else {}
    scheme = _scheme(address)
    if scheme in TLS_SCHEMES and args.get("ssl_context") is None:
        return TLS_NO_CREDENTIALS
    if scheme in ("tcp", "ws") and args.get("require_encryption"):
        return TLS_NOT_ENCRYPTED.format(scheme=scheme)
    return None


_SSL_CODE = re.compile(r"\[SSL: (\w+)\]")


def _tls_failure(chain: list[BaseException]) -> str | None:
    """What the TLS layer said, if it is what failed (Dask sometimes keeps only its text)."""
    for error in chain:
        if isinstance(error, ssl.SSLError):
            return getattr(error, "verify_message", None) or error.reason or str(error)
    for error in chain:
        code = _SSL_CODE.search(str(error))
        if code:
            return code.group(1)
        if "TLS certificate" in str(error):
            return str(error).splitlines()[0]
    return None


def _speaks_tls(address: str, wait_s: float = 1.0) -> bool:
    """Whether whatever listens at ``address`` answers a TLS hello (a TLS-only scheduler)."""
    _, sep, location = address.partition("://")
    host, port = _split_host_port(location if sep else address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether it speaks TLS, not trusting it
    try:
        raw = socket.create_connection((host.strip("[]"), int(port or 0)), wait_s)
        with raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:  # an alert (e.g. "certificate required") is still TLS
        return "ALERT" in (exc.reason or "")
    except (OSError, ValueError):
        return False


def _look(address: str, wait_s: float = 1.0) -> str | None:
    """``REFUSED`` or ``UNRESOLVED`` if a plain TCP connect says so within ``wait_s``."""
    scheme, sep, location = address.partition("://")
    if sep and scheme.lower() not in HOST_PORT_SCHEMES:
        return None
    host, port = _split_host_port(location if sep else address)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        connect = pool.submit(socket.create_connection, (host, int(port or 0)), wait_s)
        connect.result(timeout=wait_s + 0.5).close()
    except ConnectionRefusedError:
        return REFUSED
    except socket.gaierror:
        return UNRESOLVED
    except Exception:
        return None
    finally:
        pool.shutdown(wait=False)
    return None


def _discard(client: Any) -> None:
    """Close a client whose start failed, so its ``__del__`` has nothing left to wait for."""
    with contextlib.suppress(Exception):
        client.close(timeout=DISCARD_WAIT_S)
    with contextlib.suppress(Exception):
        client.status = "closed"
    runner = getattr(client, "_loop_runner", None)
    with contextlib.suppress(Exception):
        if runner is not None:
            runner.stop()
    logger.debug("discarded a client that failed to start")
