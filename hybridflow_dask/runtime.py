"""The process-wide default backend, and ``get`` (this library's ``ray.get``)."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from .backends.base import Backend, FutureList
from .protocol import DataProtoFuture

__all__ = ["dashboard_link", "default_backend", "get", "init", "shutdown"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_default: Backend | None = None


def init(backend: Backend | None = None, **kwargs: Any) -> Backend:
    """Set the default backend (``DaskBackend(**kwargs)`` when none is given)."""
    global _default
    with _lock:
        if _default is not None:
            raise RuntimeError(
                "a default backend is already set; call hybridflow_dask.shutdown() first"
            )
        if backend is None:
            from .backends.dask import DaskBackend

            backend = DaskBackend(**kwargs)
        elif kwargs:
            raise TypeError("pass either a backend or DaskBackend keyword arguments, not both")
        _default = backend
        _close_at_exit()
        return backend


def default_backend() -> Backend:
    """The process-wide default backend: the one ``init`` set, or a ``DaskBackend()``
    started now if there is none yet (what a ``WorkerGroup`` without ``backend=`` uses).

    Use it to reach the backend behind your groups, e.g.
    ``hf.default_backend().dashboard_link`` and ``.groups_page``, where ``init`` would
    raise because a default is already set. It is shut down at exit, or by ``shutdown``.
    """
    global _default
    with _lock:
        if _default is None:
            from .backends.dask import DaskBackend

            logger.info("no backend given: starting DaskBackend() as the default")
            _default = DaskBackend()
            _close_at_exit()
            logger.info("Dask dashboard: %s", dashboard_link(_default))
        return _default


def _close_at_exit() -> None:
    # Registered once the backend exists, so after distributed's own exit hook (which
    # closes local clusters): exit hooks run last-in first-out, so the backend shuts
    # down cleanly before its cluster is closed under it.
    atexit.unregister(shutdown)
    atexit.register(shutdown)


def dashboard_link(backend: Backend | None = None) -> str | None:
    """The Dask dashboard URL of ``backend`` (default: the default backend, started if
    needed), so a program can print where to watch its groups; ``None`` for a backend
    without a dashboard such as ``LocalBackend``. The backend's ``groups_page`` is the
    worker-group page on the same dashboard.
    """
    if backend is None:
        backend = default_backend()
    link = getattr(backend, "dashboard_link", None)
    return link if isinstance(link, str) and link else None


def shutdown() -> None:
    """Shut the default backend down (idempotent)."""
    global _default
    with _lock:
        backend, _default = _default, None
    if backend is not None:
        backend.shutdown()


def get(x: Any) -> Any:
    """Materialize a backend future, a ``DataProtoFuture``, or a list of them."""
    if isinstance(x, DataProtoFuture):
        return x.get()
    if isinstance(x, FutureList):
        return x.backend.gather(x)
    if isinstance(x, (list, tuple)):
        return type(x)(get(item) for item in x)
    backend = _default
    if backend is not None and backend.is_future(x):
        return backend.gather([x])[0]  # fails fast if its worker died
    if hasattr(x, "result") and callable(x.result):
        return x.result()
    raise TypeError(f"hybridflow_dask.get cannot materialize a {type(x).__name__}")
