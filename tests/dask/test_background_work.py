"""What the processes of a cluster the backend starts do while no call runs.

Dask's statistical profiler samples threads running Dask tasks, 100 times a second on
every worker; a group's calls run on their instances' own threads, so it is off unless
``hybridflow.worker-profiler`` asks for it. Every Dask server checks that its event loop
is responsive, every 20 ms by Dask's default, waking that loop each time; the driver's
loop hosts the scheduler and every nanny, so an owned cluster's processes check every
``hybridflow.loop-check-interval`` instead."""

from __future__ import annotations

import dask
import pytest
from distributed import Client

from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver.cluster import (
    loop_settings,
    owned_settings,
    worker_settings,
)

TICK = "distributed.admin.tick.interval"


def _profiling(dask_worker) -> bool:
    return "profile" in dask_worker.periodic_callbacks


def _loop_check_ms(dask_worker) -> float:
    return dask_worker.periodic_callbacks["tick"].callback_time


@pytest.mark.cluster
def test_the_workers_of_an_owned_cluster_do_not_run_dasks_profiler():
    with DaskBackend(n_workers=1) as backend:
        assert list(backend.client.run(_profiling).values()) == [False]
    assert dask.config.get("distributed.worker.profile.enabled")  # Dask's own default stays


def test_worker_profiler_turns_dasks_profiler_on_for_an_owned_cluster():
    assert worker_settings()["distributed.worker.profile.enabled"] is False
    with dask.config.set({"hybridflow.worker-profiler": True}):
        assert worker_settings()["distributed.worker.profile.enabled"] is True


@pytest.mark.cluster
def test_every_process_of_an_owned_cluster_checks_its_loop_every_loop_check_interval():
    with (
        dask.config.set({"hybridflow.loop-check-interval": "400ms"}),
        DaskBackend(n_workers=2) as backend,
    ):
        scheduler = backend.cluster.scheduler.periodic_callbacks["tick"].callback_time
        nannies = [
            nanny.periodic_callbacks["tick"].callback_time
            for nanny in backend.cluster.workers.values()
        ]
        workers = list(backend.client.run(_loop_check_ms).values())
    assert (scheduler, nannies, workers) == (400, [400, 400], [400, 400])
    assert dask.config.get(TICK) == "20ms"  # the driver's own Dask settings are left alone


def test_a_null_loop_check_interval_keeps_dasks_own():
    with dask.config.set({"hybridflow.loop-check-interval": None}):
        assert loop_settings() == {}
        assert TICK not in owned_settings()
        assert TICK not in worker_settings()
    assert owned_settings()[TICK] == worker_settings()[TICK] == "500ms"  # the default


@pytest.mark.parametrize("bad", ["soon", 0, "-1s"])
def test_a_bad_loop_check_interval_is_refused_before_a_cluster_starts(bad):
    with (
        dask.config.set({"hybridflow.loop-check-interval": bad}),
        pytest.raises(ValueError, match=r"hybridflow\.loop-check-interval must be a positive"),
    ):
        DaskBackend(n_workers=1)


@pytest.mark.cluster
def test_the_plugins_session_cluster_runs_as_an_owned_cluster_does(hf_dask_cluster):
    scheduler = hf_dask_cluster.scheduler.periodic_callbacks["tick"].callback_time
    nannies = {n.periodic_callbacks["tick"].callback_time for n in hf_dask_cluster.workers.values()}
    with Client(hf_dask_cluster) as client:
        workers = set(client.run(_loop_check_ms).values())
        profiling = set(client.run(_profiling).values())
    assert (scheduler, nannies, workers, profiling) == (500, {500}, {500}, {False})
