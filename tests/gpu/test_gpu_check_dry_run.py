"""``scripts/gpu_check.sh --dry-run`` passes on this machine (no GPU needed).

Not marked ``gpu``. The dry run checks the carried wheels in ``.whl/`` (the folder git
ignores and the device tool carries), downloading them with ``scripts/gpu_wheels.sh``
first when they are missing: about 10 MiB from PyPI once, then nothing (the files stay in
``.whl/`` and pip's cache keeps them too). It installs them into a throwaway folder for
Python 3.12 on manylinux x86-64, runs ``pytest -m gpu`` and checks that every GPU test is
skipped with its reason, and that the benchmark and the demo plan without a GPU and
refuse to run. About 15-20 s here, most of it pytest's collection in the child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = (
    "wheels: the set, one version each, within the carry limit: ok",
    "install: into a throwaway folder for cp312 manylinux: ok",
    "install: every module is in place",
    "install: the fallback cuda-core: ok",
    "pytest -m gpu: every GPU test skipped with its reason: ok",
    "bench_gpu --dry-run: the plan: ok",
    "bench_gpu: refuses without a GPU: ok",
    "gpu_demo --dry-run: the plan: ok",
    "gpu_demo: refuses without a GPU: ok",
    "gpu_check --dry-run: PASSED",
)


@pytest.mark.timeout(240)
def test_gpu_check_dry_run_passes_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    log = (out / "dry_run.log").read_text() if (out / "dry_run.log").exists() else ""
    if done.returncode == 75:
        pytest.skip(f"the GPU wheels could not be downloaded (no network?):\n{log[-2000:]}")
    assert done.returncode == 0, done.stdout + done.stderr + log[-4000:]
    summary = (out / "summary.txt").read_text()
    for step in STEPS:
        assert step in summary, summary
    assert "FAILED" not in summary and "MISSING" not in summary


def test_gpu_check_refuses_unknown_arguments():
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--now"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "usage:" in done.stderr
