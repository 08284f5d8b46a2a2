"""A cluster the backend starts runs its scheduler in the driver's process: every stream
there keeps ``hybridflow.message-log-length`` recent batches for debugging, not Dask's
1,000 (a busy run's batches hold hundreds of messages each: tens of MiB of the driver).
"""

from __future__ import annotations

import dask
import pytest
from distributed import Client

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend

pytestmark = pytest.mark.cluster  # each test starts a cluster of its own


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def noop_async(self) -> None:
        return None


def _log_lengths(dask_scheduler) -> dict:
    from hybridflow_dask.backends.dask.internals import scheduler_streams

    return {
        "streams": sorted(
            {stream.recent_message_log.maxlen for stream in scheduler_streams(dask_scheduler)}
        ),
        "stream_count": len(scheduler_streams(dask_scheduler)),
        "longest": max(len(s.recent_message_log) for s in scheduler_streams(dask_scheduler)),
        "transitions": dask_scheduler.transition_log.maxlen,
    }


def test_streams_of_workers_and_clients_that_join_later_keep_the_configured_length():
    with dask.config.set({"hybridflow.message-log-length": 7}):
        backend = DaskBackend(n_workers=1)
    try:
        group = hf.WorkerGroup(hf.ResourcePool([1]), Echo, backend=backend)
        with Client(backend.cluster, set_as_default=False) as other:  # a client that joins,
            backend.cluster.scale(2)  # then a worker
            backend.client.wait_for_workers(2, timeout=60)
            for _ in range(30):
                for futures in [group.noop_async() for _ in range(5)]:
                    backend.gather(futures)
            lengths = backend.client.run_on_scheduler(_log_lengths)
            driver_log = backend.client.scheduler_comm.recent_message_log
            assert other.scheduler_comm.recent_message_log.maxlen != 7  # not ours to touch
        assert lengths["stream_count"] >= 4  # two workers, the backend's and the other client
        assert lengths["streams"] == [7], lengths
        assert lengths["transitions"] == 7
        assert 0 < lengths["longest"] <= 7  # the logs still log
        assert driver_log.maxlen == 7 and 0 < len(driver_log) <= 7
    finally:
        backend.shutdown()


def test_a_length_of_null_keeps_dasks_own():
    with dask.config.set({"hybridflow.message-log-length": None}):
        backend = DaskBackend(n_workers=1)
    try:
        dasks = dask.config.get("distributed.admin.low-level-log-length")
        assert backend.client.scheduler_comm.recent_message_log.maxlen == dasks
        lengths = backend.client.run_on_scheduler(_log_lengths)
        assert lengths["streams"] == [dasks] and lengths["transitions"] == dasks
    finally:
        backend.shutdown()
