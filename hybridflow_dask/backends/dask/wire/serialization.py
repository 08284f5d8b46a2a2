"""Teach Dask to move tensors, DataProtos and TensorDicts as zero-copy frames and to size them.

Importing this module registers the protocol layer's header/frames functions with
Dask's serializer family ``"dask"`` (used for worker-to-worker transfers, scatter and
gather). Plain tensors get ours too: Dask's own goes through numpy, which has no
bfloat16 or float8 and refuses conjugated or negated views, so a bf16 state dict passed
as a plain argument would fail where the same tensor inside a DataProto travels.

``hybridflow_dask`` imports this module, so the registration is in effect in the driver
and in every worker: the backend registers its worker plugin before any data is sent,
and unpickling that plugin imports ``hybridflow_dask``.

The same types answer Dask's ``cuda`` family too (asked first by comms that carry device
memory, UCX), with their CUDA frames left on the device, but only in a process where the
device route is on (``device_route``); elsewhere they decline (``NotImplementedError``),
and Dask falls back to the ``dask`` family, host bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from distributed.protocol import dask_deserialize, dask_serialize
from distributed.protocol import torch as _dask_torch  # noqa: F401  (Dask's first: ours replace it)
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize

from hybridflow_dask_sizeof import register_sizeof

from ....protocol import DataProto
from ....protocol.serialization import (
    deserialize_dataproto,
    deserialize_tensor,
    deserialize_tensordict,
    serialize_dataproto,
    serialize_tensor,
    serialize_tensordict,
)
from . import device_route

__all__: list[str] = []

dask_serialize.register(torch.Tensor)(serialize_tensor)
dask_deserialize.register(torch.Tensor)(deserialize_tensor)
dask_serialize.register(DataProto)(serialize_dataproto)
dask_deserialize.register(DataProto)(deserialize_dataproto)


def _on_device_route(serialize: Callable[..., tuple[dict, list]]) -> Callable[[Any], tuple]:
    """``serialize`` for the ``cuda`` family: CUDA frames stay on the device, and only
    where the device route is on (elsewhere Dask goes on to the ``dask`` family)."""

    def cuda_family(value: Any) -> tuple[dict, list]:
        if not device_route.enabled():
            raise NotImplementedError("the device route is off in this process")
        return serialize(value, device_frames=True)

    return cuda_family


cuda_serialize.register(torch.Tensor)(_on_device_route(serialize_tensor))
cuda_deserialize.register(torch.Tensor)(deserialize_tensor)
cuda_serialize.register(DataProto)(_on_device_route(serialize_dataproto))
cuda_deserialize.register(DataProto)(deserialize_dataproto)


@dask_serialize.register_lazy("tensordict")
@dask_deserialize.register_lazy("tensordict")
@cuda_serialize.register_lazy("tensordict")
@cuda_deserialize.register_lazy("tensordict")
def _register_tensordict() -> None:
    """Registered when Dask first meets a TensorDict: importing tensordict costs seconds."""
    from tensordict import TensorDict

    dask_serialize.register(TensorDict)(serialize_tensordict)
    dask_deserialize.register(TensorDict)(deserialize_tensordict)
    cuda_serialize.register(TensorDict)(_on_device_route(serialize_tensordict))
    cuda_deserialize.register(TensorDict)(deserialize_tensordict)


def _register_sizeof_now() -> None:
    # Entry points load only for an installed distribution; register directly as well.
    from dask.sizeof import sizeof

    register_sizeof(sizeof)


_register_sizeof_now()
