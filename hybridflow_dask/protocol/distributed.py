"""``all_gather_data_proto``: inside a worker, give every rank of a group all the group's rows.

Used the way verl's sharding managers use it (e.g. every rank of a sequence-parallel group
needs the same samples): each rank passes its own DataProto and gets the concatenation of
all ranks' rows, in rank order, in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .data_proto import DataProto
from .lazy_tensordict import tensordict

__all__ = ["all_gather_data_proto"]


def all_gather_data_proto(data: DataProto, process_group: Any = None) -> None:
    """All-gather ``data``'s rows over ``process_group`` (default: the world), in place.

    Tensors go through ``all_gather`` (on the current CUDA device for NCCL, on the CPU for
    gloo and the others, then back to their device); ``non_tensor_batch`` through
    ``all_gather_object``. ``meta_info`` is left alone. Every rank must hold the same keys
    and row count; otherwise every rank raises the same ValueError (checked before any
    tensor moves, so no rank hangs). Returns None, like ``torch.distributed.all_gather``.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"all_gather_data_proto needs a DataProto, got {type(data).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "all_gather_data_proto needs torch.distributed to be initialized "
            "(call torch.distributed.init_process_group() in the worker first)"
        )
    size = dist.get_world_size(group=process_group)
    leaves = _tensor_leaves(data)
    shapes = {key: tuple(value.shape) for key, value in leaves}
    gathered: list[Any] = [None] * size
    mine = (len(data), shapes, data.non_tensor_batch)
    dist.all_gather_object(gathered, mine, group=process_group)
    _check_same_layout(gathered)
    if leaves:
        data.batch = _gather_batch(data, leaves, size, process_group)
    data.non_tensor_batch = {
        key: np.concatenate([part[2][key] for part in gathered], axis=0)
        for key in data.non_tensor_batch
    }


def _tensor_leaves(data: DataProto) -> list[tuple[Any, torch.Tensor]]:
    if data.batch is None:
        return []
    leaves = []
    for key, value in data.batch.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"all_gather_data_proto gathers tensors only; batch key {key!r} holds a "
                f"{type(value).__name__} (put per-row objects in non_tensor_batch)"
            )
        leaves.append((key, value))
    return sorted(leaves, key=lambda item: str(item[0]))


def _check_same_layout(gathered: list[Any]) -> None:
    """Every rank compares every rank's (rows, tensor shapes, non-tensor keys)."""
    rows0, shapes0, non_tensor0 = gathered[0]
    for rank, (rows, shapes, non_tensor) in enumerate(gathered[1:], start=1):
        if rows != rows0:
            raise ValueError(
                f"all_gather_data_proto needs the same row count on every rank: rank 0 has "
                f"{rows0} rows, rank {rank} has {rows}; pad the DataProtos first"
            )
        if shapes != shapes0 or set(non_tensor) != set(non_tensor0):
            raise ValueError(
                "all_gather_data_proto needs the same keys and shapes on every rank: rank 0 "
                f"has {shapes0} and non-tensor keys {sorted(non_tensor0)}, rank {rank} has "
                f"{shapes} and {sorted(non_tensor)}"
            )


def _gather_batch(
    data: DataProto, leaves: list[tuple[Any, torch.Tensor]], size: int, group: Any
) -> tensordict.TensorDict:
    device = _collective_device(group)
    out = tensordict.TensorDict({}, batch_size=[len(data) * size], device=data.batch.device)
    for key, value in leaves:
        local = value.to(device).contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        out.set(key, torch.cat(parts, dim=0).to(value.device))
    return out


def _collective_device(group: Any) -> torch.device:
    """NCCL gathers on this rank's current CUDA device; gloo and others where tensors are."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
