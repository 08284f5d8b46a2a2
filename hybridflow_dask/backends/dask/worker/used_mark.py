"""The "used" mark behind ``hybridflow.fresh-processes``, kept in the worker process itself.

A pool that takes a worker marks it; a driver that wants fresh processes restarts a
marked worker before its pool takes it. The mark lives in the process it describes, so
every driver on a shared cluster (``dask scheduler`` + ``dask worker`` started by hand,
several jobs one after another) sees it, and a restart (a new process) clears it by
itself. It is kept per worker incarnation (Dask's ``worker.id``), since threads-only
clusters put several workers in one process. The driver reads and sets it with
``client.run``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_used", "mark_used"]

#: Ids of the workers in this process that a pool has taken.
_USED: set[str] = set()


def mark_used(dask_worker: Any) -> None:
    """A pool takes this worker: no later pool of a fresh-processes driver gets it as is."""
    _USED.add(dask_worker.id)


def is_used(dask_worker: Any) -> bool:
    """Whether a pool (of any driver) has taken this worker since its process started."""
    return dask_worker.id in _USED
