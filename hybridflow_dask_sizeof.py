"""The ``dask.sizeof`` entry point of hybridflow-dask: byte counts for DataProto,
TensorDict and torch tensors (Dask counts a tensor as 80 bytes otherwise).

A top-level module, not part of the ``hybridflow_dask`` package, because Dask loads
entry points while ``dask`` itself is being imported: importing the package from here
would import Dask half-way through its own import. The handlers load lazily, the first
time Dask sizes one of these types.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register_sizeof"]


def register_sizeof(sizeof: Any) -> None:
    """Register with Dask's ``sizeof`` dispatch (called by Dask with its dispatcher)."""

    @sizeof.register_lazy("hybridflow_dask")
    def _register_dataproto() -> None:
        from hybridflow_dask.protocol import DataProto, sizeof_dataproto

        sizeof.register(DataProto)(sizeof_dataproto)

    @sizeof.register_lazy("tensordict")
    def _register_tensordict() -> None:
        from tensordict import TensorDict

        from hybridflow_dask.protocol import sizeof_tensordict

        sizeof.register(TensorDict)(sizeof_tensordict)

    @sizeof.register_lazy("torch")
    def _register_torch() -> None:
        import torch

        from hybridflow_dask.protocol import sizeof_tensor

        sizeof.register(torch.Tensor)(sizeof_tensor)
