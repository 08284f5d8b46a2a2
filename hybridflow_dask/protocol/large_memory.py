"""Memory for large batches: advised for huge pages, and reused once nothing refers to it.

A fresh buffer of hundreds of MiB pays on its first touch. One cost is a page fault per
4 KiB page, each zeroing its page: a 256 MiB ``torch.cat`` into fresh memory took
0.12-0.19 s here, 0.03-0.07 s when the output was advised for 2 MiB pages first
(``madvise(MADV_HUGEPAGE)``; numpy does this for its own large arrays, torch only with
``THP_MEM_ALLOC_ENABLE=1`` set before it starts). The other is the host's, on a virtual
machine that takes freed guest memory back: each first touch then also waits for the host
to hand a page in again, and a 32 MiB reply copied into fresh memory took ~85-90 ms of CPU
here against ~6 ms into memory the process had used before; DP_COMPUTE_PROTO round trips
of 64 MiB swung between ~30 and ~150 ms with it.

So every large buffer the package fills (the driver's join of the ranks' results, the
replies and arguments a socket lane reads) is a view of a block from one cache per
process. A block is taken again once nothing refers to it: every tensor, array or
memoryview made from it holds a reference to it, so its reference count says when the
last user let go. Idle blocks beyond the cache's limit (``set_cache_limit``; 1 GiB unless
the backend's settings say otherwise) are freed. Tensors made here have storage that
cannot grow (``resize_`` beyond their size raises).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from .lazy_tensordict import tensordict

__all__ = ["BlockCache", "cat_rows", "empty", "set_cache_limit", "take"]

#: Buffers from this size on come from the cache, advised for huge pages; joins smaller
#: than this are left to ``torch.cat`` (numpy's threshold for the same advice).
LARGE_BYTES = 4 << 20
#: Idle bytes a process keeps by default.
CACHE_LIMIT_BYTES = 1 << 30
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
# A block's reference count when only the cache's list and ``getrefcount``'s argument
# refer to it.
_UNUSED = 2


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


def _advise(address: int, nbytes: int) -> None:
    """Advise the whole 2 MiB pages of a range as huge (advice only: a kernel without
    transparent huge pages leaves ordinary ones)."""
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if _MADVISE is not None and end > start:
        _MADVISE(start, end - start, _MADV_HUGEPAGE)


class BlockCache:
    """Large blocks, lent as views and taken again once nothing refers to them."""

    def __init__(self, limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._blocks: list[numpy.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> numpy.ndarray:
        """A writable ``nbytes``-byte array no one else uses, its pages advised as huge."""
        with self._lock:
            blocks = self._blocks
            idle = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) == _UNUSED]
            fits = [i for i in idle if nbytes <= blocks[i].nbytes <= 2 * nbytes]
            if fits:
                block = blocks[min(fits, key=lambda i: blocks[i].nbytes)]
            else:
                block = numpy.empty(nbytes, numpy.uint8)
                _advise(block.ctypes.data, nbytes)
                if nbytes <= self.limit_bytes:
                    blocks.append(block)
            self._trim([blocks[i] for i in idle if blocks[i] is not block])
            return block[:nbytes]

    def idle_bytes(self) -> int:
        """Bytes in blocks that nothing outside the cache refers to."""
        with self._lock:
            blocks = self._blocks
            idle = [i for i in range(len(blocks)) if sys.getrefcount(blocks[i]) == _UNUSED]
            return sum(blocks[i].nbytes for i in idle)

    def _trim(self, idle: list[numpy.ndarray]) -> None:
        spare, drop = self.limit_bytes, set()
        for block in reversed(idle):  # the most recently made are kept first
            if block.nbytes <= spare:
                spare -= block.nbytes
            else:
                drop.add(id(block))
        if drop:
            self._blocks = [b for b in self._blocks if id(b) not in drop]


_CACHE = BlockCache()


def set_cache_limit(limit_bytes: int) -> None:
    """How many idle bytes this process's block cache keeps (0: none, every large buffer
    is fresh memory, freed with its last user)."""
    _CACHE.limit_bytes = max(0, int(limit_bytes))


def take(nbytes: int) -> numpy.ndarray:
    """A writable byte array: a cached block's view when large, else fresh memory."""
    if nbytes < LARGE_BYTES:
        return numpy.empty(nbytes, numpy.uint8)
    return _CACHE.take(nbytes)


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``; a large one in a cached block (see above)."""
    shape = tuple(shape)
    nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if nbytes < LARGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_CACHE.take(nbytes)).view(dtype).view(shape)


def cat_rows(parts: Sequence[Any]) -> Any:
    """``torch.cat(parts, dim=0)`` of TensorDicts with one batch dimension; a large one
    (every leaf a CPU tensor) into cached blocks, anything else as ``torch.cat`` does it."""
    leaves = _plain_leaves(parts)
    if leaves is None:
        return torch.cat(list(parts), dim=0)
    rows = sum(int(part.batch_size[0]) for part in parts)
    joined: dict[Any, Any] = {}
    for key, tensors in leaves.items():
        out = empty((rows, *tensors[0].shape[1:]), tensors[0].dtype)
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
    return leaves if keys and total >= LARGE_BYTES else None


def _nest(tree: dict, key: Any, value: torch.Tensor) -> None:
    """Put ``value`` at ``key`` (a name, or a tuple of names for a nested entry)."""
    path = key if isinstance(key, tuple) else (key,)
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value
