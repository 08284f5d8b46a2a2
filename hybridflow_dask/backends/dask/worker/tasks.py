"""The task path's worker side: functions Dask runs as tasks pinned to the rank's worker.

Each hands its job to the instance's actor (the same thread, order and environment as a
direct call) and waits off the worker's thread pool; plus the small probes the driver
runs on workers (``client.run``) and the runner that resolves a ``DataProtoFuture`` inside
a worker.
"""

from __future__ import annotations

from typing import Any

from distributed import Future, get_client, get_worker, rejoin, secede

from ...base import InstanceRef
from ...hosting import find_free_port, sendable
from ..internals import adopt_future
from ..wire.keys import task_key
from ..wire.snapshot import Captured, snapshot
from .call_log import CallRecord
from .host import PLUGIN_NAME, InstanceHost
from .jobs import Construct, Invoke

__all__ = [
    "WorkerRunner",
    "count_instances",
    "count_visible_gpus",
    "create_instance",
    "destroy_instance",
    "probe_worker",
    "run_call",
    "skip_call",
    "worker_port",
]


def _host() -> InstanceHost:
    try:
        return get_worker().plugins[PLUGIN_NAME]
    except (KeyError, ValueError):
        raise RuntimeError(
            "this Dask worker has no hybridflow host plugin; was it started after the "
            "DaskBackend registered it, on a cluster the backend can reach?"
        ) from None


def _begin(host: InstanceHost, ref: InstanceRef, method: str) -> CallRecord:
    """The call's record; its inputs were fetched by Dask before the task started (Dask's
    task stream draws that, and this task's span)."""
    record = host.calls.begin(ref, str(get_worker().get_current_task()), method, path="task")
    record.inputs = record.received
    return record


def _await_off_pool(future: Any, record: CallRecord | None = None) -> Any:
    """Wait for an actor's outcome without holding a task thread its inputs may need."""
    secede()
    try:
        result = future.result()
    except BaseException as exc:
        error = sendable(exc)
    else:
        if record is not None:
            _host().calls.end(record)
        return result
    finally:
        rejoin()
    if record is not None:
        _host().calls.end(record, error)
    raise error  # outside the handler: Dask pickles a raised error's context too


def create_instance(
    ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict, driver: str, seq: int
) -> None:
    """Build the instance (in its own actor thread) with the rank's environment."""
    host = _host()
    actor = host.new_actor(ref, env)
    record = _begin(host, ref, "__init__")
    args, kwargs = Captured.opened(args), Captured.opened(kwargs)
    try:
        _await_off_pool(actor.submit(driver, seq, Construct(cls, args, kwargs, record)), record)
    except BaseException:
        host.forget(ref.key)
        raise


def run_call(
    ref: InstanceRef,
    driver: str,
    seq: int,
    method: str,
    args: tuple,
    kwargs: dict,
    private: tuple = (),
    share: bool = False,
) -> Any:
    """One call; ``private`` lists the arguments that are shared data to copy first, and
    ``share`` keeps the result by reference (``hybridflow.share-colocated-inputs``)."""
    host = _host()
    actor = host.actor(ref.key)  # gone (group shut down): fail now rather than wait a turn
    record = _begin(host, ref, method)
    args, kwargs = Captured.opened(args), Captured.opened(kwargs)
    if private:
        what = f"an input of {ref.group}.{method}"
        args = tuple(snapshot(a, what) if i in private else a for i, a in enumerate(args))
        kwargs = {k: snapshot(v, what) if k in private else v for k, v in kwargs.items()}
    invoke = Invoke(method, args, kwargs, snapshot=not share, record=record)
    return _await_off_pool(actor.submit(driver, seq, invoke), record)


def destroy_instance(ref: InstanceRef, driver: str, seq: int) -> None:
    host = _host()
    actor = host.actors.get(ref.key)
    if actor is None:
        return
    try:
        _await_off_pool(actor.close(driver, seq))
    finally:
        host.forget(ref.key)


def skip_call(instance: str, driver: str, seq: int) -> None:
    """A call that will never run (its input failed): let later calls go ahead."""
    _host().skip(instance, driver, seq)


class WorkerRunner:
    """Resolves a ``DataProtoFuture`` inside a worker (``materialize_futures=False``)."""

    def submit(self, fn: Any, *args: Any, slot: Any = None, label: str = "hf") -> Any:
        options = {"workers": [slot.address], "allow_other_workers": False} if slot else {}
        return _client().submit(fn, *args, pure=False, key=task_key(label), **options)

    def gather(self, futures: Any) -> list[Any]:
        # Futures unpickled with a call are bound to no client: adopt them by key.
        client = _client()
        return client.gather([adopt_future(client, f.key) for f in futures], direct=True)

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, Future)


def _client() -> Any:
    """The client of the worker this code runs in (an actor's thread or a task's)."""
    return get_client()


def count_instances(dask_worker: Any) -> int:
    """How many instances live in this worker process (any backend's)."""
    host = dask_worker.plugins.get(PLUGIN_NAME)
    return len(host.actors) if host is not None else 0


def worker_port(dask_worker: Any) -> int:
    """A port free on the host of this worker's address, which ranks use as ``MASTER_ADDR``."""
    from distributed.comm.addressing import get_address_host

    return find_free_port(get_address_host(dask_worker.address))


def count_visible_gpus(visible: str | None, nvml_gpus: int | None) -> int | None:
    """How many GPUs CUDA will show a process with ``CUDA_VISIBLE_DEVICES=visible`` on a
    host where NVML sees ``nvml_gpus`` (``None``: NVML unknown, so this cannot tell).

    CUDA's reading: entries up to the first that names no GPU (an index out of range, a
    negative or repeated one); ``GPU-``/``MIG-`` UUIDs are taken as named; unset means all.
    """
    if nvml_gpus is None:
        return None
    if nvml_gpus == 0 or visible is None:
        return nvml_gpus
    seen: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            ok = True
        else:
            ok = entry.isdigit() and int(entry) < nvml_gpus
        if not ok or entry in seen:
            break
        seen.append(entry)
    return len(seen)


def _nvml_gpus() -> int | None:
    """GPUs NVML sees on this host, when NVML answers and torch was built with CUDA."""
    try:
        import pynvml
        import torch

        if torch.version.cuda is None:
            return None
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def probe_worker(dask_worker: Any) -> dict:
    """What this worker offers (its GPUs as this process sees them), and its identity.

    Counted from ``CUDA_VISIBLE_DEVICES`` and NVML, without starting CUDA in the worker:
    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when a process first uses it, so the first
    rank's environment (its ``CUDA_VISIBLE_DEVICES`` in local-rank order, where
    ``cuda:LOCAL_RANK`` is its GPU) must be in place by then, not dask-cuda's order for
    the worker (its own GPU first). Without NVML, torch counts (and starts CUDA).
    """
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = count_visible_gpus(visible, _nvml_gpus())
    if gpus is None:
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
