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
    "ClassWithInitArgs": ".worker",
    "DataProto": ".protocol",
    "DataProtoConfig": ".protocol",
    "DataProtoFuture": ".protocol",
    "DataProtoItem": ".protocol",
    "Dispatch": ".decorators",
    "Execute": ".decorators",
    "Recovery": ".recovery",
    "RecoveryRecord": ".recovery",
    "ResourcePool": ".resource_pool",
    "ResourcePoolManager": ".resource_pool",
    "Worker": ".worker",
    "WorkerGroup": ".worker_group",
    "all_gather_data_proto": ".protocol",  # verl: verl.protocol.all_gather_data_proto
    "create_colocated_worker_cls": ".colocate",
    "dashboard_link": ".runtime",
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
    from .colocate import create_colocated_worker_cls  # noqa: F401
    from .decorators import (  # noqa: F401
        Dispatch,
        Execute,
        make_nd_compute_dataproto_dispatch_fn,
        register,
        register_dispatch_mode,
        update_dispatch_mode,
    )
    from .protocol import (  # noqa: F401
        DataProto,
        DataProtoConfig,
        DataProtoFuture,
        DataProtoItem,
        all_gather_data_proto,
    )
    from .recovery import Recovery, RecoveryRecord  # noqa: F401
    from .resource_pool import (  # noqa: F401
        ResourcePool,
        ResourcePoolManager,
        merge_resource_pool,
        split_resource_pool,
    )
    from .runtime import dashboard_link, get, init, shutdown  # noqa: F401
    from .worker import ClassWithInitArgs, Worker  # noqa: F401
    from .worker_group import WorkerGroup  # noqa: F401
