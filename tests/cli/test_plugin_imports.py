"""Installing the package costs other projects' pytest runs nothing: the ``pytest11``
plugin loads into every run, so it imports no torch, Dask or distributed until a test
uses one of its fixtures.

Each run is ``python -X importtime -m pytest -s -p no:cacheprovider`` with this
environment's python (where the package is installed) in a temporary project of its own,
no ``PYTHONPATH``; the modules imported are read from the ``import time:`` lines on
stderr (``-s``: pytest's capture would swallow the lines written while it collects and
runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here starts a pytest process (see tests/conftest.py).
pytestmark = pytest.mark.cluster

HEAVY = {"torch", "dask", "distributed"}
TIMEOUT_S = 120


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pytest", "-s", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _imported(stderr: str) -> set[str]:
    """Top-level packages named on ``-X importtime`` lines (``self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_collecting_an_empty_project_imports_no_torch_dask_or_distributed(tmp_path: Path):
    ran = _pytest(tmp_path, "--co")
    assert ran.returncode == 5, ran.stdout[-2000:] + ran.stderr[-2000:]  # 5: nothing collected
    assert "hybridflow-dask" in ran.stdout  # the "plugins:" line: the plugin was loaded
    imported = _imported(ran.stderr)
    assert "_pytest" in imported  # the import-time lines were read
    assert not imported & HEAVY, f"loading the plugin imported {sorted(imported & HEAVY)}"


def test_collecting_tests_that_do_not_use_the_fixtures_imports_nothing_heavy(tmp_path: Path):
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n")
    ran = _pytest(tmp_path, "--co")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "<Function test_plain>" in ran.stdout
    imported = _imported(ran.stderr)
    assert not imported & HEAVY, f"collecting imported {sorted(imported & HEAVY)}"


def test_a_test_that_uses_a_fixture_imports_what_the_fixture_needs(tmp_path: Path):
    """The counter-check: the import-time lines do show torch once a fixture loads it."""
    (tmp_path / "test_uses_fixture.py").write_text(
        "def test_group_factory(hf_worker_group):\n    assert callable(hf_worker_group)\n"
    )
    ran = _pytest(tmp_path, "-q")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "torch" in _imported(ran.stderr)
