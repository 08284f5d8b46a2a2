"""What a Dask worker offers a pool's slots: its GPUs, counted without starting CUDA.

Run on each worker by the driver's placement (``client.run``), before any rank lives there.
"""

from __future__ import annotations

from typing import Any

__all__ = ["count_visible_gpus", "probe_worker"]


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
