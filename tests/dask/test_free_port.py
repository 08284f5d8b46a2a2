"""Rendezvous ports are probed on the rank's own host address, never on every interface."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from hybridflow_dask.backends.base import Slot
from hybridflow_dask.backends.dask.internals import workers_of
from hybridflow_dask.backends.dask.worker.tasks import worker_port
from hybridflow_dask.backends.hosting import find_free_port
from hybridflow_dask.backends.local import LocalBackend

WILDCARDS = {"", "0.0.0.0", "::", "::0"}


def test_the_port_found_is_free_on_that_host():
    port = find_free_port("127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        assert sock.getsockname() == ("127.0.0.1", port)


def test_an_ipv6_host_is_probed_as_ipv6():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        port = find_free_port("[::1]")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", port))


@pytest.fixture
def binds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host part of every address a ``socket.socket`` is bound to from now on."""
    seen: list[str] = []
    real = socket.socket.bind

    def bind(self, address):
        seen.append(address[0] if isinstance(address, tuple) else address)
        return real(self, address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    return seen


def test_no_caller_binds_the_wildcard_address(binds):
    find_free_port()
    find_free_port("127.0.0.1")
    worker_port(SimpleNamespace(address="tcp://127.0.0.1:40000"))
    worker_port(SimpleNamespace(address="tls://127.0.0.1:40001"))
    with LocalBackend() as local:
        local.free_port(Slot(0, "local", "127.0.0.1"))
    assert binds == ["127.0.0.1"] * 5
    assert not WILDCARDS & set(binds)


def test_a_dask_worker_probes_the_host_of_its_own_address(hf_dask_backend):
    client = hf_dask_backend.client
    address = next(iter(workers_of(client)))
    port = client.run(worker_port, workers=[address])[address]
    assert 0 < port < 65536
