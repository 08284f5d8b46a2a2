"""Builders and field-by-field comparisons for DataProto tests (DataProto has no ``__eq__``)."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDictBase

from hybridflow_dask.protocol import DataProto
from hybridflow_dask.protocol.tensordict_ops import values_equal


def assert_tensors_equal(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
    assert torch.equal(a, b), f"{where}: values differ"


def assert_arrays_equal(a: np.ndarray, b: np.ndarray, where: str = "") -> None:
    assert isinstance(b, np.ndarray), f"{where}: {type(b).__name__} is not an ndarray"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    for i, (x, y) in enumerate(zip(a.ravel(), b.ravel())):
        assert values_equal(x, y), f"{where}[{i}]: {x!r} != {y!r}"


def assert_tensordicts_equal(a: TensorDictBase, b: TensorDictBase, where: str = "batch") -> None:
    assert a.batch_size == b.batch_size, f"{where}: batch_size {a.batch_size} != {b.batch_size}"
    keys_a = set(a.keys(include_nested=True, leaves_only=True))
    keys_b = set(b.keys(include_nested=True, leaves_only=True))
    assert keys_a == keys_b, (
        f"{where}: keys {sorted(map(str, keys_a))} != {sorted(map(str, keys_b))}"
    )
    for key in keys_a:
        va, vb = a.get(key), b.get(key)
        if isinstance(va, torch.Tensor):
            assert_tensors_equal(va, vb, f"{where}[{key!r}]")
        else:
            assert values_equal(getattr(va, "data", va), getattr(vb, "data", vb)), key


def assert_dataproto_equal(a: DataProto, b: DataProto, check_meta: bool = True) -> None:
    assert type(a) is type(b)
    assert len(a) == len(b), f"lengths {len(a)} != {len(b)}"
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert_tensordicts_equal(a.batch, b.batch)
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert_arrays_equal(value, b.non_tensor_batch[key], f"non_tensor_batch[{key!r}]")
    if check_meta:
        assert values_equal(a.meta_info, b.meta_info), f"{a.meta_info} != {b.meta_info}"


def make_dataproto(n: int = 6, meta_info: dict | None = None, **kwargs) -> DataProto:
    """A small mixed DataProto: float32, bfloat16, int64, bool tensors, object and float arrays."""
    g = torch.Generator().manual_seed(n)
    tensors = {
        "obs": torch.randn(n, 3, generator=g),
        "logp": torch.randn(n, 2, generator=g).to(torch.bfloat16),
        "ids": torch.arange(n * 4, dtype=torch.int64).reshape(n, 4),
        "mask": torch.arange(n) % 2 == 0,
    }
    non_tensors = {
        "uid": np.array([f"uid-{i}" for i in range(n)], dtype=object),
        "score": np.arange(n, dtype=np.float64) / 2,
    }
    return DataProto.from_dict(tensors, non_tensors, meta_info or {"temperature": 1.0}, **kwargs)
