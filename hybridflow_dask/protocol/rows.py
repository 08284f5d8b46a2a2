"""Row operations shared by the two batch types dispatch splits: DataProto and TensorDict.

Dispatch and ``DataProtoFuture`` routing only need to count, gather, concatenate and pad
rows; doing that through these helpers lets a bare ``TensorDict`` travel the same paths
as a DataProto, with the same padding rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch

from .config import AUTO_PADDING_KEY, DataProtoConfig
from .data_proto import DataProto
from .lazy_tensordict import is_tensordict, tensordict

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = [
    "Batch",
    "PadRows",
    "concat_batches",
    "gather_rows",
    "is_batch",
    "pad_for_dispatch",
    "padding_enabled",
    "row_count",
    "slice_rows",
]

#: What a DP dispatch mode splits by rows.
Batch: TypeAlias = "DataProto | TensorDictBase"


class PadRows(int):
    """A padding row count that also knows how many trailing chunks hold padding.

    It is an ``int`` (verl code reads the pad count from the dispatched kwargs as one);
    ``padded_chunks`` lets list results (``DP_COMPUTE_METRIC``) drop the entries of the
    ranks that computed on padding.
    """

    padded_chunks: int

    def __new__(cls, rows: int, padded_chunks: int) -> PadRows:
        obj = super().__new__(cls, rows)
        obj.padded_chunks = int(padded_chunks)
        return obj

    @classmethod
    def for_chunks(cls, rows: int, chunks: int) -> PadRows:
        """The pad that brings ``rows`` to equal chunks of ``ceil(rows / chunks)`` rows."""
        size = -(-rows // chunks) if rows else 0
        pad = size * chunks - rows
        return cls(pad, math.ceil(pad / size) if pad else 0)

    def __reduce__(self) -> tuple:
        return (PadRows, (int(self), self.padded_chunks))

    def __repr__(self) -> str:
        return f"PadRows({int(self)}, padded_chunks={self.padded_chunks})"


def is_batch(value: Any) -> bool:
    """True for the row containers dispatch can split (DataProto, TensorDict)."""
    return isinstance(value, DataProto) or is_tensordict(value)


def row_count(data: Batch) -> int:
    if isinstance(data, DataProto):
        return len(data)
    if len(data.batch_size) == 0:
        raise ValueError("a TensorDict with batch_size [] has no rows to split; give it one")
    return int(data.batch_size[0])


def gather_rows(data: Batch, rows: np.ndarray) -> Batch:
    """The given rows (int64 positions), copied, in that order."""
    if isinstance(data, DataProto):
        return data.select_idxs(rows)
    return data[torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))]


def slice_rows(data: Batch, start: int, stop: int) -> Batch:
    if isinstance(data, DataProto):
        return data.slice(start, stop)
    return data[start:stop]


def concat_batches(parts: Sequence[Batch]) -> Batch:
    """Join along the rows: ``DataProto.concat`` or ``torch.cat`` for TensorDicts."""
    items = list(parts)
    if not items:
        raise ValueError("nothing to concatenate")
    if all(isinstance(p, DataProto) for p in items):
        return DataProto.concat(items)
    if all(is_tensordict(p) for p in items):
        return torch.cat(items, dim=0)
    kinds = sorted({type(p).__name__ for p in items})
    raise TypeError(f"cannot concatenate a mix of {kinds}; every part must be the same kind")


def padding_enabled(data: Batch) -> bool:
    """Auto padding is on globally (config or ``VERL_AUTO_PADDING``) or for this batch.

    A TensorDict turns it on for itself with a non-tensor entry ``_verl_auto_padding``
    set to True (what ``DataProto.to_tensordict`` writes for ``auto_padding=True``).
    """
    if DataProtoConfig.auto_padding:
        return True
    if isinstance(data, DataProto):
        return data.is_padding_enabled()
    if AUTO_PADDING_KEY not in data.keys():  # noqa: SIM118 (older tensordicts refuse `in`)
        return False
    flag = data.get(AUTO_PADDING_KEY)
    return bool(flag.data if tensordict.is_non_tensor(flag) else flag)


def pad_for_dispatch(data: Batch, chunks: int) -> tuple[Batch, PadRows]:
    """Pad to a multiple of ``chunks`` rows by repeating the last row, as verl's dispatch does.

    Returns a new batch and the pad; ``data`` itself is never modified. An empty batch is
    returned as is (there is no row to repeat).
    """
    rows = row_count(data)
    pad = PadRows.for_chunks(rows, chunks)
    if pad == 0:
        return data, pad
    positions = np.concatenate(
        [np.arange(rows, dtype=np.int64), np.full(int(pad), rows - 1, dtype=np.int64)]
    )
    return gather_rows(data, positions), pad
