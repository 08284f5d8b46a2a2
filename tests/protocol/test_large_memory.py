"""Large buffers: advised for huge pages, reused only once nothing refers to them; large
concats land there and join exactly as torch.cat does."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from hybridflow_dask import DataProto
from hybridflow_dask.protocol import large_memory
from hybridflow_dask.protocol.large_memory import LARGE_BYTES, BlockCache, cat_rows, empty, take

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists(THP), reason="the kernel has no transparent huge pages")
def test_a_large_empty_tensor_is_advised_for_huge_pages_before_its_first_touch():
    out = empty((64 << 20,), torch.uint8)
    inside = -(-out.data_ptr() // (2 << 20)) * (2 << 20)  # its first whole 2 MiB page
    assert "hg" in _vm_flags(inside)  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took
    plain = torch.empty(64 << 20, dtype=torch.uint8)
    assert "hg" not in _vm_flags(-(-plain.data_ptr() // (2 << 20)) * (2 << 20))


def test_a_large_concat_of_data_protos_equals_torch_cat_with_nested_keys_and_dtypes():
    rows = (700, 333)
    parts = [
        TensorDict(
            {
                "x": torch.randn(n, 2048),
                "ids": torch.arange(n, dtype=torch.int64),
                "mask": torch.rand(n, 64) > 0.5,
                "half": torch.randn(n, 16).to(torch.bfloat16),
                "nested": {"logp": torch.randn(n, 512, dtype=torch.float64)},
            },
            batch_size=[n],
        )
        for n in rows
    ]
    assert sum(p.bytes() for p in parts) >= LARGE_BYTES
    joined = cat_rows(parts)
    expected = torch.cat(parts, dim=0)
    assert joined.batch_size == torch.Size([sum(rows)])
    assert joined["nested"].batch_size == torch.Size([sum(rows)])
    assert set(joined.keys(True, True)) == set(expected.keys(True, True))
    for key in expected.keys(True, True):
        assert joined[key].dtype == expected[key].dtype
        assert torch.equal(joined[key], expected[key]), key
    data = DataProto.concat([DataProto(batch=p) for p in parts])
    assert torch.equal(data.batch["nested", "logp"], expected["nested", "logp"])


def test_small_or_unusual_batches_are_joined_by_torch_cat(monkeypatch):
    """A small join, a non-tensor leaf, a tensor recording gradients, two batch dims or
    mismatched trailing shapes never take the advised path (it would drop or refuse them)."""
    advised: list[tuple] = []
    monkeypatch.setattr(
        large_memory,
        "empty",
        lambda shape, dtype: advised.append(shape) or torch.empty(shape, dtype=dtype),
    )
    big = 1 << 20  # rows of 4 float32s: 4 MiB per part
    cases = {
        "small": [TensorDict({"x": torch.ones(4, 2)}, batch_size=[4])] * 2,
        "non-tensor": [
            TensorDict(
                {"x": torch.ones(big, 4), "tag": NonTensorData("a", batch_size=[big])}, [big]
            )
        ]
        * 2,
        "grad": [TensorDict({"x": torch.ones(big, 4, requires_grad=True)}, batch_size=[big])] * 2,
        "two dims": [TensorDict({"x": torch.ones(big, 2, 2)}, batch_size=[big, 2])] * 2,
    }
    tagged = TensorDict({"x": torch.ones(big, 4)}, [big])
    tagged.set("tag", NonTensorData("a", batch_size=[big]))
    with pytest.raises(Exception):  # noqa: B017 (torch.cat's own error, whatever its type)
        cat_rows([TensorDict({"x": torch.ones(big, 4)}, [big]), tagged])
    assert advised == []  # an entry only the second part has is not dropped silently
    for name, parts in cases.items():
        joined = cat_rows(parts)
        assert joined.batch_size[0] == 2 * parts[0].batch_size[0], name
    assert advised == []
    cat_rows([TensorDict({"x": torch.ones(big, 4)}, batch_size=[big])] * 2)
    assert advised == [(2 * big, 4)]  # the same helper does take the plain large case


MiB = 1 << 20


def test_a_block_is_lent_again_only_once_nothing_refers_to_it():
    cache = BlockCache(limit_bytes=64 * MiB)
    first = cache.take(8 * MiB)
    address = first.ctypes.data
    tensor = torch.from_numpy(first).view(torch.float32)[10:20]  # a view of a view
    view = memoryview(first)[100:200]
    del first
    second = cache.take(8 * MiB)
    assert second.ctypes.data != address  # the tensor and the memoryview still use it
    del tensor
    assert cache.take(8 * MiB).ctypes.data != address  # the memoryview still does
    del view
    assert cache.take(8 * MiB).ctypes.data == address
    del second


def test_a_block_fits_a_request_from_its_size_to_half_its_size():
    cache = BlockCache(limit_bytes=64 * MiB)
    address = cache.take(8 * MiB).ctypes.data  # dropped at once: idle
    assert cache.take(4 * MiB + 1).ctypes.data == address  # up to twice the size is used
    smaller = cache.take(4 * MiB)  # (the 8 MiB block is idle again)
    assert smaller.ctypes.data == address
    assert cache.take(3 * MiB).ctypes.data != address  # more than twice: not this block
    assert cache.take(9 * MiB).ctypes.data != address  # too small


def test_idle_blocks_beyond_the_limit_are_freed():
    cache = BlockCache(limit_bytes=16 * MiB)
    held = [cache.take(8 * MiB) for _ in range(4)]  # 32 MiB in use
    del held
    assert cache.idle_bytes() == 32 * MiB
    kept = cache.take(8 * MiB)  # one taken again; of the other three, 16 MiB stay
    assert cache.idle_bytes() == 16 * MiB
    del kept
    nothing = BlockCache(limit_bytes=0)
    nothing.take(8 * MiB)
    assert nothing.idle_bytes() == 0


def test_small_buffers_and_tensors_are_fresh_memory():
    assert take(LARGE_BYTES - 1).nbytes == LARGE_BYTES - 1
    small = empty((16, 16), torch.float64)
    assert small.shape == (16, 16) and small.dtype == torch.float64
    large = empty((LARGE_BYTES // 2, 2), torch.bfloat16)
    assert large.shape == (LARGE_BYTES // 2, 2) and large.dtype == torch.bfloat16
    large.fill_(1.5)
    assert float(large.float().sum()) == 1.5 * large.numel()
