"""One local Ray instance for the session, started by the ``RayBackend`` that owns it.

The modules here share that backend (``reuse_processes=True``: a released slot's host
is kept for the next pool, as the Dask tests reuse their workers, since each new host is
a process importing torch, seconds on 2 cores). A ``RayBackend`` a test makes itself
attaches to the same Ray (it is initialized in this process). Each module skips itself,
saying why, where ``ray`` is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

#: Logical slots of the session's Ray instance: what the tests here hold at once, kept
#: hosts included.
SESSION_SLOTS = 16


@pytest.fixture(scope="session")
def ray_backend() -> Iterator[Any]:
    """The session's ``RayBackend``; it started Ray, and its ``shutdown`` stops it."""
    from hybridflow_dask.backends.ray import RayBackend

    backend = RayBackend(max_slots=SESSION_SLOTS, reuse_processes=True, log_to_driver=False)
    yield backend
    backend.shutdown()
