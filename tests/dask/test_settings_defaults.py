"""The package's Dask settings are there in every process that hosts instances."""

from __future__ import annotations

import copy

import dask
import pytest

from hybridflow_dask.backends.dask.config import ensure_defaults


@pytest.fixture
def config_without_the_package():
    """This process's Dask config as a worker forked from a preloaded server has it once
    its nanny's config (made before the driver imported the package) replaced its own."""
    saved = copy.deepcopy(dask.config.config)
    dask.config.config.pop("hybridflow", None)
    try:
        yield
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)


def test_a_config_that_lost_the_package_defaults_gets_them_back(config_without_the_package):
    with pytest.raises(KeyError):
        dask.config.get("hybridflow.freeze-gc")
    dask.config.config["hybridflow"] = {"call-timeout": "7s"}  # one the user set
    ensure_defaults()
    assert dask.config.get("hybridflow.freeze-gc") is True
    assert dask.config.get("hybridflow.call-timeout") == "7s"  # what was set stays
