"""The task path's worker side: functions Dask runs as tasks pinned to the rank's worker.

Each hands its call to the one call flow (``hosting.Instances``: the same look-up, order,
copies, thread and environment as a direct call) and waits off the worker's thread pool;
plus the small probes the driver
runs on workers (``client.run``) and the runner that resolves a ``DataProtoFuture`` inside
a worker.
"""

from __future__ import annotations

from typing import Any

from distributed import Future, get_client, get_worker, rejoin, secede

from ....protocol.lazy_tensordict import import_now
from ...base import InstanceRef
from ...hosting import Call, Instances, explain_load_error, find_free_port
from ..internals import adopt_future
from ..wire.keys import task_key
from ..wire.snapshot import Captured
from .plugin import PLUGIN_NAME, InstancesPlugin

__all__ = [
    "WorkerRunner",
    "count_instances",
    "create_instance",
    "destroy_instance",
    "run_call",
    "skip_call",
    "worker_port",
]


def _instances() -> Instances:
    try:
        plugin: InstancesPlugin = get_worker().plugins[PLUGIN_NAME]
    except (KeyError, ValueError):
        raise RuntimeError(
            "this Dask worker has no hybridflow instances plugin; was it started after the "
            "DaskBackend registered it, on a cluster the backend can reach?"
        ) from None
    return plugin.instances


def _await_off_pool(future: Any) -> Any:
    """Wait for an outcome without holding a task thread its inputs may need."""
    secede()
    try:
        return future.result()
    except BaseException as exc:
        error = exc
    finally:
        rejoin()
    raise error  # outside the handler: Dask pickles a raised error's context too


def _opened(private: tuple) -> Any:
    """The task's arguments, its driver values opened; Dask fetched its input futures
    into this worker's memory (``private``: the arguments holding them), where other
    tasks may get the very same objects, so the call flow copies them."""

    def resolve(args: tuple, kwargs: dict) -> Any:
        return Captured.opened(args), Captured.opened(kwargs), private

    return resolve


def _task_key() -> str:
    return str(get_worker().get_current_task())


def create_instance(
    ref: InstanceRef, cls: Captured, args: tuple, kwargs: dict, env: dict, driver: str, seq: int
) -> None:
    """Build the instance (in its own actor thread) with the rank's environment."""
    try:
        (opened,) = Captured.opened((cls,))
    except Exception as exc:
        raise explain_load_error(exc, get_worker().address, "the worker class") from None
    call = Call(ref.key, driver, seq, "__init__", args, kwargs, key=_task_key(), path="task")
    _await_off_pool(_instances().construct_now(ref, opened, env, call, _opened(())))


def run_call(
    ref: InstanceRef,
    driver: str,
    seq: int,
    method: str,
    args: tuple,
    kwargs: dict,
    private: tuple = (),
    share: bool = False,
    deadline: float | None = None,
) -> Any:
    """One call; ``private`` lists the arguments that hold input futures, and ``share``
    keeps the result by reference (``hybridflow.share-colocated-inputs``)."""
    call = Call(
        ref.key, driver, seq, method, args, kwargs, "kept", share, deadline, _task_key(), "task"
    )
    return _await_off_pool(_instances().serve_now(call, _opened(private)))


def destroy_instance(ref: InstanceRef, driver: str, seq: int) -> None:
    _await_off_pool(_instances().close(ref.key, driver, seq))


def skip_call(instance: str, driver: str, seq: int) -> bool:
    """A call that must not run (its input failed, or its driver reported it failed):
    later calls go ahead. Whether it is sure not to run."""
    return _instances().withdraw(instance, driver, seq)


class WorkerRunner:
    """Resolves a ``DataProtoFuture`` inside a worker (``materialize_futures=False``)."""

    def submit(self, fn: Any, *args: Any, slot: Any = None, label: str = "hf") -> Any:
        options = {"workers": [slot.address], "allow_other_workers": False} if slot else {}
        return _client().submit(fn, *args, pure=False, key=task_key(label), **options)

    def gather(self, futures: Any) -> list[Any]:
        # Futures unpickled with a call are bound to no client: adopt them by key. The
        # rows are decoded on the worker's loop: tensordict's import must not happen there.
        import_now()
        client = _client()
        return client.gather([adopt_future(client, f.key) for f in futures], direct=True)

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, Future)


def _client() -> Any:
    """The client of the worker this code runs in (an actor's thread or a task's)."""
    return get_client()


def count_instances(dask_worker: Any) -> int:
    """How many instances live in this worker process (any backend's)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return len(plugin.instances) if plugin is not None else 0


def worker_port(dask_worker: Any) -> int:
    """A port free on the host of this worker's address, which ranks use as ``MASTER_ADDR``."""
    from distributed.comm.addressing import get_address_host

    return find_free_port(get_address_host(dask_worker.address))
