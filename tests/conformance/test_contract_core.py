"""The core's side of the Backend contract: it reads ``WG_BACKEND`` from the backend's
``name`` (never its class name), refuses a backend without one before placing anything,
and refuses a ``Slot.device`` that is neither ``"cpu"`` nor ``"cuda:<id>"``.

The backends here are ``LocalBackend`` subclasses that change one thing (test doubles, as
in ``tests/compat/test_compat_core_rank_env.py``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends import LocalBackend, Slot
from hybridflow_dask.rank_env import gpu_id


class EnvProbe(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def wg_backend(self) -> str | None:
        return os.environ.get("WG_BACKEND")


class RayLookingBackend(LocalBackend):
    """A class name that would have read as "raylooking"; its name says "local"."""


class NamelessBackend(LocalBackend):
    name = ""

    def __init__(self) -> None:
        super().__init__()
        self.placed = 0

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str):
        self.placed += 1
        return super().place(process_on_nodes, use_gpu, name)


class BareCudaBackend(LocalBackend):
    """Hands out slots whose device names no GPU id: ``"cuda"``."""

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str):
        return [Slot(i, "local", "127.0.0.1", device="cuda") for i in range(sum(process_on_nodes))]


@pytest.fixture
def shut_down_after():
    made = []
    yield made.append
    for backend in made:
        backend.shutdown()


def test_wg_backend_is_the_backends_name_not_its_class_name(shut_down_after, hf_worker_group):
    backend = RayLookingBackend()
    shut_down_after(backend)
    group = hf_worker_group(EnvProbe, [2], backend=backend)
    assert group.wg_backend() == ["local", "local"]


def test_a_backend_without_a_name_is_refused_before_anything_is_placed(shut_down_after):
    backend = NamelessBackend()
    shut_down_after(backend)
    with pytest.raises(TypeError, match=r"NamelessBackend has no backend name.*`name`"):
        hf.WorkerGroup(hf.ResourcePool([1]), EnvProbe, backend=backend)
    assert backend.placed == 0


def test_a_slot_device_without_a_gpu_id_is_refused_naming_the_format(shut_down_after):
    backend = BareCudaBackend()
    shut_down_after(backend)
    with pytest.raises(ValueError, match=r"device 'cuda'.*'cpu' or 'cuda:<id>'"):
        hf.WorkerGroup(hf.ResourcePool([1]), EnvProbe, backend=backend)


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", None), ("cuda:3", "3"), ("cuda:GPU-1a2b", "GPU-1a2b")],
)
def test_gpu_id_reads_cpu_and_cuda_ids(device: str, expected: str | None) -> None:
    assert gpu_id(Slot(0, "a", "h", device=device)) == expected


@pytest.mark.parametrize("device", ["cuda", "cuda:", "gpu0", "CPU"])
def test_gpu_id_refuses_other_devices(device: str) -> None:
    with pytest.raises(ValueError, match="must be 'cpu' or 'cuda:<id>'"):
        gpu_id(Slot(0, "a", "h", device=device))
