"""Which local cluster an owned ``DaskBackend`` starts, and starting it.

``dask_cuda.LocalCUDACluster`` (one worker per GPU, each pinned to its device) when
dask-cuda is importable and NVML sees GPUs; otherwise ``distributed.LocalCluster`` with
one single-threaded worker process per slot. Both listen on the loopback interface, and
speak only TLS when given a ``Security`` (scheduler, workers, nannies and clients alike).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dask
from distributed import LocalCluster
from distributed.core import Status

from ..config import loop_check_interval, message_log_length, task_stream_length, worker_preload
from ..internals import ForkserverNanny, owned_cluster_class, start_fork_server
from ..wire.device_route import DEVICE_COMMS, ucx_available

__all__ = [
    "ClusterChoice",
    "check_protocol",
    "choose_local_cluster",
    "detect_gpus",
    "quiet_restarts",
    "start_local_cluster",
    "wait_for_local_workers",
]

#: How often a wait for an owned cluster's workers looks at its nannies.
NANNY_CHECK_S = 0.25

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterChoice:
    kind: str  # "LocalCUDACluster" or "LocalCluster"
    reason: str
    gpus: int = 0


def detect_gpus() -> tuple[int, str]:
    """GPUs NVML can see, and why there are none when there are none."""
    try:
        import pynvml
    except ImportError:
        return 0, "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount()), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: no driver here
        return 0, f"NVML is unavailable ({type(exc).__name__})"


def dask_cuda_available() -> tuple[bool, str]:
    try:
        import dask_cuda  # noqa: F401
    except Exception as exc:
        return False, f"dask-cuda is not importable ({type(exc).__name__}: {exc})"
    return True, "dask-cuda is importable"


def choose_local_cluster(
    gpus: int, gpu_reason: str, cuda_ok: bool, cuda_reason: str
) -> ClusterChoice:
    """Pure decision, so it can be tested with any probe result."""
    if gpus > 0 and cuda_ok:
        return ClusterChoice(
            "LocalCUDACluster", f"{gpus} GPU(s) seen by {gpu_reason}; {cuda_reason}", gpus
        )
    if gpus > 0:
        return ClusterChoice(
            "LocalCluster",
            f"{gpus} GPU(s) seen but {cuda_reason}: install hybridflow-dask[cuda] for one "
            "worker per GPU",
            gpus,
        )
    return ClusterChoice("LocalCluster", f"no GPU: {gpu_reason}", 0)


def probe_local_cluster() -> ClusterChoice:
    gpus, gpu_reason = detect_gpus()
    cuda_ok, cuda_reason = dask_cuda_available() if gpus else (False, "not needed")
    return choose_local_cluster(gpus, gpu_reason, cuda_ok, cuda_reason)


#: Names of the workers of an owned CPU cluster in the dashboard: ``hf-slot-<n>``.
WORKER_PREFIX = "hf-slot-"


def owned_settings() -> dict[str, Any]:
    """Dask settings for a cluster the backend starts (and its scheduler's plugins).

    The task stream keeps a record per call (direct calls too): Dask's default of 100,000
    records grew the driver by ~250 MiB in a long run (the scheduler lives in the driver's
    process), so it keeps ``hybridflow.task-stream-length`` (10,000 by default: the last
    minutes of a busy run), as the group monitor does on any cluster. Its logs of recent
    messages and events keep ``hybridflow.message-log-length`` entries (the streams made
    later, as workers and clients connect, are shortened by ``MessageLogCap``). What its
    worker processes start with is ``worker_settings``.
    """
    settings: dict[str, Any] = {"distributed.scheduler.no-workers-timeout": "3s", **loop_settings()}
    length = task_stream_length()
    if length is not None:
        settings["distributed.scheduler.dashboard.status.task-stream-length"] = length
        settings["distributed.scheduler.dashboard.tasks.task-stream-length"] = length
    logs = message_log_length()
    if logs is not None:
        settings["distributed.admin.low-level-log-length"] = logs
    return settings


def start_local_cluster(
    n_workers: int, *, security: Any = None, **kwargs: Any
) -> tuple[Any, ClusterChoice]:
    """Start the cluster ``probe_local_cluster`` picks; extra ``kwargs`` go to its constructor.

    With ``security`` (a ``distributed.security.Security``) every comm is ``tls://``, so
    nothing reaches the scheduler or a worker without a certificate the CA signed.
    """
    check_protocol(kwargs.get("protocol"))
    choice = probe_local_cluster()
    logger.info("DaskBackend starts a %s: %s", choice.kind, choice.reason)
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
        **kwargs,
    }
    if security is not None:
        options["security"] = security
        options.setdefault("protocol", "tls://")
    with dask.config.set(owned_settings()):
        if choice.kind == "LocalCUDACluster":
            from dask_cuda import LocalCUDACluster

            cluster = owned_cluster_class(LocalCUDACluster)(**_with_worker_config(options))
        else:
            options.setdefault("threads_per_worker", 1)
            options.setdefault("processes", True)
            if options["processes"]:  # (a worker in this process reads this process's config)
                options = _with_worker_config(options)
                options.setdefault("worker_class", ForkserverNanny)
                if options["worker_class"] is ForkserverNanny:
                    options["preload_once"] = worker_preload()
                    options["settings"] = loop_settings()
                    start_fork_server(options["preload_once"])
            cluster = owned_cluster_class(LocalCluster, WORKER_PREFIX)(n_workers=0, **options)
            if n_workers:
                cluster.scale(n_workers)
    return cluster, choice


def wait_for_local_workers(cluster: Any, client: Any, n: int, timeout: float) -> None:
    """Wait until the cluster the backend started has ``n`` workers. A worker process
    that could not start is a ``RuntimeError`` at once instead of the whole wait: its
    nanny has given up, and the process's own error is already in the output."""
    deadline = time.monotonic() + timeout
    while True:
        failed = sorted(
            str(name)
            for name, nanny in list(cluster.workers.items())
            if getattr(nanny, "status", None) == Status.failed
        )
        if failed:
            raise RuntimeError(
                f"worker processes {failed} of the local cluster failed to start (each "
                "printed its own error above). The usual cause: the driver script makes a "
                "backend or group when it is imported, and a new worker process imports "
                "it too (as every multiprocessing start method but fork does); put that "
                'code under `if __name__ == "__main__":`'
            )
        left = deadline - time.monotonic()
        try:
            client.wait_for_workers(n, timeout=max(0.01, min(NANNY_CHECK_S, left)))
            return
        except TimeoutError:
            if left <= NANNY_CHECK_S:
                raise


def loop_settings() -> dict[str, Any]:
    """Dask settings every process of a cluster the backend starts runs its event loop
    with (scheduler, nannies, workers): its health check every
    ``hybridflow.loop-check-interval``. Each check wakes the loop, and the driver's loop
    hosts the scheduler and every nanny."""
    interval = loop_check_interval()
    return {} if interval is None else {"distributed.admin.tick.interval": interval}


def worker_settings() -> dict[str, Any]:
    """Dask settings each worker process of a cluster the backend starts runs with: Dask's
    statistical profiler only with ``hybridflow.worker-profiler`` (it samples threads
    running Dask tasks, never a group's calls), and ``loop_settings``. Dotted keys: the
    worker applies them with ``dask.config.set``, where a nested section would replace
    all of Dask's."""
    profiler = bool(dask.config.get("hybridflow.worker-profiler"))
    return {"distributed.worker.profile.enabled": profiler, **loop_settings()}


def _with_worker_config(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``worker_settings`` for each nanny to hand its worker process (the
    nannies are made after the cluster's constructor returns, outside ``owned_settings``);
    what the caller gave as ``config`` wins."""
    return {**options, "config": {**worker_settings(), **(options.get("config") or {})}}


def check_protocol(protocol: Any) -> None:
    """``ValueError`` for a ``ucx`` comm where Dask cannot speak it (no distributed-ucxx):
    said before anything starts, instead of Dask's own error from inside the cluster."""
    name = str(protocol or "").split("://", 1)[0].lower()
    if name in DEVICE_COMMS and not ucx_available():
        raise ValueError(
            f"protocol={protocol!r} needs the distributed-ucxx package (Dask's own UCX comm "
            "was removed): pip install distributed-ucxx-cu13 (CUDA 13; -cu12 for CUDA 12), "
            "or leave protocol unset for tcp://"
        )


class _RestartNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Restarting worker")


@contextlib.contextmanager
def quiet_restarts() -> Iterator[None]:
    """Drop the nannies' "Restarting worker" warning while we restart workers on purpose.

    An owned cluster's nannies log in this process; a restart the backend asked for (a
    fresh process for a new pool) is routine, not news for the user's terminal.
    """
    nanny_logger = logging.getLogger("distributed.nanny")
    notice = _RestartNotice()
    nanny_logger.addFilter(notice)
    try:
        yield
    finally:
        nanny_logger.removeFilter(notice)
