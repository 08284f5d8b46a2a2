"""Whether the hosts the driver waits on still answer on the network.

A cut link is not a death: the worker lives on behind it, the scheduler hears nothing
for minutes (its heartbeat timeout), and a connection to it neither completes nor breaks
for as long as TCP keeps retransmitting. What tells a cut link apart from a slow or
stopped worker is the host's kernel: a new TCP connection to the worker's port completes
whenever the host is reachable, even while the process is busy or stopped (the kernel
accepts into the listen backlog), and never while the link is down.

``Reachability`` probes, from one background thread, the addresses a waiting driver
watches: a connection opened and closed at once, about every ``PROBE_S``. An address is
unreachable once no probe of it has completed for the given number of seconds since it
was first watched. Addresses nobody watched for a while are dropped, so an idle driver
sends nothing.
"""

from __future__ import annotations

import concurrent.futures
import socket
import ssl
import threading
import time
from collections.abc import Iterable

from distributed.comm.addressing import parse_host_port

__all__ = ["Reachability"]

#: How often each watched address is probed.
PROBE_S = 0.5
#: How long one probe may take to connect (a SYN lost to a full queue is resent after 1 s).
CONNECT_S = 2.0
#: An address not watched for this long is no longer probed.
FORGET_S = 5.0


class Reachability:
    """Background TCP probes of the addresses a driver waits on."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        #: For ``tls://`` addresses: a probe completes the TLS handshake too, so a TLS
        #: worker does not log every probe as a failed handshake.
        self._tls = tls
        self._lock = threading.Lock()
        self._last_ok: dict[str, float] = {}  # address -> last probe that connected
        self._watched: dict[str, float] = {}  # address -> last time a waiter asked
        self._probing: set[str] = set()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(8, "hybridflow-reach")

    def watch(self, addresses: Iterable[str]) -> None:
        """Someone waits on these addresses now: keep probing them."""
        now = time.monotonic()
        with self._lock:
            for address in addresses:
                self._last_ok.setdefault(address, now)  # counted from the first watch
                self._watched[address] = now
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="hybridflow-reachability", daemon=True
                )
                self._thread.start()

    def unreachable_for(self, address: str) -> float:
        """Seconds since ``address`` last answered a probe (0 when it did just now or is
        not watched)."""
        with self._lock:
            last = self._last_ok.get(address)
        return 0.0 if last is None else max(0.0, time.monotonic() - last)

    def answered(self, address: str) -> None:
        """Evidence that ``address`` is reachable now (a reply came from it)."""
        with self._lock:
            if address in self._last_ok:
                self._last_ok[address] = time.monotonic()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                for address in [a for a, t in self._watched.items() if now - t > FORGET_S]:
                    del self._watched[address]
                    self._last_ok.pop(address, None)
                due = [a for a in self._watched if a not in self._probing]
                self._probing.update(due)
            for address in due:
                try:
                    self._pool.submit(self._probe, address)
                except RuntimeError:  # closed meanwhile
                    return
            self._wake.wait(PROBE_S)

    def _probe(self, address: str) -> None:
        try:
            host, port = parse_host_port(address.split("://", 1)[-1])
        except ValueError:  # not a host:port address (inproc://...): nothing to probe
            self.answered(address)
            with self._lock:
                self._probing.discard(address)
            return
        try:
            with socket.create_connection((host, port), CONNECT_S) as sock:
                if self._tls is not None and address.startswith("tls://"):
                    with self._tls.wrap_socket(sock, server_hostname=None):
                        pass
                self.answered(address)
        except ConnectionRefusedError:  # the host answered (its process is gone: a death)
            self.answered(address)
        except OSError:  # no answer within CONNECT_S, or no route: not reachable now
            pass
        finally:
            with self._lock:
                self._probing.discard(address)
