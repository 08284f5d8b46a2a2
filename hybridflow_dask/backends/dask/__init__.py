"""The Dask backend: ranks live in Dask worker processes; calls reach them directly.

One module per part: ``backend`` (the ``DaskBackend`` the core talks to), ``host`` and
``actor`` (the worker side), ``direct_path`` and ``task_path`` (the two ways a call
travels), ``liveness``, ``cluster`` (which local cluster to start), ``placement``,
``config``, ``serialization``, ``internals`` (every private Dask API, in one place) and
``dashboard``/``dashboard_page`` (the ``/hybridflow`` page).
"""

from .backend import DaskBackend

__all__ = ["DaskBackend"]
