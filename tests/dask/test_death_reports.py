"""A worker's death is the scheduler's word: anyone who can reach the scheduler can post
on the deaths topic, and a report about a live worker the scheduler still lists must not
make a driver give up its ranks."""

from __future__ import annotations

import time

from distributed import Client

import hybridflow_dask as hf
from hybridflow_dask.backends.dask.scheduler.deaths import DEATH_TOPIC


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, value: int) -> int:
        return value


def test_a_death_report_about_a_live_worker_posted_by_another_client_is_ignored(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Echo, [1], backend=hf_dask_backend)
    assert group.echo(1) == [1]
    slot = group.workers[0].slot
    with Client(hf_dask_backend.client.scheduler.address) as other:
        other.log_event(DEATH_TOPIC, {"worker": slot.address})  # a false report
        time.sleep(1.5)  # it reaches the driver, which asks the scheduler and the worker
    assert hf_dask_backend.alive(slot), "a false death report marked a live worker dead"
    assert group.echo(2) == [2]
