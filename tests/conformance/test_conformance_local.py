"""The conformance kit against ``LocalBackend`` (its process tests skip: ``in_process``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridflow_dask.backends import LocalBackend
from hybridflow_dask.testing.conformance import *  # noqa: F403  (the kit's tests and fixtures)


@pytest.fixture(scope="module")
def hf_backend_factory() -> Callable[..., LocalBackend]:
    return lambda attach_to=None: LocalBackend()
