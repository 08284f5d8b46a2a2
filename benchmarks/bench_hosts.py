"""One host against several: the same calls on a loopback cluster and across hosts made of
network namespaces (``hybridflow_dask.testing.hosts``), plain TCP and TLS.

Per configuration, one rank per host (two ranks on the single host):

- no-op ONE_TO_ALL call, median of ``--calls``;
- DP_COMPUTE_PROTO identity round trip of 64 and 256 MiB (2 x bytes / s, median of 3);
- a non-blocking 64 MiB chain A -> B between two groups (A's DataProtoFuture into B);
- the time to a ready group (``WorkerGroup`` built and its first call answered);
- raw TCP, one stream, one way, 256 MiB with plain Python sockets between the same two
  hosts (loopback for the single host), measured in the same run: the link's speed.

Needs root and iproute2 for the namespace hosts. Prints a table and writes JSON to
``--out`` (default ``out/bench_hosts.json``, an ignored folder)::

    sudo .venv/bin/python benchmarks/bench_hosts.py [--hosts 1 2 4] [--tls] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import dask
import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.testing.hosts import Hosts

MiB = 1 << 20

RAW_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(4 * 2**20); view = memoryview(buf); n = 0
start = None
while True:
    k = c.recv_into(view)
    if not k: break
    if start is None: start = time.perf_counter()
    n += k
print(n, time.perf_counter() - start, flush=True)
"""
RAW_SENDER = """
import socket, sys
data = bytes(int(sys.argv[3]))
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
for _ in range(int(sys.argv[4])): c.sendall(data)
c.close()
"""


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def noop(self):
        return None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data):
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data):
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data):
        return hf.DataProto.from_dict({"n": torch.full((len(data),), data.batch["x"].shape[1])})


def batch(mib: int) -> hf.DataProto:
    rows = 64
    return hf.DataProto.from_dict({"x": torch.ones(rows, mib * MiB // 4 // rows)})


def median_time(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(backend: DaskBackend, nodes: list[int], calls: int, sizes: list[int]) -> dict:
    out: dict[str, Any] = {}
    pool = hf.ResourcePool(nodes)
    start = time.perf_counter()
    group = hf.WorkerGroup(pool, Echo, backend=backend)
    group.noop()
    out["ready_s"] = time.perf_counter() - start
    for _ in range(20):
        group.noop()
    out["noop_ms"] = median_time(group.noop, calls) * 1e3
    for mib in sizes:
        data = batch(mib)
        group.identity(data)  # warm
        seconds = median_time(lambda d=data: group.identity(d), 3)
        out[f"dp_{mib}mib_gbps"] = 2 * mib * MiB / seconds / 1e9
    consumer = hf.WorkerGroup(hf.ResourcePool(nodes), Echo, backend=backend)
    data = batch(64)
    consumer.consume(group.produce(data))  # warm
    out["chain_64mib_s"] = median_time(lambda: consumer.consume(group.produce(data)), 3)
    consumer.shutdown()
    group.shutdown()
    return out


def raw_tcp(hosts: Hosts | None, mib: int = 256) -> float:
    """GB/s of one TCP stream, one way, between hosts 0 and 1 (or over loopback)."""
    chunk, count = 16 * MiB, mib // 16
    if hosts is None:
        recv_cmd = [sys.executable, "-c", RAW_RECEIVER, "127.0.0.1", "0"]
        address = "127.0.0.1"
    else:
        address = hosts.hosts[1].address
        recv_cmd = ["ip", "netns", "exec", hosts.hosts[1].netns, sys.executable, "-c"]
        recv_cmd += [RAW_RECEIVER, address, "0"]
    port = 47000
    recv_cmd[-1] = str(port)
    best = []
    for _ in range(3):
        receiver = subprocess.Popen(recv_cmd, stdout=subprocess.PIPE, text=True)
        assert receiver.stdout is not None
        receiver.stdout.readline()
        send_cmd = [sys.executable, "-c", RAW_SENDER, address, str(port), str(chunk), str(count)]
        if hosts is not None:
            send_cmd = ["ip", "netns", "exec", hosts.hosts[0].netns, *send_cmd]
        subprocess.run(send_cmd, check=True)
        n, seconds = receiver.stdout.readline().split()
        receiver.wait()
        best.append(int(n) / float(seconds) / 1e9)
    return statistics.median(best)


@contextmanager
def tls_files() -> Iterator[Any]:
    """A temporary self-signed Security whose certificates are files (for the launchers)."""
    from distributed.security import Security

    temp = Security.temporary()
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for name in ("tls_ca_file", "tls_client_cert", "tls_client_key"):
            path = Path(folder) / f"{name}.pem"
            path.write_text(getattr(temp, name))
            paths[name] = str(path)
        yield Security(
            tls_ca_file=paths["tls_ca_file"],
            tls_client_cert=paths["tls_client_cert"],
            tls_client_key=paths["tls_client_key"],
            tls_scheduler_cert=paths["tls_client_cert"],
            tls_scheduler_key=paths["tls_client_key"],
            tls_worker_cert=paths["tls_client_cert"],
            tls_worker_key=paths["tls_client_key"],
            require_encryption=True,
        )


def run_config(n_hosts: int, tls: bool, calls: int, sizes: list[int]) -> dict:
    label = f"{'one host' if n_hosts == 1 else f'{n_hosts} hosts'}{' TLS' if tls else ''}"
    print(f"-- {label}", file=sys.stderr, flush=True)
    with dask.config.set({"hybridflow.fresh-processes": False}):
        if n_hosts == 1:
            security = True if tls else None
            with DaskBackend(n_workers=4, security=security) as backend:
                result = measure(backend, [2], calls, sizes)
            result["raw_tcp_gbps"] = raw_tcp(None)
        else:
            with (
                tls_files() if tls else nullcontext() as sec,
                Hosts(n_hosts, nworkers=2, security=sec) as hosts,
            ):
                with DaskBackend(address=hosts.scheduler_address, security=sec) as backend:
                    result = measure(backend, [1] * n_hosts, calls, sizes)
                result["raw_tcp_gbps"] = raw_tcp(hosts)
    dp = result.get(f"dp_{max(sizes)}mib_gbps")
    if dp:
        result["dp_over_raw"] = dp / result["raw_tcp_gbps"]
    return {"config": label, "hosts": n_hosts, "tls": tls, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tls", action="store_true", help="also run every configuration on TLS")
    parser.add_argument("--quick", action="store_true", help="64 MiB only, 100 no-op calls")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("out/bench_hosts.json"))
    args = parser.parse_args(argv)
    sizes = [64] if args.quick else [64, 256]
    calls = 100 if args.quick else args.calls
    rows = []
    for tls in [False, True] if args.tls else [False]:
        for n in args.hosts:
            rows.append(run_config(n, tls, calls, sizes))
    columns = ["config", "noop_ms", *[f"dp_{m}mib_gbps" for m in sizes]]
    columns += ["chain_64mib_s", "ready_s", "raw_tcp_gbps", "dp_over_raw"]
    print(" | ".join(columns))
    for row in rows:
        cells = [row["config"]] + [f"{row.get(c, float('nan')):.3f}" for c in columns[1:]]
        print(" | ".join(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "when": datetime.now(timezone.utc).isoformat(),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "world_size": "one rank per host (2 on one host)",
    }
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
