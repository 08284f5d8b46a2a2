"""Backends: what runs the workers. ``Backend`` is the interface; the rest implement it."""

from .base import Backend, BackendFuture, FutureList, InstanceRef, Slot, WorkerLostError
from .dask import DaskBackend
from .dask.connect import SchedulerUnreachableError
from .local import LocalBackend, LocalFuture

__all__ = [
    "Backend",
    "BackendFuture",
    "DaskBackend",
    "FutureList",
    "InstanceRef",
    "LocalBackend",
    "LocalFuture",
    "SchedulerUnreachableError",
    "Slot",
    "WorkerLostError",
]
