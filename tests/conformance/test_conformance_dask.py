"""The conformance kit against ``DaskBackend``, on the session's ``hf_dask_cluster``.

The kit's backend is one more ``DaskBackend`` attached to the session cluster (so is the
second driver, and the one the shutdown test closes): no cluster is started here. The
kit's last tests kill one worker process of that cluster; its nanny restarts it, and the
module waits for that before the next module's tests need every worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from distributed import Client

from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.testing.conformance import *  # noqa: F403  (the kit's tests and fixtures)


@pytest.fixture(scope="module")
def hf_backend_factory(hf_dask_cluster: Any) -> Callable[..., DaskBackend]:
    def make(attach_to: DaskBackend | None = None) -> DaskBackend:
        return DaskBackend(cluster=hf_dask_cluster)  # a second driver: one more client

    return make


@pytest.fixture(scope="module", autouse=True)
def _cluster_whole_again(hf_dask_cluster: Any, pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    workers = int(pytestconfig.getini("hf_dask_workers"))
    with Client(hf_dask_cluster, set_as_default=False) as client:
        client.wait_for_workers(workers, timeout=120)
