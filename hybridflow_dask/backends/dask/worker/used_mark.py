"""The "used" mark behind ``hybridflow.fresh-processes``, kept in the worker process itself.

A pool that takes a worker marks it; a driver that wants fresh processes restarts a
marked worker before its pool takes it. The mark lives in the process it describes (on
the worker's ``InstancesPlugin``), so every driver on a shared cluster (``dask scheduler``
+ ``dask worker`` started by hand, several jobs one after another) sees it, and a restart
(a new process, a new plugin) clears it by itself; threads-only clusters put several
workers in one process, each with its own plugin. The driver reads and sets it with
``client.run``.
"""

from __future__ import annotations

from typing import Any

from .plugin import PLUGIN_NAME

__all__ = ["is_used", "mark_used"]


def mark_used(dask_worker: Any) -> None:
    """A pool takes this worker: no later pool of a fresh-processes driver gets it as is."""
    dask_worker.plugins[PLUGIN_NAME].used = True


def is_used(dask_worker: Any) -> bool:
    """Whether a pool (of any driver) has taken this worker since its process started."""
    return bool(getattr(dask_worker.plugins.get(PLUGIN_NAME), "used", False))
