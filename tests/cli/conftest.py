"""Helpers for running the ``hybridflow-dask`` command and small programs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

#: A child that runs longer than this is killed and the test fails: it hung.
HANG_S = 90


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_python(code: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> Ran:
    """``python -c code args`` in ``cwd``; killed (and reported) after ``HANG_S``."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    return Ran(done.returncode, done.stdout, done.stderr, time.perf_counter() - started)


CLI = "from hybridflow_dask.cli import main; raise SystemExit(main())"


@pytest.fixture
def cli(tmp_path: Path):
    """Run ``hybridflow-dask ARGS`` (the console script's code) in a fresh process."""

    def run(*args: str, env: dict[str, str] | None = None) -> Ran:
        return run_python(CLI, *args, cwd=tmp_path, env=env)

    return run


@pytest.fixture
def program(tmp_path: Path):
    """Run a small Python program in a fresh process."""

    def run(code: str, env: dict[str, str] | None = None) -> Ran:
        return run_python(code, cwd=tmp_path, env=env)

    return run
