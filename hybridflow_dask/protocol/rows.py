"""Row operations shared by the two batch types dispatch splits: DataProto and TensorDict.

Dispatch and ``DataProtoFuture`` routing only need to count, gather, concatenate and pad
rows; doing that through these helpers lets a bare ``TensorDict`` travel the same paths
as a DataProto, with the same padding rules.
"""

from __future__ import annotations

import math
import operator
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
    "CUT_MARK",
    "Batch",
    "PadRows",
    "concat_batches",
    "cut_from",
    "cut_rows",
    "gather_rows",
    "is_batch",
    "pad_for_dispatch",
    "padding_enabled",
    "padding_rows",
    "row_count",
    "slice_rows",
]

#: What a DP dispatch mode splits by rows.
Batch: TypeAlias = "DataProto | TensorDictBase"


class PadRows(int):
    """A padding row count that also knows how many trailing chunks hold padding.

    It is an ``int`` (verl code reads the pad count from the dispatched kwargs as one);
    ``padded_chunks`` lets list results (``DP_COMPUTE_METRIC``) drop the entries of the
    ranks that computed on padding. ``padded_rows`` (the rows the ranks were sent, real
    and padding) and ``chunks`` (how many ranks they were split over) let
    :func:`padding_rows` take the padding off a result that has several rows per input
    row; both are ``None`` for a pad made without them.
    """

    padded_chunks: int
    padded_rows: int | None
    chunks: int | None

    def __new__(
        cls,
        rows: int,
        padded_chunks: int,
        padded_rows: int | None = None,
        chunks: int | None = None,
    ) -> PadRows:
        obj = super().__new__(cls, rows)
        obj.padded_chunks = int(padded_chunks)
        obj.padded_rows = None if padded_rows is None else int(padded_rows)
        obj.chunks = None if chunks is None else int(chunks)
        return obj

    @classmethod
    def for_chunks(cls, rows: int, chunks: int) -> PadRows:
        """The pad that brings ``rows`` to equal chunks of ``ceil(rows / chunks)`` rows."""
        size = -(-rows // chunks) if rows else 0
        pad = size * chunks - rows
        return cls(pad, math.ceil(pad / size) if pad else 0, size * chunks, chunks)

    def __reduce__(self) -> tuple:
        return (PadRows, (int(self), self.padded_chunks, self.padded_rows, self.chunks))

    def __repr__(self) -> str:
        return (
            f"PadRows({int(self)}, padded_chunks={self.padded_chunks}, "
            f"padded_rows={self.padded_rows}, chunks={self.chunks})"
        )


def padding_rows(pad: int, rows: int, source: str = "") -> int:
    """How many trailing rows of a result ``rows`` long came from padding.

    ``pad`` is the padding the call's input was given. A ``PadRows`` that knows the
    padded input's size (``padded_rows``, P: the real rows plus ``pad``) accepts a result
    of ``k * P`` rows for any whole ``k >= 0``, i.e. ``k`` result rows for every row sent,
    a row's results next to each other and in input order (what
    ``DataProto.repeat(k, interleave=True)`` gives, or one row per row for ``k = 1``):
    its last ``k * pad`` rows are the padding's and are dropped. Any other length is a
    ``ValueError`` naming ``source`` (the ``"group.method"`` that returned it), the rows
    it was sent and the rows it returned: which rows came from padding cannot be told
    then. A plain int (verl's pad count) drops ``pad`` rows, as verl does.
    """
    count = int(pad)
    if count == 0:
        return 0
    padded = getattr(pad, "padded_rows", None)
    who = source or "the method"
    if padded is None:
        if count > rows:
            raise ValueError(
                f"{who} returned {rows} rows, fewer than the {count} rows of auto padding "
                "its input was given, so the padding cannot be taken off; return at least "
                "one row per input row, or turn auto padding off and send a multiple of "
                "the world size"
            )
        return count
    if padded and rows % padded == 0:
        return rows // padded * count
    chunks = getattr(pad, "chunks", None)
    multiple = f"a multiple of {chunks} rows" if chunks else "a multiple of the world size"
    raise ValueError(
        f"{who} returned {rows} rows for the {padded} rows it was sent ({padded - count} "
        f"rows + {count} rows of auto padding): with auto padding a result must have the "
        f"same number k of rows for every row sent (k * {padded} rows, in input order; its "
        f"last k * {count} rows are the padding's and are dropped), else the padding's rows "
        f"cannot be told apart. Return k rows per input row, or turn auto padding off and "
        f"send {multiple}"
    )


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


#: The attribute a chunk of ``cut_rows`` keeps its source under: bookkeeping of the
#: driver's process, never serialized or sent with the chunk.
CUT_MARK = "_cut_from"


def cut_rows(data: Batch, bounds: Sequence[tuple[int, int]]) -> list[Batch]:
    """``data`` cut at ``bounds`` (one chunk per rank). A DataProto chunk remembers the
    batch and rows it was cut from (``cut_from``): a backend that sends several ranks'
    chunks to one process may send their rows there as one piece instead."""
    chunks = [slice_rows(data, lo, hi) for lo, hi in bounds]
    if isinstance(data, DataProto):
        for chunk, (lo, hi) in zip(chunks, bounds):
            fields = (chunk.batch, chunk.non_tensor_batch, chunk.meta_info)
            vars(chunk)[CUT_MARK] = (data, lo, hi, fields)
    return chunks


def cut_from(chunk: Any) -> tuple[DataProto, int, int] | None:
    """The batch and rows ``(source, start, stop)`` a DataProto chunk of ``cut_rows`` was
    cut from, else ``None``; also ``None`` once a field of the chunk was replaced (a
    shallow copy given new rows, say), when its rows may no longer be the source's."""
    mark = getattr(chunk, CUT_MARK, None) if type(chunk) is DataProto else None
    if mark is None:
        return None
    source, start, stop, fields = mark
    if any(map(operator.is_not, (chunk.batch, chunk.non_tensor_batch, chunk.meta_info), fields)):
        return None
    return source, start, stop


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
