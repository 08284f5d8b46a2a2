"""The worker side of the Dask backend: a plugin that hosts instances and orders calls.

Each Dask worker process gets one ``InstanceHost`` (a ``WorkerPlugin``). Method calls
arrive as ordinary pinned tasks carrying a per-instance sequence number; a call that
arrives early (a later call whose inputs were ready first) secedes from the worker's
thread pool and waits for its turn, so calls on one instance run in the order the
driver issued them without chaining every call to the previous one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from distributed import Future, get_client, get_worker, rejoin, secede
from distributed.diagnostics.plugin import WorkerPlugin

from ..base import InstanceRef
from ..hosting import InstanceTable, find_free_port
from .dashboard import task_key
from .internals import adopt_future

__all__ = [
    "PLUGIN_NAME",
    "InstanceHost",
    "create_instance",
    "destroy_instance",
    "run_call",
    "skip_call",
]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "hybridflow-host"


class CallOrder:
    """Issue order of one driver's calls to one instance."""

    def __init__(self) -> None:
        self.next = 1
        self.skipped: set[int] = set()
        self.cond = threading.Condition()

    def ready(self, seq: int) -> bool:
        return self.next == seq

    def wait_turn(self, seq: int) -> None:
        with self.cond:
            if self.ready(seq):
                return
        secede()  # free the thread slot so earlier calls (and their inputs) can run
        with self.cond:
            self.cond.wait_for(lambda: self.ready(seq))
        rejoin()

    def finish(self, seq: int) -> None:
        with self.cond:
            if seq >= self.next:
                self.skipped.add(seq)
                while self.next in self.skipped:
                    self.skipped.discard(self.next)
                    self.next += 1
            self.cond.notify_all()


class InstanceHost(WorkerPlugin):
    """Instances living in this worker process, and the order of calls to each."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self.table = InstanceTable()
        self.orders: dict[tuple[str, str], CallOrder] = {}
        self._lock = threading.Lock()

    def order(self, instance: str, driver: str) -> CallOrder:
        with self._lock:
            order = self.orders.get((instance, driver))
            if order is None:
                order = self.orders[(instance, driver)] = CallOrder()
            return order

    @contextlib.contextmanager
    def turn(self, instance: str, driver: str, seq: int) -> Iterator[None]:
        order = self.order(instance, driver)
        order.wait_turn(seq)
        try:
            yield
        finally:
            order.finish(seq)

    def forget(self, instance: str) -> None:
        self.table.remove(instance)
        with self._lock:
            for key in [k for k in self.orders if k[0] == instance]:
                del self.orders[key]


def _host() -> InstanceHost:
    try:
        return get_worker().plugins[PLUGIN_NAME]
    except (KeyError, ValueError):
        raise RuntimeError(
            "this Dask worker has no hybridflow host plugin; was it started after the "
            "DaskBackend registered it, on a cluster the backend can reach?"
        ) from None


# ---- task functions (run as pinned tasks on the worker) ------------------------------


def create_instance(ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict) -> None:
    """Construct the instance with the rank's environment in this worker process."""
    _host().table.create(ref, cls, args, kwargs, env, restore=False)


def run_call(
    ref: InstanceRef, driver: str, seq: int, method: str, args: tuple, kwargs: dict
) -> Any:
    host = _host()
    host.table.get(ref.key)  # gone (group shut down): fail now rather than wait for a turn
    with host.turn(ref.key, driver, seq):
        return host.table.invoke(ref, method, args, kwargs, restore=False)


def destroy_instance(ref: InstanceRef, driver: str, seq: int) -> None:
    host = _host()
    with host.turn(ref.key, driver, seq):
        pass
    host.forget(ref.key)


def skip_call(instance: str, driver: str, seq: int) -> None:
    """A call that will never run (its input failed): let later calls go ahead."""
    _host().order(instance, driver).finish(seq)


class WorkerRunner:
    """Resolves a ``DataProtoFuture`` inside a worker (``materialize_futures=False``)."""

    def submit(self, fn: Any, *args: Any, slot: Any = None, label: str = "hf") -> Any:
        options = {"workers": [slot.address], "allow_other_workers": False} if slot else {}
        return get_client().submit(fn, *args, pure=False, key=task_key(label), **options)

    def gather(self, futures: Any) -> list[Any]:
        # Futures unpickled with a task are bound to no client: adopt them by key.
        client = get_client()
        return client.gather([adopt_future(client, f.key) for f in futures], direct=True)

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, Future)


def worker_port() -> int:
    return find_free_port()


def probe_worker(dask_worker: Any) -> dict:
    """What this worker offers (its GPUs as this process sees them), and its identity."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # no torch or no driver: a CPU worker
        gpus = 0
    device = "cpu"
    if gpus:
        first = (visible or "0").split(",")[0].strip()
        device = f"cuda:{first}"
    return {"gpus": gpus, "device": device, "worker_id": dask_worker.id}
