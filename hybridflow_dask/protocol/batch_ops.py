"""Module-level DataProto helpers: dispatch padding, batch folding, collation.

``pad_dataproto_to_divisor`` is what dispatch uses; unlike verl's padding it never
modifies the batch it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from .checks import non_negative_int, positive_int
from .data_proto import DataProto, DataProtoItem
from .tensordict_ops import list_of_dict_to_dict_of_list, to_object_array

__all__ = [
    "collate_fn",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "unfold_batch_dim",
    "unpad_dataproto",
]

logger = logging.getLogger(__name__)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` to a multiple of ``size_divisor`` with copies of its leading rows.

    Rows are taken from the start, cycling when more padding than rows is needed. Returns a
    new DataProto and the number of rows added; ``data`` itself is never modified.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"expected a DataProto, got {type(data).__name__}")
    size_divisor = positive_int(size_divisor, "size_divisor")
    length = len(data)
    pad_size = (-length) % size_divisor
    if pad_size == 0 or length == 0:
        if length == 0:
            logger.warning("padding an empty DataProto: nothing to copy, returned unchanged")
        batch = data.batch.clone(recurse=False) if data.batch is not None else None
        return data._with(batch, dict(data.non_tensor_batch)), 0
    rows = np.concatenate(
        [np.arange(length, dtype=np.int64), np.arange(pad_size, dtype=np.int64) % length]
    )
    return data._take_rows(rows), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (the inverse of :func:`pad_dataproto_to_divisor`)."""
    pad_size = non_negative_int(pad_size, "pad_size")
    if pad_size > len(data):
        raise ValueError(f"pad_size {pad_size} is larger than the DataProto length {len(data)}")
    if pad_size == 0:
        return data
    return data.slice(0, len(data) - pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Reshape N rows into ``new_batch_size`` rows of ``N // new_batch_size`` samples each."""
    new_batch_size = positive_int(new_batch_size, "new_batch_size")
    length = len(data)
    if length % new_batch_size:
        raise ValueError(
            f"cannot fold a DataProto of length {length} into {new_batch_size} rows: "
            f"{length} is not divisible by {new_batch_size}"
        )
    batch = None
    if data.batch is not None:
        batch = data.batch.reshape(new_batch_size, -1)
        batch.batch_size = (new_batch_size,)
    non_tensor = {
        key: value.reshape(new_batch_size, -1, *value.shape[1:])
        for key, value in data.non_tensor_batch.items()
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Flatten the leading ``batch_dims`` dims back into one batch dimension (undoes folding)."""
    batch_dims = positive_int(batch_dims, "batch_dims")
    batch = None
    if data.batch is not None:
        batch = data.batch.clone(recurse=False)
        batch.auto_batch_size_(batch_dims=batch_dims)
        if len(batch.batch_size) != batch_dims:
            raise ValueError(
                f"cannot unfold {batch_dims} batch dims: the tensors share only "
                f"{list(batch.batch_size)}"
            )
        batch = batch.reshape(-1)
        length = int(batch.batch_size[0])
    elif data.non_tensor_batch:
        first = next(iter(data.non_tensor_batch.values()))
        length = int(np.prod(first.shape[:batch_dims]))
    else:
        length = 0
    non_tensor = {}
    for key, value in data.non_tensor_batch.items():
        if value.ndim < batch_dims:
            raise ValueError(
                f"non_tensor_batch[{key!r}] has {value.ndim} dims, fewer than {batch_dims}"
            )
        non_tensor[key] = value.reshape(length, *value.shape[batch_dims:])
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def collate_fn(x: Sequence[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems (e.g. from a DataLoader over a DataProto) into one DataProto."""
    items = list(x)
    if not items:
        raise ValueError("collate_fn needs at least one DataProtoItem")
    batches = [item.batch for item in items]
    batch = None
    if any(b is not None for b in batches):
        if any(b is None for b in batches):
            raise ValueError("cannot collate DataProtoItems with and without a batch")
        batch = torch.stack(batches).contiguous()
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in items])
    non_tensor = {key: to_object_array(values) for key, values in columns.items()}
    return DataProto(batch=batch, non_tensor_batch=non_tensor)
