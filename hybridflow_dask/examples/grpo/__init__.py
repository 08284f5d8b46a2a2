"""GRPO on a toy task with fused ``actor_rollout_ref`` + ``reward`` workers over gloo.

``run_demo(steps=60)`` trains a tiny causal transformer to reverse a short prompt and
returns the per-step metrics; ``hybridflow-dask demo`` wraps it with a progress bar, a
table, ``metrics.json`` and a reward plot. ``run_demo(checkpoint_every=K, ...)`` survives
a lost worker with ``hf.Recovery``, and ``kill_worker_at=S`` kills one to show it.
"""

from .config import GRPOConfig
from .driver import UnsuitableBackendError, grpo_workers, open_backend, run_demo
from .task import ReverseTask
from .workers import ActorRolloutRefWorker, RewardWorker, group_relative_advantages

__all__ = [
    "ActorRolloutRefWorker",
    "GRPOConfig",
    "ReverseTask",
    "RewardWorker",
    "UnsuitableBackendError",
    "group_relative_advantages",
    "grpo_workers",
    "open_backend",
    "run_demo",
]
