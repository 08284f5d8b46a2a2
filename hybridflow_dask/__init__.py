"""HybridFlow's single-controller programming model on Dask distributed.

``import hybridflow_dask as hf``: write a driver in plain Python against WorkerGroups of
stateful workers; ``@hf.register`` methods fan out to the ranks and data flows between
groups as futures.

The package imports lazily (PEP 562): ``import hybridflow_dask`` loads nothing heavy,
and each public name imports its module (torch, Dask) on first use, so the
``hybridflow-dask`` command answers ``--help`` at once. To export a name, add one line to
``_EXPORTS`` (and, for type checkers, to the ``TYPE_CHECKING`` block).

``hybridflow_dask.__version__`` is the installed distribution's version, read from its
metadata on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: The installed ``hybridflow-dask`` version (looked up by ``__getattr__`` on first use).
__version__: str

#: Every public name and the module (relative to this package) that defines it.
_EXPORTS: dict[str, str] = {
    "CallTimeoutError": ".errors",
    "CallWithdrawnError": ".errors",
    "ClassWithInitArgs": ".worker",
    "DataProto": ".protocol",
    "DataProtoConfig": ".protocol",
    "DataProtoFuture": ".protocol",
    "DataProtoItem": ".protocol",
    "Dispatch": ".decorators",
    "Execute": ".decorators",
    "HybridFlowError": ".errors",
    "LaneRefused": ".errors",
    "ProtocolError": ".errors",
    "Recovery": ".recovery",
    "RecoveryRecord": ".recovery",
    "ResourcePool": ".resource_pool",
    "ResourcePoolManager": ".resource_pool",
    "SchedulerLostError": ".errors",
    "SchedulerUnreachableError": ".errors",
    "Worker": ".worker",
    "WorkerGroup": ".worker_group",
    "WorkerLostError": ".errors",
    "WorkerUnreachableError": ".errors",
    "all_gather_data_proto": ".protocol",  # verl: verl.protocol.all_gather_data_proto
    "create_colocated_worker_cls": ".colocate",
    "dashboard_link": ".runtime",
    "default_backend": ".runtime",
    "get": ".runtime",
    "init": ".runtime",
    "make_nd_compute_dataproto_dispatch_fn": ".decorators",
    "merge_resource_pool": ".resource_pool",
    "register": ".decorators",
    "register_dispatch_mode": ".decorators",
    "shutdown": ".runtime",
    "split_resource_pool": ".resource_pool",
    "update_dispatch_mode": ".decorators",
}

__all__ = sorted(_EXPORTS)


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridflow-dask")
    except PackageNotFoundError:  # a source tree on sys.path that pip never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = value = _installed_version()
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})


if TYPE_CHECKING:  # what static tools see; tests check it names exactly _EXPORTS
    # One name a line, ``X as X``: the explicit re-export a typed package needs.
    from .colocate import create_colocated_worker_cls as create_colocated_worker_cls
    from .decorators import Dispatch as Dispatch
    from .decorators import Execute as Execute
    from .decorators import (
        make_nd_compute_dataproto_dispatch_fn as make_nd_compute_dataproto_dispatch_fn,
    )
    from .decorators import register as register
    from .decorators import register_dispatch_mode as register_dispatch_mode
    from .decorators import update_dispatch_mode as update_dispatch_mode
    from .errors import CallTimeoutError as CallTimeoutError
    from .errors import CallWithdrawnError as CallWithdrawnError
    from .errors import HybridFlowError as HybridFlowError
    from .errors import LaneRefused as LaneRefused
    from .errors import ProtocolError as ProtocolError
    from .errors import SchedulerLostError as SchedulerLostError
    from .errors import SchedulerUnreachableError as SchedulerUnreachableError
    from .errors import WorkerLostError as WorkerLostError
    from .errors import WorkerUnreachableError as WorkerUnreachableError
    from .protocol import DataProto as DataProto
    from .protocol import DataProtoConfig as DataProtoConfig
    from .protocol import DataProtoFuture as DataProtoFuture
    from .protocol import DataProtoItem as DataProtoItem
    from .protocol import all_gather_data_proto as all_gather_data_proto
    from .recovery import Recovery as Recovery
    from .recovery import RecoveryRecord as RecoveryRecord
    from .resource_pool import ResourcePool as ResourcePool
    from .resource_pool import ResourcePoolManager as ResourcePoolManager
    from .resource_pool import merge_resource_pool as merge_resource_pool
    from .resource_pool import split_resource_pool as split_resource_pool
    from .runtime import dashboard_link as dashboard_link
    from .runtime import default_backend as default_backend
    from .runtime import get as get
    from .runtime import init as init
    from .runtime import shutdown as shutdown
    from .worker import ClassWithInitArgs as ClassWithInitArgs
    from .worker import Worker as Worker
    from .worker_group import WorkerGroup as WorkerGroup
