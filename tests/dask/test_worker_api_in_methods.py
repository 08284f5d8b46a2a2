"""Inside a worker method, Dask's worker API works as in a Dask actor: ``get_worker()``
names the hosting worker, and ``get_client()`` / ``worker_client()`` submit Dask work."""

from __future__ import annotations

import asyncio

import pytest
from call_paths import PATHS, backend_on
from distributed import get_client, get_worker, worker_client

import hybridflow_dask as hf


def _square(x: int) -> int:
    return x * x


class UsesDask(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def address(self) -> str:
        return get_worker().address

    @hf.register(hf.Dispatch.RANK_ZERO)
    def submit_with_get_client(self, x: int) -> int:
        return get_client().submit(_square, x, pure=False).result()

    @hf.register(hf.Dispatch.RANK_ZERO)
    def submit_with_worker_client(self, x: int) -> int:
        with worker_client() as client:
            return client.submit(_square, x, pure=False).result()

    @hf.register(hf.Dispatch.RANK_ZERO)
    async def address_from_a_coroutine(self) -> str:
        await asyncio.sleep(0)
        return get_worker().address


@pytest.fixture(scope="module", params=list(PATHS))
def group(request, hf_dask_cluster):
    with backend_on(request.param, hf_dask_cluster) as backend:
        wg = hf.WorkerGroup(hf.ResourcePool([2]), UsesDask, backend=backend)
        yield wg
        wg.shutdown()


def test_get_worker_names_the_worker_hosting_each_rank(group):
    hosting = [ref.slot.address for ref in group._refs]
    assert group.address() == hosting


def test_get_client_submits_dask_work_from_a_method(group):
    assert group.submit_with_get_client(7) == 49


def test_worker_client_submits_dask_work_from_a_method(group):
    assert group.submit_with_worker_client(5) == 25


def test_get_worker_works_in_an_async_method(group):
    assert group.address_from_a_coroutine() == group._refs[0].slot.address
