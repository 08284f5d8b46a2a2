"""One local Ray instance for the session, started by the ``RayBackend`` that owns it.

Every other ``RayBackend`` a test makes attaches to it (Ray is initialized in this
process), so the modules here share one Ray start (a few seconds on 2 cores). Each
module skips itself, saying why, where ``ray`` is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

#: Logical slots of the session's Ray instance: the most any test here holds at once.
SESSION_SLOTS = 12


@pytest.fixture(scope="session")
def ray_backend() -> Iterator[Any]:
    """The session's owning ``RayBackend`` (its ``shutdown`` stops Ray at the end)."""
    from hybridflow_dask.backends.ray import RayBackend

    backend = RayBackend(max_slots=SESSION_SLOTS, reuse_processes=True, log_to_driver=False)
    yield backend
    backend.shutdown()
