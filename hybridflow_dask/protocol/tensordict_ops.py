"""Helpers on TensorDicts, numpy dicts and index arrays that DataProto builds on.

They live apart from :mod:`.data_proto` so that the container stays readable and so that
dispatch code can reuse them on bare TensorDicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .lazy_tensordict import tensordict

_METRICS_KEY = "metrics"

__all__ = [
    "arrays_equal",
    "as_row_indices",
    "chunk_bounds",
    "list_of_dict_to_dict_of_list",
    "merge_concat_meta_info",
    "merge_meta_info",
    "tensors_equal",
    "to_object_array",
    "union_numpy_dict",
    "union_tensor_dict",
    "values_equal",
]


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality of two tensors, NaN equal to NaN, different dtype/shape unequal."""
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(torch.all((a == b) | both_nan))
    return False


def arrays_equal(a: np.ndarray, b: np.ndarray, _seen: set | None = None) -> bool:
    """Elementwise equality of two numpy arrays, including object arrays of any content.

    Object arrays may contain themselves (directly or through lists and dicts): a pair of
    containers already being compared further up counts as equal, so cycles terminate.
    """
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    if a.dtype == object or b.dtype == object:
        return _pair_equal(a, b, _seen, _object_arrays_equal)
    if a.dtype.kind in "fcmM" and b.dtype.kind == a.dtype.kind:
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def values_equal(a: Any, b: Any, _seen: set | None = None) -> bool:
    """Equality for meta_info values and object-array cells: tensors, arrays, containers, NaN.

    Self-referencing containers compare without endless recursion (see :func:`arrays_equal`).
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        both = isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        return both and arrays_equal(a, b, _seen)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and _pair_equal(a, b, _seen, _mappings_equal)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        return _pair_equal(a, b, _seen, _sequences_equal)
    try:
        if bool(a == b):
            return True
    except Exception:  # ambiguous or failing __eq__: treat as different
        return False
    return _is_nan(a) and _is_nan(b)


def _pair_equal(a: Any, b: Any, seen: set | None, compare: Any) -> bool:
    """Run ``compare(a, b, seen)`` unless this pair is already on the comparison path."""
    seen = set() if seen is None else seen
    pair = (id(a), id(b))
    if pair in seen:
        return True  # a cycle: equality is decided by the rest of the structure
    seen.add(pair)
    try:
        return compare(a, b, seen)
    finally:
        seen.discard(pair)


def _object_arrays_equal(a: np.ndarray, b: np.ndarray, seen: set) -> bool:
    return all(values_equal(x, y, seen) for x, y in zip(a.ravel(), b.ravel()))


def _mappings_equal(a: Mapping, b: Mapping, seen: set) -> bool:
    return all(values_equal(a[k], b[k], seen) for k in a)


def _sequences_equal(a: Sequence, b: Sequence, seen: set) -> bool:
    return all(values_equal(x, y, seen) for x, y in zip(a, b))


def _is_nan(value: Any) -> bool:
    """NaN floats/complex and NaT datetimes (which never compare equal to themselves)."""
    if isinstance(value, (float, complex, np.floating, np.complexfloating)):
        return bool(np.isnan(value))
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return bool(np.isnat(value))
    return False


def union_tensor_dict(
    tensor_dict1: tensordict.TensorDictBase, tensor_dict2: tensordict.TensorDictBase
) -> tensordict.TensorDictBase:
    """Add the entries of ``tensor_dict2`` to ``tensor_dict1`` in place and return it.

    Keys present in both must hold equal tensors; otherwise ``ValueError`` names the key.
    Nothing is written unless every shared key agrees.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            "cannot union TensorDicts with different batch sizes: "
            f"{list(tensor_dict1.batch_size)} and {list(tensor_dict2.batch_size)}"
        )
    keys1 = set(tensor_dict1.keys(include_nested=True, leaves_only=True))
    to_add = []
    for key in tensor_dict2.keys(include_nested=True, leaves_only=True):
        value = tensor_dict2.get(key)
        if key in keys1:
            mine = tensor_dict1.get(key)
            if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor):
                same = tensors_equal(mine, value)
            else:
                same = values_equal(mine, value)
            if not same:
                raise ValueError(f"cannot union: key {key!r} holds different values in both")
        else:
            to_add.append((key, value))
    for key, value in to_add:
        tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(
    tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add the arrays of ``tensor_dict2`` to ``tensor_dict1`` in place and return it.

    Keys present in both must hold elementwise-equal arrays (``ValueError`` names the key).
    """
    for key, value in tensor_dict2.items():
        if not isinstance(value, np.ndarray):
            raise TypeError(
                f"non-tensor value for key {key!r} is {type(value).__name__}, not ndarray"
            )
        if key in tensor_dict1 and not arrays_equal(tensor_dict1[key], value):
            raise ValueError(f"cannot union: non-tensor key {key!r} holds different values in both")
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def merge_meta_info(meta1: dict, meta2: Mapping) -> dict:
    """Add ``meta2`` to ``meta1`` in place; a key in both must hold equal values."""
    for key, value in meta2.items():
        if key in meta1 and not values_equal(meta1[key], value):
            raise ValueError(f"cannot union: meta_info key {key!r} holds different values in both")
    meta1.update(meta2)
    return meta1


def list_of_dict_to_dict_of_list(list_of_dict: list[Mapping]) -> dict[Any, list]:
    """``[{"a": 1}, {"a": 2}] -> {"a": [1, 2]}``; the first dict fixes the keys.

    A later dict with a key the first lacks is a ``KeyError`` naming it.
    """
    if not list_of_dict:
        return {}
    output: dict[Any, list] = {key: [] for key in list_of_dict[0]}
    for position, item in enumerate(list_of_dict):
        for key, value in item.items():
            if key not in output:
                raise KeyError(f"dict #{position} has key {key!r} that dict #0 lacks")
            output[key].append(value)
    return output


def to_object_array(values: Iterable[Any]) -> np.ndarray:
    """One row per element, whatever the elements are (lists of equal length stay rows)."""
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def as_row_indices(idxs: Any, length: int) -> np.ndarray:
    """Normalise row selectors (ints or a boolean mask; list, ndarray or tensor) to int64 rows.

    Negative indices count from the end. Raises ``TypeError`` for other kinds,
    ``ValueError`` for a mask of the wrong length, ``IndexError`` for an index out of range.
    """
    if isinstance(idxs, torch.Tensor):
        arr = idxs.detach().cpu().numpy()
    elif isinstance(idxs, np.ndarray):
        arr = idxs
    elif isinstance(idxs, (list, tuple, range)):
        arr = np.asarray(idxs)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    else:
        raise TypeError(
            "row indices must be a list, ndarray or tensor of ints or bools, "
            f"got {type(idxs).__name__}"
        )
    if arr.ndim != 1:
        raise ValueError(f"row indices must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.dtype == np.bool_:
        if arr.shape[0] != length:
            raise ValueError(
                f"boolean mask has length {arr.shape[0]} but the DataProto has length {length}"
            )
        return np.flatnonzero(arr)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row indices must be integers or bools, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if high >= length or low < -length:
            bad = high if high >= length else low
            raise IndexError(f"index {bad} is out of range for a DataProto of length {length}")
        if low < 0:
            arr = np.where(arr < 0, arr + length, arr)
    return arr


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``np.array_split`` sizes: the first ``length % chunks`` chunks get one extra row."""
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def merge_concat_meta_info(metas: Sequence[Mapping]) -> dict:
    """verl's meta merge for concat: ``metrics`` dicts become lists per name, the rest must agree.

    ``metrics`` may be a dict or a list of dicts in each input (``None`` is skipped); a metric
    whose value is a list is flattened into the result's list. Any other key may appear in
    some inputs only, but where two inputs carry it the values must be equal: a
    ``ValueError`` names the key and both values (verl asserts the same).
    """
    merged: dict = {}
    owner: dict = {}
    metric_dicts: list[Mapping] = []
    for position, meta in enumerate(metas):
        for key, value in meta.items():
            if key == _METRICS_KEY:
                metric_dicts.extend(_metric_dicts(value, position))
            elif key not in merged:
                merged[key], owner[key] = value, position
            elif not values_equal(merged[key], value):
                raise ValueError(
                    f"cannot concat: meta_info key {key!r} is {merged[key]!r} in item "
                    f"#{owner[key]} but {value!r} in item #{position}; make the values agree "
                    "or pop the key before concatenating"
                )
    if metric_dicts:
        merged[_METRICS_KEY] = _metrics_to_lists(metric_dicts)
    return merged


def _metric_dicts(value: Any, position: int) -> list[Mapping]:
    """The metric dicts one input carries under ``meta_info["metrics"]``."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, Mapping) for v in value):
        return list(value)
    raise TypeError(
        f"meta_info['metrics'] of item #{position} is a {type(value).__name__}; concat merges "
        "metrics given as a dict (or a list of dicts) of metric name to value"
    )


def _metrics_to_lists(metric_dicts: Sequence[Mapping]) -> dict[str, list]:
    metrics: dict[str, list] = {}
    for item in metric_dicts:
        for name, value in item.items():
            bucket = metrics.setdefault(name, [])
            if isinstance(value, (list, tuple)):
                bucket.extend(value)
            else:
                bucket.append(value)
    return metrics
