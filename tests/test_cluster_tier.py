"""The fast tier holds what it claims: ``-m "not cluster"`` runs no test that starts a
process, because tests/conftest.py fails any such test that lacks the marker.

Each case runs pytest in a fresh process on a small project with this suite's conftest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

TESTS = """
import subprocess
import sys

import pytest


def start_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_and_starts_a_process():
    start_a_process()


@pytest.mark.cluster
def test_marked_and_starts_a_process():
    start_a_process()


def test_starts_nothing():
    assert sum([1, 2]) == 3


def test_uses_a_process_fixture(program):
    pass
"""

PROGRAM_FIXTURE = """
import pytest


@pytest.fixture
def program():
    return None
"""

pytestmark = pytest.mark.cluster  # each case is a pytest process


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text() + PROGRAM_FIXTURE)
    (tmp_path / "test_probe.py").write_text(TESTS)
    return tmp_path


def test_the_fast_tier_fails_an_unmarked_test_that_starts_a_process(project: Path):
    ran = _pytest(project, "-m", "not cluster")
    out = ran.stdout
    assert ran.returncode == 1, out[-3000:]
    assert "ERROR test_probe.py::test_unmarked_and_starts_a_process" in out
    assert "started a process (subprocess [" in out and "pytest.mark.cluster" in out
    assert "PASSED test_probe.py::test_starts_nothing" in out
    # the marked test and the one using a process fixture are not in the fast tier
    assert "2 deselected" in out
    assert "test_marked_and_starts_a_process" not in out
    assert "test_uses_a_process_fixture" not in out


def test_a_run_with_cluster_tests_does_not_blame_tests_for_background_processes(project: Path):
    ran = _pytest(project)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "4 passed" in ran.stdout
