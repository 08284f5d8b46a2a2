"""The Dask backend: ranks live in Dask worker processes; calls reach them directly.

Laid out by side of the wire:

- ``driver/``: what runs in the driver process: ``backend`` (the ``DaskBackend`` the core
  talks to, one call flow for every path), ``call_path`` (the interface a way of
  travelling implements), ``direct_path`` and ``lane`` (the default: messages on a
  stream per worker, blocking calls on a socket lane), ``task_path`` (pinned Dask tasks),
  ``liveness``, ``cluster``, ``connect``, ``placement``;
- ``worker/``: what runs in each Dask worker: ``host`` (the plugin and its handlers),
  ``actor`` (one instance's thread, loop, order and environment), ``jobs``,
  ``lane_server``, ``tasks`` (what the task path runs);
- ``wire/``: what both ends agree on: ``messages`` (framing), ``lane_protocol``,
  ``same_host`` (memory-to-memory copies), ``snapshot`` (values captured at the call and at
  the return), ``serialization`` (tensors and DataProtos as zero-copy frames), ``keys``;
- ``scheduler/``: the ``/hybridflow`` dashboard page (a scheduler plugin);
- here: ``config`` (the ``hybridflow`` settings) and ``internals`` (every private Dask API,
  in one place, each with a canary test).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .driver.backend import DaskBackend

__all__ = ["DaskBackend"]


def __getattr__(name: str) -> Any:
    # Lazy, so that light modules of this package (``driver.connect``, ``driver.cluster``,
    # ``config``) can be imported by the CLI without loading torch and distributed.
    if name == "DaskBackend":
        from .driver.backend import DaskBackend

        return DaskBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
