"""The four ways a call travels on the Dask backend, for tests that must hold on each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import dask

from hybridflow_dask.backends import DaskBackend

#: Each path's settings: the socket lane with same-host copies (the default), the lane
#: writing every frame to its socket, the worker's Dask comm alone, and pinned tasks.
PATHS: dict[str, dict[str, Any]] = {
    "lane": {},
    "lane-socket-only": {"hybridflow.same-host-copy": False},
    "comm": {"hybridflow.socket-lane": False},
    "task": {"hybridflow.call-path": "task"},
}


@contextlib.contextmanager
def backend_on(path: str, cluster: Any, **settings: Any) -> Iterator[DaskBackend]:
    """A backend on ``cluster`` whose calls take ``path``, shut down afterwards."""
    with dask.config.set({**PATHS[path], **settings}):
        backend = DaskBackend(cluster=cluster)
        try:
            yield backend
        finally:
            backend.shutdown()
