"""How a worker counts its GPUs without starting CUDA, and memory release on CPU processes.

Not marked ``gpu``: NVML's answer is an argument here (an injected probe), so every case
runs on any machine. tests/gpu/test_gpu_cluster.py checks the real count on a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow_dask.backends.dask.worker.probe import count_visible_gpus
from hybridflow_dask.backends.hosting import release_device_memory


@pytest.mark.parametrize(
    ("visible", "nvml", "expected"),
    [
        (None, None, None),  # NVML unknown: the caller asks torch instead
        ("0", None, None),
        (None, 0, 0),
        ("0,1", 0, 0),  # a stale variable on a machine without GPUs
        (None, 4, 4),  # unset: every GPU
        ("2", 4, 1),  # dask-cuda's worker 2 on a 4-GPU host: its own GPU first
        ("2,3,0,1", 4, 4),
        ("", 4, 0),  # set but empty: none
        ("-1", 4, 0),
        ("1,7,2", 4, 1),  # CUDA stops at the first index out of range
        ("1,1", 4, 1),  # and at a repeated one
        ("GPU-8f6e3c1a-0000-0000-0000-000000000000", 1, 1),  # a UUID names a GPU
        (" 0 , 1 ", 2, 2),
    ],
)
def test_count_visible_gpus_reads_cuda_visible_devices_as_cuda_does(visible, nvml, expected):
    assert count_visible_gpus(visible, nvml) == expected


@pytest.mark.cluster
def test_release_device_memory_does_nothing_in_a_process_that_never_started_cuda():
    code = (
        "import torch, sys\n"
        "from hybridflow_dask.backends.hosting import release_device_memory\n"
        "release_device_memory()\n"
        "print(torch.cuda.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # it never starts CUDA itself
    release_device_memory()  # nor fails in this process
