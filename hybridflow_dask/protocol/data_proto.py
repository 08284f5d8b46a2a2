"""DataProto: the batch container that flows between the driver and worker groups.

Behaviour follows verl's ``DataProto`` so that verl code ports unchanged, with three
deliberate differences: input checks raise ``ValueError``/``TypeError``/``KeyError`` with a
message naming the key or lengths (never ``assert``); helpers that verl lets mutate their
input (padding for dispatch, folding, ``from_dict``'s non-tensor dict) leave it alone; and
pickling puts every tensor out of band (see :mod:`.serialization`).
"""

from __future__ import annotations

import builtins
import copy
import logging
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, cast, overload

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .checks import as_key_list, non_negative_int, positive_int
from .config import AUTO_PADDING_KEY, DataProtoConfig
from .large_memory import cat_rows
from .lazy_tensordict import tensordict
from .tensordict_ops import (
    as_row_indices,
    chunk_bounds,
    list_of_dict_to_dict_of_list,
    merge_concat_meta_info,
    merge_meta_info,
    to_object_array,
    union_numpy_dict,
    union_tensor_dict,
)

__all__ = ["DataProto", "DataProtoItem"]

logger = logging.getLogger(__name__)


def _check_one_batch_dim(num_batch_dims: Any) -> None:
    """verl's DataProto supports a single batch dimension; say so instead of half-working."""
    num_batch_dims = positive_int(num_batch_dims, "num_batch_dims")
    if num_batch_dims != 1:
        raise ValueError(
            f"num_batch_dims={num_batch_dims} is not supported: a DataProto has exactly one "
            "batch dimension (the rows). Flatten the leading dims first (tensor.flatten(0, "
            f"{num_batch_dims - 1})) or keep the extra dims as per-row data"
        )


def _split_width(key: str, shape: Sequence[int], n_split: int) -> int:
    """Width of one piece of dim 1, or a ValueError naming the key."""
    if len(shape) < 2:
        raise ValueError(
            f"cannot unfold {key!r}: it has shape {list(shape)}, it needs a second dimension "
            "to split"
        )
    if shape[1] % n_split:
        raise ValueError(
            f"cannot unfold {key!r}: its second dimension {shape[1]} is not divisible by "
            f"n_split={n_split}"
        )
    return shape[1] // n_split


def _unfold_tensor(key: str, value: Any, n_split: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot unfold {key!r}: it is a {type(value).__name__}, not a tensor")
    width = _split_width(key, value.shape, n_split)
    return value.reshape(value.shape[0] * n_split, width, *value.shape[2:])


def _unfold_array(key: str, value: np.ndarray, n_split: int) -> np.ndarray:
    if value.ndim >= 2:
        width = _split_width(key, value.shape, n_split)
        return value.reshape(value.shape[0] * n_split, width, *value.shape[2:])
    cells = list(value)
    sequences = all(isinstance(c, (list, tuple, np.ndarray)) for c in cells)
    lengths = {len(c) for c in cells} if sequences else set()
    if cells and len(lengths) != 1:
        raise ValueError(
            f"cannot unfold {key!r}: a 1-d non-tensor key must hold lists (or tuples, arrays) "
            f"of one common length, got {[type(c).__name__ for c in cells[:3]]}"
            f"{f' of lengths {sorted(lengths)}' if lengths else ''}"
        )
    width = _split_width(key, (len(cells), lengths.pop() if lengths else 0), n_split)
    if not cells:
        return to_object_array([])
    # The pieces come back as the object array numpy makes of them (rows of ``width``
    # cells, 2-d), as a verl user gets from reshaping the column: they compare cell by cell.
    pieces = [list(cell[j * width : (j + 1) * width]) for cell in cells for j in range(n_split)]
    return np.array(pieces, dtype=object)


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: ``batch`` has no batch dimension, non-tensor values are cells."""

    batch: tensordict.TensorDictBase = None  # None without tensors (typed as in DataProto)
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


class _RowIndexDataset(Dataset):
    """Yields row numbers, so make_iterator gathers each mini-batch with one indexing op."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class _TakeRows:
    """Picklable collate function: row numbers -> DataProto of those rows."""

    def __init__(self, data: DataProto) -> None:
        self.data = data

    def __call__(self, rows: list[int]) -> DataProto:
        return self.data.select_idxs(np.asarray(rows, dtype=np.int64))


@dataclass(eq=False, repr=False)
class DataProto:
    """A batch of N samples: tensors (``batch``), numpy arrays (``non_tensor_batch``), metadata.

    Every array in ``non_tensor_batch`` has N rows; ``meta_info`` is shared by all rows.
    Equality is deliberately not defined: compare the fields.

    ``batch`` is ``None`` when there are no tensors, but it is annotated without
    ``| None``, as verl annotates it, so that a worker's ``data.batch["x"]`` type-checks.
    """

    batch: tensordict.TensorDictBase = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ------------------------------------------------------------------ checks and info

    def check_consistency(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the key and lengths that disagree."""
        if self.batch is not None and not isinstance(self.batch, tensordict.TensorDictBase):
            raise TypeError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(
                f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}"
            )
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        if self.batch is not None and len(self.batch.batch_size) != 1:
            raise ValueError(
                "batch must have exactly one batch dimension (the rows), got batch_size "
                f"{list(self.batch.batch_size)}; DataProto supports num_batch_dims=1 only"
            )
        lengths: dict[str, int] = {}
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensor_batch[{key!r}] is a {type(value).__name__}; values must be numpy "
                    "arrays (DataProto.from_dict converts lists to object arrays)"
                )
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is 0-d; it needs one row per sample")
            lengths[key] = value.shape[0]
        if not lengths:
            return
        if self.batch is not None:
            reference, expected = "batch", int(self.batch.batch_size[0])
        else:
            first = next(iter(lengths))
            reference, expected = f"non_tensor_batch[{first!r}]", lengths[first]
        for key, length in lengths.items():
            if length != expected:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has length {length} but {reference} has "
                    f"length {expected}"
                )

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return int(next(iter(self.non_tensor_batch.values())).shape[0])
        return 0

    def __repr__(self) -> str:
        batch_keys = [] if self.batch is None else list(self.batch.keys(include_nested=True))
        return (
            f"{type(self).__name__}(len={len(self)}, batch_keys={batch_keys}, "
            f"non_tensor_keys={list(self.non_tensor_batch)}, meta_info_keys={list(self.meta_info)})"
        )

    def is_padding_enabled(self) -> bool:
        """True when this batch was built with ``auto_padding=True`` or padding is on globally."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    def get_data_info(self) -> str:
        """Human-readable list of keys with shapes, dtypes and devices."""
        lines = ["batch"]
        if self.batch is not None:
            for key, value in self.batch.items(include_nested=True, leaves_only=True):
                if isinstance(value, torch.Tensor):
                    lines.append(f"  {key}: {tuple(value.shape)} ({value.dtype}) {value.device}")
                else:
                    lines.append(f"  {key}: {type(value).__name__}")
        lines.append("non_tensor_batch")
        for key, array in self.non_tensor_batch.items():
            lines.append(f"  {key}: ndarray{array.shape} ({array.dtype})")
        lines.append("meta_info")
        for key, value in self.meta_info.items():
            lines.append(f"  {key}: {type(value).__name__}")
        return "\n".join(lines)

    def print_size(self, prefix: str = "") -> str:
        """Log (INFO, this module's logger) and return the tensor and numpy sizes in GiB."""
        tensor_bytes = 0
        if self.batch is not None:
            for value in self.batch.values(include_nested=True, leaves_only=True):
                if isinstance(value, torch.Tensor):
                    tensor_bytes += value.element_size() * value.numel()
        numpy_bytes = sum(array.nbytes for array in self.non_tensor_batch.values())
        message = (
            f"Size of tensordict: {tensor_bytes / 1024**3} GB, "
            f"size of non_tensor_batch: {numpy_bytes / 1024**3} GB"
        )
        if prefix:
            message = f"{prefix}, {message}"
        logger.info(message)
        return message

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors (same first dim, the rows) and per-row arrays.

        ``num_batch_dims`` exists for verl's signature; like verl, only 1 is supported
        (anything else is a ValueError rather than a batch that chunk/concat/dispatch
        would mishandle).

        Lists and tuples in ``non_tensors`` become 1-d object arrays with one element per row
        (equal-length inner lists stay whole rows). ``auto_padding=True`` records the flag in
        ``meta_info[AUTO_PADDING_KEY]``. The caller's dicts are not modified.
        """
        _check_one_batch_dim(num_batch_dims)
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        meta_info = dict(meta_info or {})
        batch_size = None
        pivot = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, (torch.Tensor, tensordict.TensorDictBase)):
                raise TypeError(f"tensors[{key!r}] is a {type(tensor).__name__}, not a tensor")
            if tensor.ndim < num_batch_dims:
                raise ValueError(
                    f"tensors[{key!r}] has shape {list(tensor.shape)}, fewer than "
                    f"num_batch_dims={num_batch_dims} dimensions"
                )
            current = tuple(tensor.shape[:num_batch_dims])
            if batch_size is None:
                batch_size, pivot = current, key
            elif current != batch_size:
                raise ValueError(
                    f"tensors disagree on the batch size: {pivot!r} has {list(batch_size)}, "
                    f"{key!r} has {list(current)}"
                )
        for key, value in non_tensors.items():
            if isinstance(value, (list, tuple)):
                non_tensors[key] = to_object_array(value)
            elif not isinstance(value, np.ndarray):
                raise TypeError(
                    f"non_tensors[{key!r}] is a {type(value).__name__}; expected a numpy array "
                    "or a list"
                )
        batch = tensordict.TensorDict(tensors, batch_size=batch_size) if tensors else None
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Split one dict into tensors and numpy arrays by type, then :meth:`from_dict`."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data[{key!r}] is a {type(value).__name__}; expected a tensor or numpy array"
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: tensordict.TensorDictBase,
        meta_info: Mapping | None = None,
        num_batch_dims: int = 1,
    ) -> DataProto:
        """Inverse of :meth:`to_tensordict`.

        NonTensorStack entries become object arrays, NonTensorData entries meta_info.
        """
        if not isinstance(tensor_dict, tensordict.TensorDictBase):
            raise TypeError(f"expected a TensorDict, got {type(tensor_dict).__name__}")
        _check_one_batch_dim(num_batch_dims)
        if len(tensor_dict.batch_size) != num_batch_dims:
            raise ValueError(
                f"tensor_dict has batch_size {list(tensor_dict.batch_size)}, expected "
                f"num_batch_dims={num_batch_dims}"
            )
        tensors, non_tensors, meta = {}, {}, {}
        for key, value in tensor_dict.items():
            if isinstance(value, tensordict.NonTensorStack):
                non_tensors[key] = to_object_array(value.tolist())
            elif tensordict.is_non_tensor(value):
                meta[key] = value.data
            else:
                tensors[key] = value
        meta.update(meta_info or {})
        batch = None
        if tensors or not non_tensors:
            batch = tensordict.TensorDict(
                tensors, batch_size=tensor_dict.batch_size, device=tensor_dict.device
            )
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def to_tensordict(self) -> tensordict.TensorDict:
        """One TensorDict: tensors as they are, arrays as NonTensorStack, meta as NonTensorData."""
        if self.batch is not None:
            out = self.batch.clone(recurse=False)
        else:
            out = tensordict.TensorDict({}, batch_size=[len(self)])
        for source, values in (
            ("non_tensor_batch", self.non_tensor_batch),
            ("meta_info", self.meta_info),
        ):
            for key in values:
                if key in out.keys():  # noqa: SIM118 (older tensordicts refuse `in`)
                    raise ValueError(f"key {key!r} of {source} is already in the TensorDict")
        for key, array in self.non_tensor_batch.items():
            out.set(key, tensordict.NonTensorStack.from_list(list(array)))
        for key, value in self.meta_info.items():
            out.set_non_tensor(key, value)
        return out

    # ------------------------------------------------------------------ row access

    def _with(
        self, batch: tensordict.TensorDictBase | None, non_tensor: dict, meta: dict | None = None
    ) -> DataProto:
        meta = dict(self.meta_info) if meta is None else meta
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def _take_rows(self, rows: np.ndarray) -> DataProto:
        """Gather rows (already normalised int64) into a new DataProto with copied data."""
        batch = None
        if self.batch is not None:
            batch = self.batch[torch.from_numpy(np.ascontiguousarray(rows))]
        non_tensor = {key: value[rows] for key, value in self.non_tensor_batch.items()}
        return self._with(batch, non_tensor)

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows by integer indices or a boolean mask (list, ndarray or tensor)."""
        return self._take_rows(as_row_indices(idxs, len(self)))

    def slice(
        self, start: int | None = None, end: int | None = None, step: int | None = None
    ) -> DataProto:
        """Rows ``start:end:step``; views where the step is positive (like tensor slicing)."""
        window = slice(start, end, step)
        if step is not None and step <= 0:
            if step == 0:
                raise ValueError("slice step cannot be zero")
            return self._take_rows(np.arange(len(self), dtype=np.int64)[window])
        batch = self.batch[window] if self.batch is not None else None
        non_tensor = {key: value[window] for key, value in self.non_tensor_batch.items()}
        return self._with(batch, non_tensor)

    @overload
    def __getitem__(self, item: int | np.integer) -> DataProtoItem: ...
    @overload
    def __getitem__(
        self, item: builtins.slice | list | tuple | range | np.ndarray
    ) -> DataProto: ...
    @overload
    def __getitem__(self, item: Any) -> DataProto | DataProtoItem: ...
    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, range, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            length = len(self)
            if not -length <= item < length:
                raise IndexError(f"index {item} is out of range for a DataProto of length {length}")
            batch = self.batch[int(item)] if self.batch is not None else None
            non_tensor = {key: value[item] for key, value in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)
        raise TypeError(f"cannot index a DataProto with {type(item).__name__}")

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    # ------------------------------------------------------------------ keys

    def select(
        self,
        batch_keys: Sequence | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Keep only the named keys (``None`` keeps a whole part); unknown keys are a KeyError.

        With ``deepcopy=True`` the result shares nothing with ``self`` (verl copies only the
        non-tensor and meta parts; we also clone the tensors).
        """
        batch = self.batch
        if batch_keys is not None:
            keys = as_key_list(batch_keys, "batch_keys")
            present = set() if batch is None else set(batch.keys(include_nested=True))
            missing = [k for k in keys if k not in present]
            if missing:
                raise KeyError(
                    f"batch keys not found: {missing}; available: {sorted(map(str, present))}"
                )
            batch = batch.select(*keys) if batch is not None else None
        elif batch is not None:
            batch = batch.clone(recurse=False)
        non_tensor = dict(self.non_tensor_batch)
        if non_tensor_batch_keys is not None:
            keys = as_key_list(non_tensor_batch_keys, "non_tensor_batch_keys")
            missing = [k for k in keys if k not in self.non_tensor_batch]
            if missing:
                raise KeyError(
                    f"non_tensor_batch keys not found: {missing}; "
                    f"available: {list(self.non_tensor_batch)}"
                )
            non_tensor = {k: v for k, v in self.non_tensor_batch.items() if k in keys}
        meta = dict(self.meta_info)
        if meta_info_keys is not None:
            keys = as_key_list(meta_info_keys, "meta_info_keys")
            missing = [k for k in keys if k not in self.meta_info]
            if missing:
                raise KeyError(
                    f"meta_info keys not found: {missing}; available: {list(self.meta_info)}"
                )
            meta = {k: v for k, v in self.meta_info.items() if k in keys}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor = copy.deepcopy(non_tensor)
            meta = copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the named keys from ``self`` and return them as a new DataProto.

        Every key is checked before anything is removed, so a KeyError leaves ``self`` intact.
        """
        batch_keys = as_key_list(batch_keys, "batch_keys")
        non_tensor_keys = as_key_list(non_tensor_batch_keys, "non_tensor_batch_keys")
        meta_keys = as_key_list(meta_info_keys, "meta_info_keys")
        present = set() if self.batch is None else set(self.batch.keys(include_nested=True))
        problems = [
            ("batch", [k for k in batch_keys if k not in present]),
            ("non_tensor_batch", [k for k in non_tensor_keys if k not in self.non_tensor_batch]),
            ("meta_info", [k for k in meta_keys if k not in self.meta_info]),
        ]
        for part, missing in problems:
            if missing:
                raise KeyError(f"cannot pop {part} keys not found: {missing}")
        batch = None
        if batch_keys:
            popped = {key: self.batch.pop(key) for key in batch_keys}
            batch = tensordict.TensorDict(
                batch_size=self.batch.batch_size, device=self.batch.device
            )
            for key, value in popped.items():
                batch.set(key, value)
        non_tensor = {key: self.non_tensor_batch.pop(key) for key in non_tensor_keys}
        meta = {key: self.meta_info.pop(key) for key in meta_keys}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(
        self,
        old_keys: str | Sequence[str] | None = None,
        new_keys: str | Sequence[str] | None = None,
    ) -> DataProto:
        """Rename batch or non-tensor keys in place and return ``self``.

        An unknown old key is a KeyError; a new key that already exists is a ValueError.
        """
        olds = as_key_list(old_keys, "old_keys")
        news = as_key_list(new_keys, "new_keys")
        if len(olds) != len(news):
            raise ValueError(
                "rename needs as many new keys as old keys, "
                f"got {len(olds)} old and {len(news)} new"
            )
        batch_keys = set() if self.batch is None else set(self.batch.keys())
        if len(set(news)) != len(news):
            raise ValueError(f"new keys must be distinct, got {news}")
        for old, new in zip(olds, news):
            if old not in batch_keys and old not in self.non_tensor_batch:
                raise KeyError(f"cannot rename {old!r}: no such batch or non-tensor key")
            taken = (batch_keys | set(self.non_tensor_batch)) - set(olds)
            if new in taken:
                raise ValueError(f"cannot rename {old!r} to {new!r}: {new!r} already exists")
        tensors = {old: self.batch.pop(old) for old in olds if old in batch_keys}
        arrays = {
            old: self.non_tensor_batch.pop(old) for old in olds if old in self.non_tensor_batch
        }
        for old, new in zip(olds, news):
            if old in tensors:
                self.batch.set(new, tensors[old])
            else:
                self.non_tensor_batch[new] = arrays[old]
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` in place (verl semantics) and return ``self``.

        Shared keys must hold equal values; a conflict is a ValueError naming the key and
        leaves ``self`` unchanged.
        """
        if not isinstance(other, DataProto):
            raise TypeError(f"can only union a DataProto, got {type(other).__name__}")
        self_has_rows = self.batch is not None or bool(self.non_tensor_batch)
        other_has_rows = other.batch is not None or bool(other.non_tensor_batch)
        if self_has_rows and other_has_rows and len(self) != len(other):
            raise ValueError(f"cannot union DataProtos of lengths {len(self)} and {len(other)}")
        batch = self.batch.clone(recurse=False) if self.batch is not None else None
        if other.batch is not None:
            batch = (
                other.batch.clone(recurse=False)
                if batch is None
                else union_tensor_dict(batch, other.batch)
            )
        non_tensor = union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        meta = merge_meta_info(dict(self.meta_info), other.meta_info)
        merged = type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
        self.batch, self.non_tensor_batch, self.meta_info = (
            merged.batch,
            merged.non_tensor_batch,
            merged.meta_info,
        )
        return self

    # ------------------------------------------------------------------ splitting and joining

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` parts along the rows (views, no copy).

        Equal parts when the length divides; otherwise, only with padding enabled, the first
        ``len % chunks`` parts are one row longer (parts may be empty when ``len < chunks``).
        """
        chunks = positive_int(chunks, "chunks")
        length = len(self)
        if length % chunks and not self.is_padding_enabled():
            raise ValueError(
                f"cannot chunk a DataProto of length {length} into {chunks} equal parts "
                f"({length} is not divisible by {chunks}). Enable auto padding "
                "(DataProtoConfig.auto_padding = True, VERL_AUTO_PADDING=1, or "
                "DataProto.from_dict(..., auto_padding=True)) to allow uneven chunks, or pad "
                "first with pad_dataproto_to_divisor()"
            )
        return [self.slice(start, end) for start, end in chunk_bounds(length, chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows; the last one may be shorter."""
        split_size = positive_int(split_size, "split_size")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Join along the rows into fresh storage; meta_info merged as verl does.

        ``meta_info["metrics"]`` dicts from the inputs become one dict mapping each metric
        name to the list of the inputs' values (list values are flattened in); any other
        meta key is kept once, and two inputs holding different values for it are a
        ValueError naming the key and both values.
        """
        items = list(data)
        if not items:
            raise ValueError("DataProto.concat needs at least one DataProto")
        for i, item in enumerate(items):
            if not isinstance(item, DataProto):
                raise TypeError(f"DataProto.concat item #{i} is a {type(item).__name__}")
        meta = merge_concat_meta_info([item.meta_info for item in items])
        parts = [
            item for item in items if item.batch is not None or item.non_tensor_batch
        ] or items[:1]
        with_batch = [i for i, item in enumerate(parts) if item.batch is not None]
        if with_batch and len(with_batch) != len(parts):
            raise ValueError("cannot concat DataProtos with a batch and DataProtos without one")
        batch = None
        if with_batch:
            reference = set(parts[0].batch.keys(include_nested=True, leaves_only=True))
            for i, item in enumerate(parts[1:], start=1):
                keys = set(item.batch.keys(include_nested=True, leaves_only=True))
                if keys != reference:
                    raise ValueError(
                        f"cannot concat: batch keys differ, item #{i} lacks "
                        f"{sorted(map(str, reference - keys))} and adds "
                        f"{sorted(map(str, keys - reference))}"
                    )
            batch = cat_rows([item.batch for item in parts])
        reference_nt = list(parts[0].non_tensor_batch)
        for i, item in enumerate(parts[1:], start=1):
            if set(item.non_tensor_batch) != set(reference_nt):
                raise ValueError(
                    "cannot concat: non_tensor_batch keys differ, "
                    f"item #0 has {sorted(reference_nt)}, "
                    f"item #{i} has {sorted(item.non_tensor_batch)}"
                )
        columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in parts])
        non_tensor = {key: np.concatenate(values, axis=0) for key, values in columns.items()}
        return type(items[0])(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def reorder(self, indices: Any) -> None:
        """Reorder (or gather) the rows in place, like verl."""
        taken = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` when interleaved, ``abab`` otherwise."""
        times = non_negative_int(repeat_times, "repeat_times")
        rows = np.arange(len(self), dtype=np.int64)
        return self._take_rows(np.repeat(rows, times) if interleave else np.tile(rows, times))

    def unfold_column_chunks(
        self, n_split: int, split_keys: str | Sequence[str] | None = None
    ) -> DataProto:
        """Cut dim 1 of each ``split_keys`` entry into ``n_split`` pieces, one row per piece.

        Row ``i`` becomes rows ``i * n_split`` to ``i * n_split + n_split - 1``; every other
        key (tensor or non-tensor) repeats its row ``n_split`` times. This keeps a group
        (dim 1) together until it is unfolded, e.g. after a shuffle. A non-tensor key may
        be a 2-d array or a 1-d object array of equal-length sequences; the pieces of the
        latter come back as a 2-d object array (one row of cells per piece), as verl's are.
        """
        n_split = positive_int(n_split, "n_split")
        keys = as_key_list(split_keys, "split_keys")
        batch_keys = set() if self.batch is None else set(self.batch.keys())
        unknown = [k for k in keys if k not in batch_keys and k not in self.non_tensor_batch]
        if unknown:
            raise KeyError(
                f"split_keys not found: {unknown}; batch keys: {sorted(map(str, batch_keys))}, "
                f"non_tensor_batch keys: {list(self.non_tensor_batch)}"
            )
        out = self._take_rows(np.repeat(np.arange(len(self), dtype=np.int64), n_split))
        for key in keys:
            if key in batch_keys:
                out.batch.set(key, _unfold_tensor(key, self.batch.get(key), n_split))
            else:
                out.non_tensor_batch[key] = _unfold_array(key, self.non_tensor_batch[key], n_split)
        return out

    def sample_level_repeat(self, repeat_times: Any) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times (interleaved)."""
        if isinstance(repeat_times, torch.Tensor):
            counts = repeat_times.detach().cpu().numpy()
        elif isinstance(repeat_times, (list, tuple, np.ndarray)):
            counts = np.asarray(repeat_times)
        else:
            raise TypeError(
                "repeat_times must be a list, tuple, ndarray or tensor, "
                f"got {type(repeat_times).__name__}"
            )
        if counts.ndim != 1:
            raise ValueError(f"repeat_times must be one-dimensional, got shape {counts.shape}")
        if counts.size and counts.dtype.kind not in "iu":
            raise TypeError(f"repeat_times must hold integers, got dtype {counts.dtype}")
        if len(counts) != len(self):
            raise ValueError(
                f"repeat_times has {len(counts)} entries but the DataProto has length {len(self)}"
            )
        if counts.size and counts.min() < 0:
            raise ValueError(f"repeat_times must be >= 0, got {int(counts.min())}")
        return self._take_rows(
            np.repeat(np.arange(len(self), dtype=np.int64), counts.astype(np.int64))
        )

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the last row (``"first"``: first row), in place.

        This is verl's in-place method; dispatch uses :func:`pad_dataproto_to_divisor`, which
        never touches its input.
        """
        size = non_negative_int(padding_size, "padding_size")
        if padding_candidate not in ("", "first", "last"):
            raise ValueError(
                f"padding_candidate must be '', 'first' or 'last', got {padding_candidate!r}"
            )
        if size == 0:
            return
        length = len(self)
        if length == 0:
            raise ValueError("cannot pad an empty DataProto: there is no row to copy")
        row = 0 if padding_candidate == "first" else length - 1
        rows = np.concatenate(
            [np.arange(length, dtype=np.int64), np.full(size, row, dtype=np.int64)]
        )
        padded = self._take_rows(rows)
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: Mapping | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows for ``epochs`` passes, via a torch DataLoader.

        ``dataloader_kwargs`` go to the DataLoader (``shuffle=True`` uses ``seed``). Each
        mini-batch is gathered with one indexing op and carries a copy of ``meta_info``.
        """
        mini_batch_size = positive_int(mini_batch_size, "mini_batch_size")
        epochs = non_negative_int(epochs, "epochs")
        if len(self) % mini_batch_size:
            raise ValueError(
                f"DataProto length {len(self)} is not divisible by "
                f"mini_batch_size {mini_batch_size}"
            )
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        loader = DataLoader(
            _RowIndexDataset(len(self)),
            batch_size=mini_batch_size,
            collate_fn=_TakeRows(self),
            generator=generator,
            **dict(dataloader_kwargs or {}),
        )

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                for mini_batch in loader:
                    mini_batch.meta_info = dict(self.meta_info)
                    yield mini_batch

        return batches()

    # ------------------------------------------------------------------ devices, disk, copies

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensors to ``device`` in place and return ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Pickle (protocol 5) to ``filepath``."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        """Load what :meth:`save_to_disk` wrote; only open files you trust (this is pickle)."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(
                f"{os.fspath(filepath)!r} holds a {type(data).__name__}, not a DataProto"
            )
        return data

    def __copy__(self) -> DataProto:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> DataProto:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.batch = self.batch.clone() if self.batch is not None else None
        new.non_tensor_batch = copy.deepcopy(self.non_tensor_batch, memo)
        new.meta_info = copy.deepcopy(self.meta_info, memo)
        return new

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        """Tensors and numeric arrays travel as out-of-band buffers under protocol 5."""
        from .serialization import reduce_dataproto

        return reduce_dataproto(self, cast(int, protocol))  # pickle passes an int


_BATCH_OPS_NAMES = frozenset(
    {
        "collate_fn",
        "fold_batch_dim",
        "pad_dataproto_to_divisor",
        "unfold_batch_dim",
        "unpad_dataproto",
    }
)


def __getattr__(name: str) -> Any:
    """Keep ``data_proto.pad_dataproto_to_divisor`` & co. importable; they live in batch_ops."""
    if name in _BATCH_OPS_NAMES:
        from . import batch_ops

        return getattr(batch_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
