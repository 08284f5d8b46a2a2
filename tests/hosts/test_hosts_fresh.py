"""A shared cluster keeps ``fresh-processes``: a second job (another driver process) on a
cluster started by hand gets clean worker processes, not the first job's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("fresh_job.py")


def run_job(address: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(JOB), address], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_driver_gets_fresh_processes_on_a_hand_started_cluster(hf_hosts):
    hosts = hf_hosts(1, nworkers=2)  # `dask worker --nworkers 2`: one job's two ranks
    first = run_job(hosts.scheduler_address)
    second = run_job(hosts.scheduler_address)  # init_process_group again: needs new processes
    assert [r["sum"] for r in first] == [2, 2]
    assert [r["sum"] for r in second] == [2, 2]
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
