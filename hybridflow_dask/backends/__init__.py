"""Backends: what runs the workers. ``Backend`` is the interface; the rest implement it."""

from .base import Backend, BackendFuture, FutureList, InstanceRef, Slot, WorkerLostError
from .dask import DaskBackend
from .local import LocalBackend, LocalFuture

__all__ = [
    "Backend",
    "BackendFuture",
    "DaskBackend",
    "FutureList",
    "InstanceRef",
    "LocalBackend",
    "LocalFuture",
    "Slot",
    "WorkerLostError",
]
