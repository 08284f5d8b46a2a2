"""tensordict (and the torch._dynamo it imports, ~2 s) loads only when a TensorDict is used.

Every Dask worker imports the package's worker host as it starts; that must not pay for
tensordict. A fresh interpreter is the only honest place to check what an import loads.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# Every test here starts a process (see tests/conftest.py).
pytestmark = pytest.mark.cluster

SCRIPT = """
import sys
import hybridflow_dask as hf
import hybridflow_dask.backends.dask.worker.plugin
from hybridflow_dask.protocol.rows import is_batch
assert not is_batch([1, 2])
print("before", "tensordict" in sys.modules)
import torch
data = hf.DataProto.from_dict({"x": torch.ones(2, 3)})
print("after", "tensordict" in sys.modules, type(data.batch).__name__, is_batch(data.batch))
"""


def test_the_worker_host_imports_without_tensordict_until_a_tensordict_is_made():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert "before False" in out
    assert "after True TensorDict True" in out
