"""The GRPO demo on workers that SLURM started: ``dask_jobqueue.SLURMCluster`` against a
single-node SLURM (slurmctld + slurmd + munged) this test starts, passed to
``DaskBackend(cluster=...)``. Needs root; installs Debian's slurm-wlm and munge if absent."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.examples.grpo import run_demo
from hybridflow_dask.testing import slurm


@pytest.fixture(scope="module")
def single_node_slurm():
    slurm.install_if_missing()
    why = slurm.missing()
    if why is not None:
        pytest.skip(why)
    with slurm.SingleNodeSlurm() as cluster:
        yield cluster


class JobId(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def job(self):
        return os.environ.get("SLURM_JOB_ID")


def test_the_grpo_demo_runs_on_workers_started_as_slurm_jobs(single_node_slurm, tmp_path):
    dask_jobqueue = pytest.importorskip("dask_jobqueue")
    cluster = dask_jobqueue.SLURMCluster(
        cores=1,
        memory="2GB",
        processes=1,
        python=sys.executable,
        scheduler_options={"host": "127.0.0.1"},
        log_directory=str(tmp_path),
        # the workers import this module's worker class, as the driver does
        job_script_prologue=[f"export PYTHONPATH={Path(__file__).parent}"],
    )
    try:
        cluster.scale(2)  # two jobs: one worker process each, one per rank
        with DaskBackend(cluster=cluster) as backend:
            backend.client.wait_for_workers(2, timeout=120)  # the jobs are queued, then run
            with hf.WorkerGroup(hf.ResourcePool([2]), JobId, backend=backend) as group:
                jobs = group.job()
            assert all(jobs) and len(set(jobs)) == 2, jobs  # each rank in its own SLURM job
            result = run_demo(3, world_size=2, backend=backend)
        assert [s["step"] for s in result["steps"]] == [1, 2, 3]
        first, second = result["param_checksums"]
        assert first == second != result["initial_checksum"]
    finally:
        cluster.close()
