"""What a user reads around the values: one report per error, a silent teardown, a quick exit.

Each test reads the logs of a real cluster (the scheduler's and workers' in-memory logs,
or a driver process's stderr) and checks the noise is gone while real trouble (a worker
dying) is still reported.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import dask
import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError


class Faulty(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail(self):
        raise ValueError("a bug in the user's method")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class BrokenInit(hf.Worker):
    def __init__(self):
        if os.environ["RANK"] == "1":  # still building when the driver tears rank 0 down
            time.sleep(0.3)
        raise RuntimeError("cannot build this worker")


def _all_logs(backend: DaskBackend) -> str:
    worker_logs = backend.client.get_worker_logs()
    lines = [msg for logs in worker_logs.values() for _, msg in logs]
    lines += [msg for _, msg in backend.client.get_scheduler_logs()]
    return "\n".join(lines)


@pytest.mark.cluster
@pytest.mark.parametrize("path", ["direct", "task"])
def test_a_user_error_is_reported_once_by_the_driver_and_a_dead_worker_still_shows(path, caplog):
    with dask.config.set({"hybridflow.call-path": path}):
        backend = DaskBackend(n_workers=2)
    try:
        group = hf.WorkerGroup(hf.ResourcePool([2]), Faulty, backend=backend)
        with pytest.raises(ValueError, match="a bug in the user's method"):
            group.fail()
        assert "Compute Failed" not in _all_logs(backend)
        # Real trouble is still reported: a worker that dies is logged by the scheduler
        # and by the backend, which names the lost ranks.
        with caplog.at_level(logging.WARNING, logger="hybridflow_dask"):
            os.kill(group.pid()[0], signal.SIGKILL)
            with pytest.raises(WorkerLostError):
                for _ in range(50):
                    group.pid()
                    time.sleep(0.1)
        deadline = time.monotonic() + 5
        while "left the cluster" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "left the cluster" in caplog.text
        assert "Remove worker" in _all_logs(backend)
    finally:
        backend.shutdown()


@pytest.mark.cluster
@pytest.mark.parametrize("path", ["direct", "task"])
def test_teardown_after_a_failed_constructor_is_silent_and_leaves_nothing(path):
    with dask.config.set({"hybridflow.call-path": path}):
        backend = DaskBackend(n_workers=2)
    try:
        before = backend.client.run_on_scheduler(_task_count)
        for _ in range(3):  # a teardown that finishes at once used to stay on the worker
            try:
                hf.WorkerGroup(hf.ResourcePool([2]), BrokenInit, backend=backend)
            except RuntimeError as exc:  # not kept: its traceback would hold the futures
                assert "cannot build this worker" in str(exc)
            else:
                raise AssertionError("a failing __init__ must raise")
            deadline = time.monotonic() + 10
            while gc.collect() >= 0 and backend.client.run_on_scheduler(_task_count) > before:
                left = backend.client.run_on_scheduler(_task_states)
                assert time.monotonic() < deadline, f"tasks left after a failed __init__: {left}"
                time.sleep(0.1)
        time.sleep(0.5)  # what the scheduler would log comes within its next cycles
        logs = _all_logs(backend)
        assert "lose already computed" not in logs
        assert "timed out waiting for its restrictions" not in logs
        assert "Compute Failed" not in logs
    finally:
        backend.shutdown()


def _task_count(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _task_states(dask_scheduler) -> dict:
    return {str(key): task.state for key, task in dask_scheduler.tasks.items()}


@pytest.mark.cluster
def test_shutdown_is_quick_and_clean(capfd):
    backend = DaskBackend(n_workers=2)
    group = hf.WorkerGroup(hf.ResourcePool([2]), Faulty, backend=backend)
    group.pid()
    start = time.monotonic()
    backend.shutdown()
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    assert "still alive" not in err
    assert elapsed < 3.5, f"shutdown took {elapsed:.1f}s"  # ~0.1-0.2 s quiet; CI is busy


@pytest.mark.cluster
def test_a_program_that_ends_without_shutdown_exits_silently(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(
        textwrap.dedent(
            """
            import hybridflow_dask as hf

            class Echo(hf.Worker):
                @hf.register(hf.Dispatch.ONE_TO_ALL)
                def echo(self, x):
                    return x

            if __name__ == "__main__":
                group = hf.WorkerGroup(hf.ResourcePool([2]), Echo)
                kept = group.execute_all_async("echo", 1)  # results still held at exit
                print(group.echo(7))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[7, 7]"
    for noise in ("left the cluster", "lose already computed", "still alive", "Traceback"):
        assert noise not in done.stderr, done.stderr


class _StandInWorker:
    """Only a worker's ``status`` matters to the filter's decision."""

    def __init__(self, status):
        self.status = status


@pytest.mark.parametrize(
    ("status", "shown"),
    [("running", True), ("closing", False), ("closed", False), ("closing_gracefully", False)],
)
def test_a_heartbeat_error_shows_unless_the_worker_is_closing_stand_in_worker(status, shown):
    from distributed.core import Status

    from hybridflow_dask.backends.dask.worker.plugin import _ClosingHeartbeatFilter

    worker = _StandInWorker(Status[status])
    heartbeat = logging.LogRecord(
        "distributed.worker",
        logging.ERROR,
        __file__,
        1,
        "Failed to communicate with scheduler during heartbeat.",
        None,
        None,
    )
    other = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, "x", None, None)
    noise_filter = _ClosingHeartbeatFilter(worker)
    assert noise_filter.filter(heartbeat) is shown
    assert noise_filter.filter(other) is True
