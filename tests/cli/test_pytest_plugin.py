"""The pytest plugin's errors point at the setting to change."""

from __future__ import annotations

import pytest

import hybridflow_dask as hf


class Idle(hf.Worker):
    pass


def test_a_pool_larger_than_the_fixture_cluster_names_the_ini_option(hf_dask_backend, pytestconfig):
    workers = int(pytestconfig.getini("hf_dask_workers"))
    with pytest.raises(
        ValueError, match=rf"fixture has {workers} worker processes.*hf_dask_workers"
    ):
        hf.WorkerGroup(
            hf.ResourcePool([workers + 1]), hf.ClassWithInitArgs(Idle), backend=hf_dask_backend
        )
