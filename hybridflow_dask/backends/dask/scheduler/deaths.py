"""Worker deaths, told to drivers on a topic of this project's own.

Each driver must learn within milliseconds that a worker left, so calls on its ranks fail
with ``WorkerLostError`` instead of waiting. ``WorkerDeaths`` is a scheduler plugin: Dask
calls its ``remove_worker`` hook for every worker that leaves, and it logs
``{"worker": address}`` on ``DEATH_TOPIC``, which every ``DaskBackend`` subscribes to.
A hook is part of Dask's plugin interface, where the text of the scheduler's own log
events is not, so a Dask release cannot change it silently.
"""

from __future__ import annotations

from typing import Any

from distributed import Client, SchedulerPlugin

__all__ = ["DEATH_TOPIC", "PLUGIN_NAME", "WorkerDeaths", "register_worker_deaths"]

PLUGIN_NAME = "hybridflow-worker-deaths"
#: Event topic of a worker that left the cluster: ``{"worker": address}``.
DEATH_TOPIC = "hybridflow-worker-removed"


class WorkerDeaths(SchedulerPlugin):
    """Logs every worker that leaves on ``DEATH_TOPIC``."""

    idempotent = True  # one per scheduler, whichever backend registered it first

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        scheduler.log_event(DEATH_TOPIC, {"worker": worker})


def register_worker_deaths(client: Client) -> None:
    """Register the plugin on ``client``'s scheduler, or say why the backend cannot work."""
    try:
        client.register_plugin(WorkerDeaths(), name=PLUGIN_NAME)
    except Exception as exc:  # e.g. the scheduler cannot import hybridflow_dask
        raise RuntimeError(
            f"the Dask scheduler at {client.scheduler.address} could not load hybridflow_dask's "
            f"scheduler plugin ({type(exc).__name__}: {exc}); install hybridflow_dask where the "
            "scheduler runs, as on the workers"
        ) from exc
