"""Shorter debugging logs on the streams of a scheduler that lives in the driver's process.

Dask keeps the last ``distributed.admin.low-level-log-length`` (1,000) batches each
batched stream sent, for debugging. A busy run's batches hold hundreds of messages each
(a release per result, a report per key), so on a cluster the backend starts, whose
scheduler runs in the driver, those logs were its fastest-growing memory. The length is
fixed when a stream is made and the scheduler makes one for every worker and client that
connects, so ``MessageLogCap`` shortens each as it appears.
"""

from __future__ import annotations

from typing import Any

from distributed import Client, SchedulerPlugin

from ..internals import cap_message_log, scheduler_streams

__all__ = ["PLUGIN_NAME", "MessageLogCap", "register_message_log_cap"]

PLUGIN_NAME = "hybridflow-message-logs"


class MessageLogCap(SchedulerPlugin):
    """Keeps ``maxlen`` recent batches on each of the scheduler's streams."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen

    async def start(self, scheduler: Any) -> None:
        self._cap(scheduler)

    def add_worker(self, scheduler: Any, worker: str) -> None:
        self._cap(scheduler, worker)  # its stream is made just before this hook

    def add_client(self, scheduler: Any, client: str) -> None:
        # The client's stream is made right after this hook, in the same turn of the loop.
        scheduler.loop.add_callback(self._cap, scheduler)

    def _cap(self, scheduler: Any, worker: str | None = None) -> None:
        for stream in scheduler_streams(scheduler, worker):
            cap_message_log(stream, self.maxlen)


def register_message_log_cap(client: Client, maxlen: int) -> None:
    """Shorten the logs of the streams of ``client``'s scheduler (one the backend started)."""
    client.register_plugin(MessageLogCap(maxlen), name=PLUGIN_NAME)
