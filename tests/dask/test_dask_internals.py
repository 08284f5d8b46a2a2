"""Canaries for the private Dask APIs the backend relies on (one module: dask_internals)."""

from __future__ import annotations

from distributed import get_client

from hybridflow_dask.backends.dask.internals import adopt_future


class Box:
    """Hides a future from Dask's argument traversal, as a DataProtoFuture does."""

    def __init__(self, future):
        self.future = future


def _inc(x):
    return x + 1


def _read_boxed(box):
    client = get_client()
    return client.gather([adopt_future(client, box.future.key)], direct=True)[0]


def test_a_worker_can_adopt_a_future_that_travelled_inside_an_argument(hf_dask_backend):
    client = hf_dask_backend.client
    workers = sorted(client.scheduler_info()["workers"])
    made = client.submit(_inc, 1, workers=workers[:1], pure=False)
    made.result()
    read = client.submit(_read_boxed, Box(made), workers=workers[1:2], pure=False)
    assert read.result(timeout=30) == 2
