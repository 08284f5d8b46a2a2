"""Backends: what runs the workers. ``Backend`` is the interface; the rest implement it."""

from .base import Backend, BackendFuture, InstanceRef, Slot, WorkerLostError
from .local import LocalBackend, LocalFuture

__all__ = [
    "Backend",
    "BackendFuture",
    "DaskBackend",
    "InstanceRef",
    "LocalBackend",
    "LocalFuture",
    "Slot",
    "WorkerLostError",
]


def __getattr__(name: str):
    # DaskBackend pulls in distributed; import it when asked for, not on every import.
    if name == "DaskBackend":
        from .dask import DaskBackend

        return DaskBackend
    raise AttributeError(name)
