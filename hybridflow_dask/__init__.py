"""HybridFlow's single-controller programming model on Dask distributed.

``import hybridflow_dask as hf``: write a driver in plain Python against WorkerGroups of
stateful workers; ``@hf.register`` methods fan out to the ranks and data flows between
groups as futures.
"""

from .backends.dask import serialization as _dask_serialization  # noqa: F401  (registers serializers)
from .colocate import create_colocated_worker_cls
from .decorators import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from .protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    DataProtoItem,
    all_gather_data_proto,  # verl: verl.protocol.all_gather_data_proto
)
from .resource_pool import (
    ResourcePool,
    ResourcePoolManager,
    merge_resource_pool,
    split_resource_pool,
)
from .runtime import get, init, shutdown
from .worker import ClassWithInitArgs, Worker
from .worker_group import WorkerGroup

__version__ = "0.1.0"

__all__ = [
    "ClassWithInitArgs",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "Dispatch",
    "Execute",
    "ResourcePool",
    "ResourcePoolManager",
    "Worker",
    "WorkerGroup",
    "all_gather_data_proto",
    "create_colocated_worker_cls",
    "get",
    "init",
    "make_nd_compute_dataproto_dispatch_fn",
    "merge_resource_pool",
    "register",
    "register_dispatch_mode",
    "shutdown",
    "split_resource_pool",
    "update_dispatch_mode",
]
