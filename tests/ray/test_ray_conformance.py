"""The conformance kit against ``RayBackend``, on the session's Ray instance.

The kit runs on the session's backend (``hf_backend`` overridden: the kit does not shut
it down); its second driver and the backend its shutdown test closes are each one more
``RayBackend`` attached to the same Ray (another driver id, its own slot actors and call
numbering, the same registry), so no Ray is started here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'hybridflow-dask[ray]')")

from hybridflow_dask.testing.conformance import *  # noqa: F403  (the kit's tests and fixtures)


@pytest.fixture(scope="module")
def hf_backend(ray_backend: Any) -> Any:
    return ray_backend


@pytest.fixture(scope="module")
def hf_backend_factory(ray_backend: Any) -> Callable[..., Any]:
    from hybridflow_dask.backends.ray import RayBackend

    def make(attach_to: Any = None) -> RayBackend:
        return RayBackend()  # Ray is initialized here: a new driver on the same cluster

    return make
