"""Which local cluster an owned ``DaskBackend`` starts, and starting it.

``dask_cuda.LocalCUDACluster`` (one worker per GPU, each pinned to its device) when
dask-cuda is importable and NVML sees GPUs; otherwise ``distributed.LocalCluster`` with
one single-threaded worker process per slot. Both listen on the loopback interface.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import dask
from distributed import LocalCluster

__all__ = ["ClusterChoice", "choose_local_cluster", "detect_gpus", "start_local_cluster"]

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


class _SlotCluster(LocalCluster):
    """A LocalCluster whose workers are named ``hf-slot-<n>`` in the dashboard."""

    def _new_worker_name(self, worker_number: int) -> str:
        return f"hf-slot-{worker_number}"


def start_local_cluster(n_workers: int, **kwargs: Any) -> tuple[Any, ClusterChoice]:
    """Start the cluster ``probe_local_cluster`` picks; extra ``kwargs`` go to its constructor."""
    choice = probe_local_cluster()
    logger.info("DaskBackend starts a %s: %s", choice.kind, choice.reason)
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "dashboard_address": "127.0.0.1:0",
        **kwargs,
    }
    with dask.config.set({"distributed.scheduler.no-workers-timeout": "3s"}):
        if choice.kind == "LocalCUDACluster":
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(**options)
        else:
            options.setdefault("threads_per_worker", 1)
            options.setdefault("processes", True)
            cluster = _SlotCluster(n_workers=0, **options)
            if n_workers:
                cluster.scale(n_workers)
    return cluster, choice
