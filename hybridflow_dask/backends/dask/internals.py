"""The one place that uses a private Dask API, because no public one does the job.

``adopt_future``: inside a worker task, turn the key of a future that travelled inside
an argument (a ``DataProtoFuture`` handed to a ``materialize_futures=False`` method) into
a working ``Future`` of the worker's client. Unpickled futures are not bound to any
client, and a ``Future(key, client)`` made by hand never learns its state unless the
scheduler is told that this client wants the key, which ``Client`` only says through
its private ``_send_to_scheduler``. ``tests/dask/test_dask_internals.py`` fails loudly if
Dask changes this.
"""

from __future__ import annotations

from typing import Any

from distributed import Future

__all__ = ["adopt_future"]


def adopt_future(client: Any, key: Any) -> Future:
    """A ``Future`` for ``key`` bound to ``client`` (the scheduler keeps the key for it)."""
    future = Future(key, client)
    client._send_to_scheduler({"op": "client-desires-keys", "keys": [key], "client": client.id})
    return future
