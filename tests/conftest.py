"""Shared fixtures. The plugin (hybridflow_dask.testing) provides the clusters and backends;
``backend`` parametrizes backend-neutral tests over both implementations."""

from __future__ import annotations

import dask
import pytest

from hybridflow_dask.protocol import AUTO_PADDING_ENV, DataProtoConfig


@pytest.fixture(params=["local", "dask"])
def backend(request: pytest.FixtureRequest):
    if request.param == "local":
        return request.getfixturevalue("hf_local_backend")
    return request.getfixturevalue("hf_dask_backend")


@pytest.fixture(scope="session", autouse=True)
def _reuse_worker_processes():
    """Backends made by tests reuse worker processes between groups, so the suite does not
    wait for restarts; the tests about fresh processes turn it back on for themselves."""
    with dask.config.set({"hybridflow.fresh-processes": False}):
        yield


@pytest.fixture(autouse=True)
def _padding_off(monkeypatch: pytest.MonkeyPatch):
    """Every test starts with auto padding off, whatever the environment says."""
    monkeypatch.delenv(AUTO_PADDING_ENV, raising=False)
    previous = DataProtoConfig._auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = previous
