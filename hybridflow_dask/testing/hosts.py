"""Several hosts on one machine: a Dask cluster across Linux network namespaces.

``Hosts(n)`` makes what a user with ``n`` machines has: each host is a network namespace
with its own address on one bridge (and, by default, its own PID namespace, as in a
container, so no same-host shortcut between processes is possible), the scheduler runs in
a namespace of its own under the standard ``dask scheduler`` launcher, and every host runs
``dask worker`` with its nanny. The driver stays in the machine's own namespace and
reaches them over a veth link of its own (``driver_link``), so the bytes a driver moves
can be counted on that link::

    with Hosts(2, nworkers=1) as hosts:
        backend = DaskBackend(address=hosts.scheduler_address)
        ...
        hosts.cut(1)        # host 1's link down: a partition
        hosts.heal(1)
        hosts.kill_host(0)  # every process of host 0 at once

Addresses come from the benchmark range 198.18.0.0/15 (RFC 2544), one /24 per instance,
and only inside namespaces this object made. Names carry the process id and a counter,
so several instances (and several test processes) may exist at once. Everything it
starts is stopped by the pids it started (the PID namespace's init, which takes every
process of the host with it), and every namespace and link it made is removed on exit,
also when the body raised. Needs root and ``ip`` (iproute2): ``missing()`` says which
is absent, and the ``hf_hosts`` fixture skips with that reason.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Host", "Hosts", "missing", "sweep_leftovers"]

logger = logging.getLogger(__name__)

#: The range every address comes from (RFC 2544's benchmark range): 512 /24 subnets.
SUBNETS = [f"198.{18 + i // 256}.{i % 256}" for i in range(512)]
#: Serializes the choice of a subnet between processes of this machine.
LOCK_FILE = Path("/run/lock/hybridflow-hosts.lock")
#: How long the launchers may take to come up.
START_TIMEOUT_S = 60.0
SCHEDULER_PORT = 8786
DASHBOARD_PORT = 8787

_counter = itertools.count()


def missing() -> str | None:
    """Why hosts cannot be made here (not root, no ``ip``, no ``unshare``), or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run the tests as root, as CI does)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return None


@dataclass
class Host:
    """One host: its namespace, address, link (the root-side end of its veth) and the
    launcher process running in it."""

    index: int
    netns: str
    address: str
    link: str
    process: subprocess.Popen | None = None
    log: Path | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Hosts:
    """``n`` worker hosts and a scheduler host, each a network namespace on one bridge.

    ``nworkers``: worker processes per host (``dask worker --nworkers``), each with its
    nanny. ``pid_namespace``: run each host's launcher in its own PID namespace
    (``unshare --pid --fork --mount-proc``), so its processes are invisible to the others.
    ``env``: extra environment for every launcher (e.g. ``DASK_HYBRIDFLOW__...`` settings
    or ``DASK_DISTRIBUTED__...`` ones); ``worker_args``/``scheduler_args``: extra
    command-line arguments. ``security``: a ``distributed.security.Security`` whose
    files the launchers use (TLS between every host; the scheduler address is then
    ``tls://``). The launchers are the ``dask`` command next to this Python (the same
    environment, so the same hybridflow_dask).
    """

    def __init__(
        self,
        n: int,
        *,
        nworkers: int = 1,
        nthreads: int = 1,
        pid_namespace: bool = True,
        env: Mapping[str, str] | None = None,
        worker_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        security: Any = None,
        logs: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"Hosts(n) needs at least one host, got n={n!r}")
        if not isinstance(nworkers, int) or nworkers < 1:
            raise ValueError(f"nworkers must be a positive int, got {nworkers!r}")
        self.n = n
        self.nworkers = nworkers
        self.nthreads = nthreads
        self.pid_namespace = pid_namespace
        self.env = dict(env or {})
        self.worker_args = list(worker_args)
        self.scheduler_args = list(scheduler_args)
        self.security = security
        # the pid (5 base-36 digits) and a counter: unique on this machine, and a later run
        # can tell whether the process that made a namespace is still alive
        self.tag = _base36(os.getpid(), 5) + _base36(next(_counter) % 36, 1)
        self.bridge = f"hf{self.tag}br"
        self.driver_link = f"hf{self.tag}d"
        self.subnet = ""
        self.scheduler: Host | None = None
        self.hosts: list[Host] = []
        self._made_links: list[str] = []
        self._made_netns: list[str] = []
        self._logs = Path(logs) if logs is not None else None
        self._started = False
        self._blackhole = ""

    # -- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the network, start the scheduler and every host's workers, and wait until
        the scheduler lists ``n * nworkers`` workers."""
        why = missing()
        if why is not None:
            raise RuntimeError(f"cannot make hosts: {why}")
        if self._started:
            return
        self._started = True
        atexit.register(self.close)  # a driver that exits without close(): clean up still
        try:
            sweep_leftovers()
            self._make_network()
            self._start_scheduler()
            for host in self.hosts:
                self._start_host(host)
            self.wait_for_workers(self.n * self.nworkers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process this object started, then remove its namespaces and links.
        Idempotent."""
        atexit.unregister(self.close)
        for host in [*self.hosts, *([self.scheduler] if self.scheduler else [])]:
            self._stop(host)
        for netns in reversed(self._made_netns):
            _run(["ip", "netns", "del", netns], check=False)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        self._made_netns.clear()
        for link in reversed(self._made_links):
            _run(["ip", "link", "del", link], check=False)
        self._made_links.clear()
        if self._blackhole:
            _run(
                ["ip", "route", "del", "blackhole", self._blackhole, "metric", "4000"], check=False
            )
            self._blackhole = ""

    # -- what tests use ----------------------------------------------------------------------

    @property
    def protocol(self) -> str:
        return "tls" if self.security is not None else "tcp"

    @property
    def scheduler_address(self) -> str:
        assert self.scheduler is not None, "Hosts.start() first"
        return f"{self.protocol}://{self.scheduler.address}:{SCHEDULER_PORT}"

    @property
    def dashboard_address(self) -> str:
        assert self.scheduler is not None, "Hosts.start() first"
        return f"http://{self.scheduler.address}:{DASHBOARD_PORT}"

    @property
    def driver_address(self) -> str:
        """The root namespace's address on the hosts' network."""
        return f"{self.subnet}.254"

    def host_of(self, address: str) -> int:
        """Which host a worker address (``tcp://198.18.x.y:port``) belongs to."""
        ip = address.split("://", 1)[-1].rsplit(":", 1)[0]
        for host in self.hosts:
            if host.address == ip:
                return host.index
        raise ValueError(f"{address!r} is not on any of these hosts ({self.addresses})")

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: its processes live on, unreachable (a partition)."""
        _run(["ip", "link", "set", self.hosts[i].link, "down"])

    def heal(self, i: int) -> None:
        """Bring host ``i``'s link back up."""
        _run(["ip", "link", "set", self.hosts[i].link, "up"])

    def cut_driver(self) -> None:
        """Cut the driver's own link (its bridge-side end down: the root namespace's end
        loses its carrier, so its route stays and packets are dropped, never rerouted):
        it reaches neither scheduler nor workers."""
        _run(["ip", "link", "set", f"{self.driver_link}p", "down"])

    def heal_driver(self) -> None:
        _run(["ip", "link", "set", f"{self.driver_link}p", "up"])

    def rate_limit(self, i: int, rate: str, burst: str = "256kb", latency: str = "500ms") -> None:
        """Limit host ``i``'s link to ``rate`` (``tc``'s ``tbf``, e.g. ``"200mbit"``), both
        ways: on its root-side end (traffic to the host) and on its ``eth0`` (from it)."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        host = self.hosts[i]
        _run(["tc", "qdisc", "replace", "dev", host.link, *tbf])
        _run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0", *tbf])

    def clear_rate_limit(self, i: int) -> None:
        host = self.hosts[i]
        _run(["tc", "qdisc", "del", "dev", host.link, "root"], check=False)
        _run(
            ["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
            check=False,
        )

    def kill_host(self, i: int) -> None:
        """Every process of host ``i`` at once (SIGKILL to its PID namespace's init, or to
        its launcher's process group without one), as when a machine is lost."""
        self._stop(self.hosts[i])

    def restart_host(self, i: int) -> None:
        """Start host ``i``'s workers again (after ``kill_host``), as a replaced machine."""
        host = self.hosts[i]
        self._stop(host)
        self._start_host(host)

    def driver_bytes(self) -> dict[str, int]:
        """Bytes through the driver's link so far: ``{"sent", "received"}`` by the driver."""
        stats = Path("/sys/class/net") / self.driver_link / "statistics"
        return {
            "sent": int((stats / "tx_bytes").read_text()),
            "received": int((stats / "rx_bytes").read_text()),
        }

    def link_bytes(self, i: int) -> dict[str, int]:
        """Bytes host ``i`` sent and received on its link so far."""
        stats = Path("/sys/class/net") / self.hosts[i].link / "statistics"
        # the root-side end: what it transmits, the host receives
        return {
            "sent": int((stats / "rx_bytes").read_text()),
            "received": int((stats / "tx_bytes").read_text()),
        }

    def exec(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``i``'s network namespace and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[i].netns, *argv], **kwargs)

    def wait_for_workers(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """Until the scheduler lists ``count`` workers (raises ``TimeoutError`` naming the
        hosts whose launcher died, with their logs' tails)."""
        from distributed import Client

        from ..backends.dask.internals import workers_of

        deadline = time.monotonic() + timeout
        self._wait_for_port(self.scheduler, SCHEDULER_PORT, deadline)
        with Client(
            self.scheduler_address, security=self.security, timeout=timeout, set_as_default=False
        ) as client:
            while len(workers_of(client)) < count:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"hosts: fewer than {count} workers after {timeout}s{self._deaths()}"
                    )
                self._raise_if_dead()
                time.sleep(0.1)

    # -- network -------------------------------------------------------------------------

    def _make_network(self) -> None:
        with _subnet_lock():
            used = _used_subnets()
            free = next((s for s in SUBNETS if s not in used), None)
            if free is None:
                raise RuntimeError("every /24 of 198.18.0.0/15 is in use on this machine")
            self.subnet = free
            self._link(["ip", "link", "add", self.bridge, "type", "bridge"], self.bridge)
            _run(["ip", "link", "set", self.bridge, "up"])
            peer = f"{self.driver_link}p"
            self._link(
                ["ip", "link", "add", self.driver_link, "type", "veth", "peer", "name", peer],
                self.driver_link,
            )
            _run(["ip", "link", "set", peer, "master", self.bridge, "up"])
            _run(["ip", "addr", "add", f"{self.driver_address}/24", "dev", self.driver_link])
            _run(["ip", "link", "set", self.driver_link, "up"])
            # should the link's route ever go, this subnet's packets are dropped here rather
            # than sent out of the machine by its default route
            _run(["ip", "route", "replace", "blackhole", f"{free}.0/24", "metric", "4000"])
            self._blackhole = f"{free}.0/24"
        self.scheduler = self._make_host(0, "s", f"{self.subnet}.1")
        self.hosts = [self._make_host(i, f"h{i}", f"{self.subnet}.{11 + i}") for i in range(self.n)]
        self._write_name_files()

    def _write_name_files(self) -> None:
        """Each namespace's own ``/etc/hosts`` and ``/etc/resolv.conf`` (``ip netns exec``
        mounts ``/etc/netns/NAME/*`` over ``/etc``): every host's address has a name, and
        there is no DNS server to wait for. Without them a lookup (torch's c10d asks for
        its peer's name) waits 10 s for the machine's DNS server, unreachable from here."""
        names = "".join(f"{h.address} {h.netns}\n" for h in [self.scheduler, *self.hosts] if h)
        for host in [self.scheduler, *self.hosts]:
            assert host is not None
            folder = Path("/etc/netns") / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            # no nameserver: lookups ask 127.0.0.1, which refuses at once
            (folder / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def _make_host(self, index: int, suffix: str, address: str) -> Host:
        netns = f"hf-{self.tag}-{suffix}"
        link = f"hf{self.tag}{suffix}"
        _run(["ip", "netns", "add", netns])
        self._made_netns.append(netns)
        self._link(
            ["ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns],
            link,
        )
        _run(["ip", "link", "set", link, "master", self.bridge, "up"])
        inside = ["ip", "netns", "exec", netns]
        _run([*inside, "ip", "addr", "add", f"{address}/24", "dev", "eth0"])
        _run([*inside, "ip", "link", "set", "eth0", "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        _run([*inside, "ip", "route", "add", "default", "via", self.driver_address])
        return Host(index, netns, address, link)

    def _link(self, argv: list[str], name: str) -> None:
        if len(name) > 15:  # the kernel's IFNAMSIZ - 1
            raise RuntimeError(f"interface name {name!r} is longer than 15 characters")
        _run(argv)
        self._made_links.append(name)

    # -- processes -----------------------------------------------------------------------

    def _launcher(self) -> list[str]:
        dask = Path(sys.executable).with_name("dask")
        return [str(dask)] if dask.exists() else [sys.executable, "-m", "dask"]

    def _start_scheduler(self) -> None:
        host = self.scheduler
        assert host is not None
        argv = [
            *self._launcher(),
            "scheduler",
            "--host",
            host.address,
            "--port",
            str(SCHEDULER_PORT),
            "--dashboard-address",
            f"{host.address}:{DASHBOARD_PORT}",
            "--protocol",
            self.protocol,
            *self._tls_args(),
            *self.scheduler_args,
        ]
        self._spawn(host, argv, "scheduler")

    def _start_host(self, host: Host) -> None:
        argv = [
            *self._launcher(),
            "worker",
            self.scheduler_address,
            "--host",
            host.address,
            "--nworkers",
            str(self.nworkers),
            "--nthreads",
            str(self.nthreads),
            "--name",
            f"h{host.index}",
            "--no-dashboard",
            *self._tls_args(),
            *self.worker_args,
        ]
        self._spawn(host, argv, f"h{host.index}")

    def _tls_args(self) -> list[str]:
        if self.security is None:
            return []
        sec = self.security
        return [
            "--tls-ca-file",
            sec.tls_ca_file,
            "--tls-cert",
            sec.tls_scheduler_cert or sec.tls_worker_cert or sec.tls_client_cert,
            "--tls-key",
            sec.tls_scheduler_key or sec.tls_worker_key or sec.tls_client_key,
        ]

    def _spawn(self, host: Host, argv: list[str], name: str) -> None:
        wrap = ["ip", "netns", "exec", host.netns]
        if self.pid_namespace:
            # unshare forks the host's init (PID 1 of a new namespace, with its own /proc);
            # --kill-child: if unshare dies, the init and so the whole host die with it.
            wrap += ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        env = {**os.environ, **self.env}
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # torch's gloo: the host's own link
        # what the driver imports, the workers can (classes defined in test modules), as
        # multiprocessing's spawn does for a LocalCluster's workers
        paths = [p for p in sys.path if p and Path(p).is_dir()]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if self._logs is not None:
            self._logs.mkdir(parents=True, exist_ok=True)
            host.log = self._logs / f"{self.tag}-{name}.log"
            out: Any = host.log.open("ab")
        else:
            out = subprocess.DEVNULL
        try:
            host.process = subprocess.Popen(
                [*wrap, *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()

    def _stop(self, host: Host) -> None:
        """SIGKILL the host's PID-namespace init (which ends everything in it) and its
        launcher, by the pids started here; without a PID namespace, the launcher's own
        process group (``start_new_session``: it holds every process the launcher made)."""
        process = host.process
        if process is None:
            return
        if process.poll() is None:
            if self.pid_namespace:
                for pid in _children(process.pid):  # the namespace's init
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        host.process = None

    def _wait_for_port(self, host: Host | None, port: int, deadline: float) -> None:
        assert host is not None
        while True:
            with contextlib.suppress(OSError), socket.create_connection((host.address, port), 0.5):
                return
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"hosts: the scheduler at {host.address}:{port} never answered{self._deaths()}"
                )
            time.sleep(0.05)

    def _raise_if_dead(self) -> None:
        for host in [self.scheduler, *self.hosts]:
            if host is not None and host.process is not None and host.process.poll() is not None:
                raise RuntimeError(f"hosts: the launcher in {host.netns} exited{self._deaths()}")

    def _deaths(self) -> str:
        tails = []
        for host in [self.scheduler, *self.hosts]:
            if host is not None and host.log is not None and host.log.exists():
                tail = host.log.read_text(errors="replace")[-1500:]
                tails.append(f"\n--- {host.netns} ({host.log}) ---\n{tail}")
        return "".join(tails) or " (pass logs= to keep the launchers' output)"


def sweep_leftovers() -> None:
    """Remove what a process of this module left behind when it was killed before it could
    clean up (SIGKILL, a timeout): namespaces and links whose tag names a dead pid, and the
    processes still running in those namespaces (started by that process)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        match = re.match(r"hf-([0-9a-z]{6})-(s|h\d+)\b", line)
        if match is None or _owner_alive(match.group(1)):
            continue
        netns = line.split()[0]
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for name in sorted(
        set(re.findall(r"^\d+: (hf[0-9a-z]{6}(?:br|dp|d|s|h\d+))[@:]", links, re.M))
    ):
        if not _owner_alive(name[2:8]):
            _run(["ip", "link", "del", name], check=False)


def _owner_alive(tag: str) -> bool:
    return Path(f"/proc/{int(tag[:5], 36)}").exists()


def _base36(value: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(width):
        value, digit = divmod(value, 36)
        out = digits[digit] + out
    return out


def _run(argv: list[str], check: bool = True) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _used_subnets() -> set[str]:
    """The /24s of 198.18.0.0/15 that an address of the root namespace already uses."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            ip = parts[parts.index("inet") + 1].split("/")[0]
            if ip.startswith(("198.18.", "198.19.")):
                used.add(ip.rsplit(".", 1)[0])
    return used


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with LOCK_FILE.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
