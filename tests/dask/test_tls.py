"""TLS end to end: a backend's own cluster speaks only ``tls://``, and attaching to it needs
the credentials; without them the error says TLS and what to check."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
import torch
from distributed import Client
from distributed.security import Security

import hybridflow_dask as hf
from hybridflow_dask.backends import SchedulerUnreachableError
from hybridflow_dask.backends.dask.driver import backend as dask_backend
from hybridflow_dask.backends.dask.driver import connect
from hybridflow_dask.backends.dask.driver.lane import Lane, read_replies
from hybridflow_dask.backends.dask.internals import workers_of
from hybridflow_dask.backends.dask.wire.lane_protocol import lane_host
from hybridflow_dask.backends.dask.worker.lane_server import LaneServer


class Doubler(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def double(self, x):
        return 2 * x


def self_signed(folder: Path, name: str) -> Security:
    """What ``Security.temporary()`` makes (one self-signed certificate for every role),
    from the ``openssl`` command, so the tests need no ``cryptography``."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    request = f"openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN={name}".split()
    subprocess.run(
        [*request, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True
    )
    key_text, cert_text = key.read_text(), cert.read_text()
    roles = ("client", "scheduler", "worker")
    return Security(
        require_encryption=True,
        tls_ca_file=cert_text,
        **{f"tls_{role}_cert": cert_text for role in roles},
        **{f"tls_{role}_key": key_text for role in roles},
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def security(certs: Path) -> Security:
    return self_signed(certs, "cluster")


@pytest.fixture(scope="module")
def tls_backend(security: Security) -> Iterator[dask_backend.DaskBackend]:
    backend = dask_backend.DaskBackend(security=security, n_workers=1)
    try:
        yield backend
    finally:
        backend.shutdown()


@pytest.fixture
def short_connect() -> Iterator[None]:
    with dask.config.set({"hybridflow.connect-timeout": "3s"}):
        yield


def call_double(backend: dask_backend.DaskBackend) -> list[int]:
    group = hf.WorkerGroup(hf.ResourcePool([1]), hf.ClassWithInitArgs(Doubler), backend=backend)
    try:
        return group.double(21)
    finally:
        group.shutdown()


def host_port(address: str) -> str:
    return address.partition("://")[2]


@pytest.mark.cluster
def test_an_owned_cluster_speaks_only_tls(tls_backend):
    address = tls_backend.client.scheduler.address
    assert address.startswith("tls://")
    workers = workers_of(tls_backend.client)
    assert workers and all(w.startswith("tls://") for w in workers)
    assert call_double(tls_backend) == [42]


@pytest.mark.cluster
@pytest.mark.parametrize("scheme", ["tls://", "tcp://"])
def test_a_client_without_credentials_cannot_connect(tls_backend, scheme):
    address = scheme + host_port(tls_backend.client.scheduler.address)
    client = Client.__new__(Client)
    try:
        with pytest.raises((OSError, TypeError)):
            client.__init__(address, timeout=3, set_as_default=False)
    finally:
        connect._discard(client)


@pytest.mark.cluster
def test_attaching_without_credentials_says_tls(tls_backend, short_connect):
    address = tls_backend.client.scheduler.address
    with pytest.raises(SchedulerUnreachableError, match="TLS") as caught:
        dask_backend.DaskBackend(address=address)
    assert "security=" in str(caught.value) and "tls_client_cert" in str(caught.value)
    # The same port as a plain tcp:// address: the error says the scheduler speaks TLS.
    with pytest.raises(SchedulerUnreachableError, match=r"speaks TLS.*tls://"):
        dask_backend.DaskBackend(address="tcp://" + host_port(address))


@pytest.mark.cluster
def test_credentials_that_do_not_fit_say_tls(tls_backend, security, certs, short_connect):
    address = tls_backend.client.scheduler.address
    with pytest.raises(SchedulerUnreachableError, match=r"TLS.*tcp://.*tls://"):
        dask_backend.DaskBackend(address="tcp://" + host_port(address), security=security)
    stranger = self_signed(certs, "stranger")
    with pytest.raises(SchedulerUnreachableError, match=r"TLS handshake failed.*tls_ca_file"):
        dask_backend.DaskBackend(address=address, security=stranger)


@pytest.mark.cluster
def test_attaching_with_the_same_security_works(tls_backend, security):
    address = tls_backend.client.scheduler.address
    with dask_backend.DaskBackend(address=address, security=security) as attached:
        assert attached.client.scheduler.address == address
        assert call_double(attached) == [42]
    assert call_double(tls_backend) == [42]  # the attached backend left the cluster running


@pytest.mark.cluster
def test_a_given_client_or_cluster_keeps_its_own_security(tls_backend, security):
    with pytest.raises(ValueError, match="carries its own"):
        dask_backend.DaskBackend(cluster=tls_backend.cluster, security=security)
    with pytest.raises(ValueError, match="carries its own"):
        dask_backend.DaskBackend(client=tls_backend.client, security=security)


def test_security_true_without_cryptography_says_what_is_missing(monkeypatch):
    def no_cluster(*args, **kwargs):
        raise AssertionError("no cluster should start")

    monkeypatch.setattr(dask_backend, "start_local_cluster", no_cluster)
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # as if it were not installed
    with pytest.raises(ImportError, match="cryptography"):
        dask_backend.DaskBackend(security=True, n_workers=1)


@pytest.mark.cluster
def test_security_true_makes_temporary_credentials():
    with dask_backend.DaskBackend(security=True, n_workers=1) as backend:
        assert backend.client.scheduler.address.startswith("tls://")
        assert call_double(backend) == [42]


@pytest.mark.cluster
def test_calls_on_a_tls_cluster_take_a_lane_that_runs_tls(tls_backend):
    """The fast path is not given up on TLS: blocking calls take the socket lane, over TLS
    with the cluster's certificates, and a 2 MiB argument and reply cross it whole."""
    group = hf.WorkerGroup(hf.ResourcePool([1]), hf.ClassWithInitArgs(Doubler), backend=tls_backend)
    try:
        data = torch.arange(1 << 19, dtype=torch.float32)
        (back,) = group.double(data)
        assert torch.equal(back, data * 2)
        lanes = [lane for lane in tls_backend._direct._lanes.values() if lane is not None]
        assert lanes and all(lane.tls for lane in lanes)
    finally:
        group.shutdown()


@pytest.mark.cluster
def test_a_lane_peer_without_the_clusters_certificate_is_refused(tls_backend, security, certs):
    """Knowing the lane's port and a valid token is not enough without a certificate the
    cluster's CA signed: the TLS handshake fails before any byte of the lane is read."""
    group = hf.WorkerGroup(hf.ResourcePool([1]), hf.ClassWithInitArgs(Doubler), backend=tls_backend)
    try:
        assert group.double(1) == [2]
        (slot,) = [ref.slot for ref in group._refs]
        port, token_id, token, local = tls_backend._direct._ask(
            "hf_lane", slot, 10, driver=tls_backend.driver_id
        )
        assert local is None  # a TLS cluster's lanes are TCP (and TLS) only
        stranger = self_signed(certs, "lane-stranger").get_connection_args("client")
        with pytest.raises((ssl.SSLError, OSError)):
            Lane(
                lane_host(slot.address),
                port,
                (token_id, token),
                lambda *_: None,
                lambda _: None,
                tls=stranger["ssl_context"],
            )
        assert group.double(2) == [4]  # the worker's lane still serves its drivers
    finally:
        group.shutdown()


def test_a_tls_lanes_replies_are_read_by_their_waiting_caller(security):
    """Replies of several TLS records each, more of them than the lane's buffer holds at
    once, all read in the caller's thread: what is decrypted but not yet read is taken
    in before the caller waits on the socket again."""

    def handle(msg, reply):
        answer = {"id": msg["id"], "n": msg["n"], "pad": b"p" * 40_000}
        threading.Thread(target=reply, args=(answer,)).start()

    server = LaneServer("127.0.0.1", handle, tls=security.get_listen_args("worker")["ssl_context"])
    got: list = []
    lane = Lane(
        "127.0.0.1",
        server.port,
        server.token_for("driver-a"),
        on_reply=lambda ctx, reply: got.append((reply["n"], threading.get_ident())),
        on_broken=lambda pending: None,
        same_host=False,
        tls=security.get_connection_args("client")["ssl_context"],
    )
    try:
        assert lane.tls and lane.callers_may_read
        for n in range(5):
            lane.request({"op": "call", "n": n}, n, read_by_caller=True)
        read_replies([lane], lambda: len(got) == 5, 10.0)
        assert sorted(n for n, _ in got) == list(range(5))
        assert {thread for _, thread in got} == {threading.get_ident()}
    finally:
        lane.close()
        server.close()
