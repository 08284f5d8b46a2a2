"""``TinyBackend``, the worked example of ``docs/backends.md``: it passes the kit's tests
that need no separate processes, stays under 100 lines, and the guide shows it verbatim."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridflow_dask.testing import tiny_backend
from hybridflow_dask.testing.conformance import *  # noqa: F403  (the kit's tests and fixtures)
from hybridflow_dask.testing.tiny_backend import TinyBackend

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


@pytest.fixture(scope="module")
def hf_backend_factory() -> Callable[..., TinyBackend]:
    return lambda attach_to=None: TinyBackend()


def test_tiny_backend_is_under_100_lines() -> None:
    lines = inspect.getsource(tiny_backend).splitlines()
    assert len(lines) < 100, f"tiny_backend.py has {len(lines)} lines"


def test_the_guide_shows_tiny_backend_verbatim() -> None:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    source = inspect.getsource(tiny_backend)
    assert source in blocks, "docs/backends.md no longer shows tiny_backend.py as it is"
