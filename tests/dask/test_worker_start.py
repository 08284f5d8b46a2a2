"""Worker processes of a cluster the backend starts are forked from one preloaded server.

Each would otherwise be a fresh interpreter importing torch and Dask again (~2 s here).
Dask reads its start method from its global config as a process starts, so the backend's
nannies put ``forkserver`` in force only while they start one, and only over Dask's
default: these tests start from that default (``spawn``), not the suite's own setting.
"""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

pytestmark = pytest.mark.cluster

START_METHOD = "distributed.worker.multiprocessing-method"


class Probe(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def env(self, name):
        return os.environ.get(name)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def torch_threads(self):
        import torch

        return torch.get_num_threads()


def parents(backend: DaskBackend) -> set[int]:
    return set(backend.client.run(os.getppid).values())


def wait_put_back(timeout: float = 30) -> None:
    """Dask's start method is put back as the nannies' starts end, a moment after their
    workers registered (what ``wait_for_workers`` waits for)."""
    deadline = time.monotonic() + timeout
    while dask.config.get(START_METHOD) != "spawn":
        assert time.monotonic() < deadline, "Dask's start method was not put back"
        time.sleep(0.05)


def test_workers_are_forked_from_one_server_and_dask_keeps_its_setting():
    with dask.config.set({START_METHOD: "spawn"}):
        backend = DaskBackend(n_workers=2)
        try:
            backend.client.wait_for_workers(2)
            (server,) = parents(backend)  # one parent for both
            assert server != os.getpid()  # not the driver (whose nannies spawn otherwise)
            wait_put_back()
        finally:
            backend.shutdown()


def test_a_killed_worker_is_restarted_by_its_nanny_from_the_same_server():
    with dask.config.set({START_METHOD: "spawn"}):
        backend = DaskBackend(n_workers=1)
        try:
            backend.client.wait_for_workers(1)
            (server,) = parents(backend)
            (killed,) = backend.client.run(os.getpid).values()
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:  # the nanny starts a new process, which registers again
                pids = set(backend.client.run(os.getpid, on_error="ignore").values())
                if pids and killed not in pids:
                    break
                assert time.monotonic() < deadline, "the killed worker never came back"
                time.sleep(0.1)
            assert parents(backend) == {server}
            wait_put_back()
        finally:
            backend.shutdown()


def test_a_worker_started_later_gets_the_drivers_environment_of_that_moment(monkeypatch):
    with dask.config.set({START_METHOD: "spawn"}):
        backend = DaskBackend(n_workers=1)
        try:
            backend.client.wait_for_workers(1)  # the server runs from here on
            monkeypatch.setenv("HF_SET_AFTER_THE_SERVER_STARTED", "late")
            backend.client.restart()  # a new process, forked from the running server
            group = hf.WorkerGroup(hf.ResourcePool([1]), Probe, backend=backend)
            assert group.env("HF_SET_AFTER_THE_SERVER_STARTED") == ["late"]
        finally:
            backend.shutdown()


def test_a_forked_workers_torch_runs_one_thread_as_a_spawned_ones_does():
    # torch read OMP_NUM_THREADS as the server imported it: Dask's pre-spawn setting (1)
    # must have been in place then, not this machine's core count
    assert dask.config.get("distributed.nanny.pre-spawn-environ")["OMP_NUM_THREADS"] == 1
    with dask.config.set({START_METHOD: "spawn"}):
        backend = DaskBackend(n_workers=1)
        try:
            group = hf.WorkerGroup(hf.ResourcePool([1]), Probe, backend=backend)
            assert group.torch_threads() == [1]
        finally:
            backend.shutdown()


def test_an_empty_preload_spawns_each_worker_from_the_driver():
    with dask.config.set({START_METHOD: "spawn", "hybridflow.worker-preload": []}):
        backend = DaskBackend(n_workers=1)
        try:
            backend.client.wait_for_workers(1)
            assert parents(backend) == {os.getpid()}
        finally:
            backend.shutdown()


def test_a_preload_that_is_not_a_list_of_modules_is_refused_before_anything_starts():
    refused = pytest.raises(ValueError, match=r"hybridflow\.worker-preload must be a list")
    with dask.config.set({"hybridflow.worker-preload": "torch"}), refused:
        DaskBackend(n_workers=1)
