"""Joining large batches into memory the kernel may back with huge pages.

A fresh CPU tensor of hundreds of MiB is first touched one 4 KiB page at a time: for
256 MiB that is 65,536 page faults, each zeroing a page, and it costs more than the copy
that fills it (``torch.cat`` of two 128 MiB halves: about 0.12-0.19 s here, 0.03-0.07 s
when the output is advised for 2 MiB pages). The driver joins every DP_COMPUTE_PROTO
result this way, so the output of a large concat asks for huge pages before its first
touch (``madvise(MADV_HUGEPAGE)``, what numpy does for its own large arrays; torch does
it only when ``THP_MEM_ALLOC_ENABLE=1`` is set before it starts). Where the kernel has
transparent huge pages off, or the platform is not Linux, the advice is not given and
the tensor is an ordinary one either way.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .lazy_tensordict import tensordict

__all__ = ["cat_rows", "empty_advised"]

#: Below this size a concat is left to ``torch.cat`` (numpy's threshold for the same advice).
ADVISE_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def empty_advised(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` whose whole 2 MiB pages are advised as huge."""
    out = torch.empty(tuple(shape), dtype=dtype)
    if _MADVISE is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (out.data_ptr() + out.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:  # advice only: a kernel that refuses it leaves ordinary pages
            _MADVISE(start, end - start, _MADV_HUGEPAGE)
    return out


def cat_rows(parts: Sequence[Any]) -> Any:
    """``torch.cat(parts, dim=0)`` of TensorDicts with one batch dimension; a large one
    (every leaf a CPU tensor) into advised memory, anything else as ``torch.cat`` does it."""
    leaves = _plain_leaves(parts)
    if leaves is None:
        return torch.cat(list(parts), dim=0)
    rows = sum(int(part.batch_size[0]) for part in parts)
    joined: dict[Any, Any] = {}
    for key, tensors in leaves.items():
        out = empty_advised((rows, *tensors[0].shape[1:]), tensors[0].dtype)
        torch.cat(tensors, dim=0, out=out)
        _nest(joined, key, out)
    return tensordict.TensorDict(joined, batch_size=[rows], device=parts[0].device)


def _plain_leaves(parts: Sequence[Any]) -> dict[Any, list[torch.Tensor]] | None:
    """Each leaf's tensors across ``parts``, or ``None`` when the plain join does not fit:
    small in all, more than one batch dimension, entries that differ between parts, a leaf
    that is not a plain CPU tensor (a non-tensor, one that records gradients), or leaves
    whose dtype or trailing shape differ."""
    first = parts[0]
    if len(first.batch_size) != 1 or any(len(p.batch_size) != 1 for p in parts):
        return None
    names = set(first.keys(include_nested=True))
    if any(set(part.keys(include_nested=True)) != names for part in parts[1:]):
        return None  # torch.cat says what differs
    for key in names:
        value = first.get(key)
        if type(value) is torch.Tensor:
            continue
        if type(value) is not tensordict.TensorDict or len(value.batch_size) != 1:
            return None  # a non-tensor, or a nested TensorDict with batch dimensions of its own
    keys = list(first.keys(include_nested=True, leaves_only=True))
    leaves: dict[Any, list[torch.Tensor]] = {}
    total = 0
    for key in keys:
        tensors = [part.get(key) for part in parts]
        head = tensors[0]
        for tensor in tensors:
            if (
                type(tensor) is not torch.Tensor
                or tensor.device.type != "cpu"
                or tensor.requires_grad
                or tensor.dtype != head.dtype
                or tensor.shape[1:] != head.shape[1:]
            ):
                return None
            total += tensor.nbytes
        leaves[key] = tensors
    return leaves if keys and total >= ADVISE_MIN_BYTES else None


def _nest(tree: dict, key: Any, value: torch.Tensor) -> None:
    """Put ``value`` at ``key`` (a name, or a tuple of names for a nested entry)."""
    path = key if isinstance(key, tuple) else (key,)
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value
