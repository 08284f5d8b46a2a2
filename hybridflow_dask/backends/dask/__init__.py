"""The Dask backend: ranks live in Dask worker processes; calls reach them directly.

One module per part: ``backend`` (the ``DaskBackend`` the core talks to), ``host`` and
``actor`` (the worker side), ``direct_path`` and ``task_path`` (the two ways a call
travels), ``liveness``, ``cluster`` (which local cluster to start), ``placement``,
``config``, ``serialization``, ``internals`` (every private Dask API, in one place) and
``dashboard``/``dashboard_page`` (the ``/hybridflow`` page).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import DaskBackend

__all__ = ["DaskBackend"]


def __getattr__(name: str) -> Any:
    # Lazy, so that light modules of this package (``connect``, ``cluster``, ``config``)
    # can be imported by the CLI without loading torch and distributed.
    if name == "DaskBackend":
        from .backend import DaskBackend

        return DaskBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
