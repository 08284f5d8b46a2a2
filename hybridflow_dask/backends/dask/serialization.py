"""Teach Dask to move DataProtos and TensorDicts as zero-copy frames and to size them.

Importing this module registers the protocol layer's header/frames functions with
Dask's serializer family ``"dask"`` (used for worker-to-worker transfers, scatter and
gather). ``hybridflow_dask`` imports it, so the registration is in effect in the
driver and in every worker: the backend registers its worker plugin before any data is
sent, and unpickling that plugin imports ``hybridflow_dask``.
"""

from __future__ import annotations

from distributed.protocol import dask_deserialize, dask_serialize

from hybridflow_dask_sizeof import register_sizeof

from ...protocol import DataProto
from ...protocol.serialization import (
    deserialize_dataproto,
    deserialize_tensordict,
    serialize_dataproto,
    serialize_tensordict,
)

__all__: list[str] = []

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
