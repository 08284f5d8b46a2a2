"""Batches and comparisons shared by the backend-neutral tests.

Where worker classes live: every test module here defines its worker classes at module
level. ``DaskBackend`` pickles them by reference, and the Dask worker processes can import
the test module because ``LocalCluster`` spawns them with the driver's ``sys.path``, which
pytest's default ``prepend`` import mode has already extended with ``tests/core`` when it
collected the module (the session cluster starts later, on the first test that needs it).
Nothing else is needed: no ``tests/__init__.py``, no separate workers module. This relies
on ``prepend`` mode (``--import-mode=importlib`` would break it, and the ``core_helpers``
import too). Test file names carry a ``core`` prefix because ``prepend`` mode needs
basenames unique across ``tests/``.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow_dask import DataProto


def make_batch(n: int, *, auto_padding: bool = False) -> DataProto:
    """``n`` rows: ``obs`` (float, 2 columns), ``idx`` (row number) and ``uid`` (object)."""
    return DataProto.from_dict(
        {
            "obs": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2),
            "idx": torch.arange(n),
        },
        {"uid": np.array([f"row-{i}" for i in range(n)], dtype=object)},
        meta_info={"step": 1},
        auto_padding=auto_padding,
    )


def assert_same_data(a: DataProto, b: DataProto) -> None:
    """Field-by-field equality (DataProto deliberately has no ``__eq__``)."""
    assert len(a) == len(b), f"lengths {len(a)} != {len(b)}"
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        keys = set(a.batch.keys())  # iterating a TensorDict yields rows, not keys
        assert keys == set(b.batch.keys())
        for key in sorted(keys):
            assert a.batch[key].dtype == b.batch[key].dtype, key
            assert torch.equal(a.batch[key], b.batch[key]), f"batch[{key!r}] differs"
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert value.tolist() == b.non_tensor_batch[key].tolist(), f"non_tensor_batch[{key!r}]"
    assert a.meta_info == b.meta_info


def rows(data: DataProto, key: str = "idx") -> list:
    """One column as a plain list, for readable assertions."""
    if key in data.non_tensor_batch:
        return data.non_tensor_batch[key].tolist()
    return data.batch[key].tolist()
