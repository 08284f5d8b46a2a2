"""Backends: what runs the workers. ``Backend`` is the interface; the rest implement it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import HybridFlowError, SchedulerLostError, SchedulerUnreachableError
from .base import (
    Backend,
    BackendFuture,
    FutureList,
    Futures,
    InstanceRef,
    Instances,
    Placement,
    Slot,
    WorkerLostError,
    WorkerUnreachableError,
)
from .local import LocalBackend, LocalFuture

if TYPE_CHECKING:
    from .dask import DaskBackend
    from .ray import RayBackend as RayBackend

__all__ = [
    "Backend",
    "BackendFuture",
    "DaskBackend",
    "FutureList",
    "Futures",
    "HybridFlowError",
    "InstanceRef",
    "Instances",
    "LocalBackend",
    "LocalFuture",
    "Placement",
    "SchedulerLostError",
    "SchedulerUnreachableError",
    "Slot",
    "WorkerLostError",
    "WorkerUnreachableError",
]


def __getattr__(name: str) -> Any:
    # ``DaskBackend`` loads distributed (and torch with it): only when asked for.
    if name == "DaskBackend":
        from .dask.driver.backend import DaskBackend

        return DaskBackend
    # ``RayBackend`` needs the optional ``ray`` package (the ``ray`` extra).
    if name == "RayBackend":
        from .ray import RayBackend as RayBackend

        return RayBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
