"""GPU memory given back after shutdown, and the GRPO demo trained on the GPU.

Marked ``gpu``. Memory is read from outside every process, through NVML (what
``nvidia-smi`` shows), so the driver's own CUDA use never enters the figures.
"""

from __future__ import annotations

import pytest
from gpu_helpers import GiB, MemoryHog, nvml_used_bytes, wait_until

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.examples.grpo import GRPOConfig, run_demo

pytestmark = [pytest.mark.gpu, pytest.mark.cluster]  # a GPU cluster (tests/conftest.py)

HOLD = 4 * GiB
#: What a worker's CUDA context and torch's kernels may take beyond the tensors (~0.5 GiB
#: on a Hopper GPU), with room to spare.
CONTEXT_SLACK = 1 * GiB


def test_gpu_memory_is_given_back_when_a_group_and_its_backend_shut_down():
    before = nvml_used_bytes()
    backend = DaskBackend()
    try:
        group = hf.WorkerGroup(
            hf.ResourcePool([1], use_gpu=True),
            hf.ClassWithInitArgs(MemoryHog, HOLD),
            backend=backend,
        )
        assert group.held() == [HOLD]
        held = nvml_used_bytes()
        assert held >= before + HOLD - 256 * 2**20, (before, held)
        group.shutdown()
        # the instance's tensor goes back to the device, not to torch's cache in the worker
        assert wait_until(lambda: nvml_used_bytes() <= held - HOLD + 64 * 2**20, 10), (
            before,
            held,
            nvml_used_bytes(),
        )
        assert nvml_used_bytes() <= before + CONTEXT_SLACK  # only the worker's context is left
    finally:
        backend.shutdown()
    # the worker process is gone, and its context with it
    assert wait_until(lambda: nvml_used_bytes() <= before + 64 * 2**20, 20), (
        before,
        nvml_used_bytes(),
    )


def test_the_grpo_demo_learns_on_the_gpu():
    import torch

    world = torch.cuda.device_count()
    config = GRPOConfig(device="cuda")
    with DaskBackend() as backend:
        result = run_demo(60, world_size=world, backend=backend, config=config)
    rewards = [step["reward_mean"] for step in result["steps"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert result["config"]["device"] == "cuda"
    assert last >= 0.6 and last >= first + 0.4, rewards
    assert len(set(result["param_checksums"])) == 1  # every rank ended with the same weights
