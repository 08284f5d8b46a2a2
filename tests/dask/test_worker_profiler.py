"""Dask's statistical profiler samples threads running Dask tasks, 100 times a second on
every worker; a group's calls run on their instances' own threads, so on a cluster the
backend starts it is off unless ``hybridflow.worker-profiler`` asks for it."""

from __future__ import annotations

import dask
import pytest

from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver.cluster import worker_settings


def _profiling(dask_worker) -> bool:
    return "profile" in dask_worker.periodic_callbacks


@pytest.mark.cluster
def test_the_workers_of_an_owned_cluster_do_not_run_dasks_profiler():
    with DaskBackend(n_workers=1) as backend:
        assert list(backend.client.run(_profiling).values()) == [False]
    assert dask.config.get("distributed.worker.profile.enabled")  # Dask's own default stays


def test_worker_profiler_turns_dasks_profiler_on_for_an_owned_cluster():
    assert worker_settings()["distributed.worker.profile.enabled"] is False
    with dask.config.set({"hybridflow.worker-profiler": True}):
        assert worker_settings()["distributed.worker.profile.enabled"] is True
