"""verl parity: one consistent GPU rank environment; split-pool local ranks.

No GPU exists on the test machine, so GPU slots are injected: ``MockGpuBackend`` is a
``LocalBackend`` whose placement hands out slots that own ``cuda:N`` devices, two nodes
with four GPUs each, numbered out of order so that only the right mapping passes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from hybridflow_dask import Dispatch, ResourcePool, Worker, register, split_resource_pool
from hybridflow_dask.backends import LocalBackend
from hybridflow_dask.backends.base import Slot

ENV_KEYS = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
NODE_GPUS = [6, 4, 2, 0]  # the physical GPU behind local slot i of every node


class MockGpuBackend(LocalBackend):
    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        placed, index = [], 0
        for node, count in enumerate(process_on_nodes):
            for local in range(count):
                device = f"cuda:{NODE_GPUS[local]}"
                host = f"10.0.0.{node + 1}"
                placed.append(Slot(index, "local", host, node=node, device=device, name=name))
                index += 1
        return placed


@pytest.fixture
def mock_gpu_backend():
    backend = MockGpuBackend()
    yield backend
    backend.shutdown()


class EnvProbe(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.env_in_init = {key: os.environ.get(key) for key in ENV_KEYS}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        return self.env_in_init


def own_gpu(wg, rank: int) -> str:
    return wg.workers[rank].slot.device.split(":")[1]


def test_local_rank_indexes_the_ranks_own_gpu_in_cuda_visible_devices(
    mock_gpu_backend, hf_worker_group
):
    wg = hf_worker_group(EnvProbe, [4], backend=mock_gpu_backend)
    for rank, env in enumerate(wg.env()):
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        local_rank = int(env["LOCAL_RANK"])
        # torch.cuda.set_device(LOCAL_RANK) must land on this rank's own GPU.
        assert local_rank < len(visible), env
        assert visible[local_rank] == own_gpu(wg, rank)
        assert visible == ["6", "4", "2", "0"]  # the node's GPUs, in local-rank order
        assert env["LOCAL_WORLD_SIZE"] == "4"


def test_ranks_on_two_nodes_see_their_own_nodes_gpus(mock_gpu_backend, hf_worker_group):
    wg = hf_worker_group(EnvProbe, [2, 2], backend=mock_gpu_backend)
    envs = wg.env()
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["6,4"] * 4
    for rank, env in enumerate(envs):
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == own_gpu(wg, rank)


def test_split_pool_keeps_node_local_ranks(hf_local_backend, hf_worker_group):
    _, middle, _ = split_resource_pool(ResourcePool([4, 4]), [2, 4, 2])
    assert middle.local_rank_list() == [2, 3, 0, 1]
    assert middle.local_world_size_list() == [4, 4, 4, 4]
    assert middle.node_list() == [0, 0, 1, 1]
    assert middle.store == [2, 2]
    wg = hf_worker_group(EnvProbe, middle, backend=hf_local_backend)
    envs = wg.env()
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["2", "3", "0", "1"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["4"] * 4


def test_split_pool_ranks_find_their_own_gpu(mock_gpu_backend, hf_worker_group):
    _, middle, _ = split_resource_pool(ResourcePool([4, 4]), [2, 4, 2])
    wg = hf_worker_group(EnvProbe, middle, backend=mock_gpu_backend)
    for rank, env in enumerate(wg.env()):
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible == ["6", "4", "2", "0"]
        assert visible[int(env["LOCAL_RANK"])] == own_gpu(wg, rank)
