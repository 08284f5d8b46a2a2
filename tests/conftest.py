"""Shared fixtures: the plugin (hybridflow_dask.testing) provides the clusters and backends;
``backend`` parametrizes backend-neutral tests over both implementations."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["local", "dask"])
def backend(request: pytest.FixtureRequest):
    if request.param == "local":
        return request.getfixturevalue("hf_local_backend")
    return request.getfixturevalue("hf_dask_backend")
