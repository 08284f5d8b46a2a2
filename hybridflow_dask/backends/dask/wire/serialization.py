"""Teach Dask to move tensors, DataProtos and TensorDicts as zero-copy frames and to size them.

Importing this module registers the protocol layer's header/frames functions with
Dask's serializer family ``"dask"`` (used for worker-to-worker transfers, scatter and
gather). Plain tensors get ours too: Dask's own goes through numpy, which has no
bfloat16 or float8 and refuses conjugated or negated views, so a bf16 state dict passed
as a plain argument would fail where the same tensor inside a DataProto travels.

``hybridflow_dask`` imports this module, so the registration is in effect in the driver
and in every worker: the backend registers its worker plugin before any data is sent,
and unpickling that plugin imports ``hybridflow_dask``.
"""

from __future__ import annotations

import torch
from distributed.protocol import dask_deserialize, dask_serialize
from distributed.protocol import torch as _dask_torch  # noqa: F401  (Dask's first: ours replace it)

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

__all__: list[str] = []

dask_serialize.register(torch.Tensor)(serialize_tensor)
dask_deserialize.register(torch.Tensor)(deserialize_tensor)
dask_serialize.register(DataProto)(serialize_dataproto)
dask_deserialize.register(DataProto)(deserialize_dataproto)


@dask_serialize.register_lazy("tensordict")
@dask_deserialize.register_lazy("tensordict")
def _register_tensordict() -> None:
    """Registered when Dask first meets a TensorDict: importing tensordict costs seconds."""
    from tensordict import TensorDict

    dask_serialize.register(TensorDict)(serialize_tensordict)
    dask_deserialize.register(TensorDict)(deserialize_tensordict)


def _register_sizeof_now() -> None:
    # Entry points load only for an installed distribution; register directly as well.
    from dask.sizeof import sizeof

    register_sizeof(sizeof)


_register_sizeof_now()
