"""A scheduler that dies is a named error within ``hybridflow.scheduler-timeout``, not a
30 s wait for the client's reconnect followed by "Future cancelled for reason: unknown".

The cluster here is Dask's own command-line scheduler and worker, as processes of their
own, so the test can kill the scheduler for real; the fixture stops whatever is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, SchedulerLostError

# Every test here starts processes (see tests/conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


class Pinger(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def ping(self):
        return "pong"

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def ping_later(self):
        return "pong"


@pytest.fixture
def cli_cluster(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A ``dask scheduler`` and one ``dask worker`` on loopback; both stopped afterwards."""
    scheduler_file = tmp_path / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    scheduler = subprocess.Popen(
        [
            *(sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"),
            *("--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file)),
        ],
        **quiet,
    )
    processes = [scheduler]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.1)
        time.sleep(0.2)  # (the file is written whole before the scheduler listens)
        address = json.loads(scheduler_file.read_text())["address"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        processes.append(
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "distributed.cli.dask_worker", address),
                    *("--nworkers", "1", "--nthreads", "1", "--host", "127.0.0.1"),
                    "--no-dashboard",
                ],
                env=env,
                **quiet,
            )
        )
        yield address, scheduler
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(30)


@pytest.fixture
def attached(cli_cluster):
    """A backend attached to the command-line cluster, a group answering on it, and the
    scheduler's process (to kill); a lost scheduler is given up on after 2 s."""
    address, scheduler = cli_cluster
    with dask.config.set({"hybridflow.scheduler-timeout": "2s"}):
        backend = DaskBackend(address=address)
        try:
            backend.client.wait_for_workers(1, timeout=60)
            group = hf.WorkerGroup(hf.ResourcePool([1]), Pinger, backend=backend)
            assert group.ping() == ["pong"]
            yield address, group, scheduler
        finally:
            backend.shutdown()


def test_a_killed_scheduler_is_a_scheduler_lost_error_within_the_timeout(attached):
    address, group, scheduler = attached
    assert hf.get(group.ping_later()) == ["pong"]
    scheduler.kill()
    scheduler.wait(10)
    time.sleep(1.0)  # the client notices the broken connection
    start = time.monotonic()
    with pytest.raises(SchedulerLostError, match=address) as caught:
        group.ping()
    assert time.monotonic() - start < 5
    assert "lost with it" in str(caught.value)
    assert isinstance(caught.value, ConnectionError)


def test_a_wait_under_way_when_the_scheduler_dies_ends_with_the_named_error(attached):
    _, group, scheduler = attached
    scheduler.kill()
    scheduler.wait(10)
    start = time.monotonic()
    with pytest.raises(SchedulerLostError):
        hf.get(group.ping_later())  # sent at once, then the scheduler is missed
    assert time.monotonic() - start < 8
