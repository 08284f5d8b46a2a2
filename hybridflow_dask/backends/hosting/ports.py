"""A free port for the rendezvous (``MASTER_PORT``), asked where the ranks live."""

from __future__ import annotations

import socket

__all__ = ["find_free_port"]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host``: the address the rendezvous (``MASTER_ADDR``) will use.

    Binding ``host`` alone, never the wildcard address, so not even for this instant does
    the probe open a port on every interface of the machine.
    """
    host = host.strip("[]")  # an IPv6 address as URLs write it
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return sock.getsockname()[1]
