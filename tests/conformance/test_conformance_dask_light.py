"""The conformance kit against ``DaskBackend`` with light ranks, at world size 64.

``ranks_per_worker=22`` puts the kit's 64-rank pools on 3 of the session cluster's 4
workers (22 + 22 + 20 ranks), which leaves the 4th for the 1-rank pool some tests hold
beside them; no cluster is started here. Every rank is its own instance with its own
environment, so the kit's guarantees hold as they are; the kill takes the whole process of
the last rank (ranks 44-63), and ``recover()`` rebuilds those 20 together. Like
``test_conformance_dask``, the module waits for the killed worker's restart at its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from distributed import Client

from hybridflow_dask.backends import DaskBackend

WORLD_SIZE = 64
RANKS_PER_WORKER = 22


# Defined before the kit's tests are imported, so it runs before them: they end by killing
# a process, whose group the kit holds until the module ends.
def test_the_kit_runs_here_at_world_size_64_with_light_ranks(
    hf_backend: DaskBackend, hf_kit_group
) -> None:
    group = hf_kit_group([WORLD_SIZE])
    pids = [w["pid"] for w in group.where()]
    assert group.world_size == WORLD_SIZE
    assert [pids.count(pid) for pid in dict.fromkeys(pids)] == [22, 22, 20]


from hybridflow_dask.testing.conformance import *  # noqa: E402, F403  (the kit's tests, fixtures)


@pytest.fixture(scope="module")
def hf_kit_world_size() -> int:
    return WORLD_SIZE


@pytest.fixture(scope="module")
def hf_backend_factory(hf_dask_cluster: Any) -> Callable[..., DaskBackend]:
    def make(attach_to: DaskBackend | None = None) -> DaskBackend:
        return DaskBackend(cluster=hf_dask_cluster, ranks_per_worker=RANKS_PER_WORKER)

    return make


@pytest.fixture(scope="module", autouse=True)
def _cluster_whole_again(hf_dask_cluster: Any, pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    workers = int(pytestconfig.getini("hf_dask_workers"))
    with Client(hf_dask_cluster, set_as_default=False) as client:
        client.wait_for_workers(workers, timeout=120)
