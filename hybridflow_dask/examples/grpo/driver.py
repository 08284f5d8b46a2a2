"""The GRPO loop, written as the single controller: plain sequential Python.

Each step issues the whole dataflow without waiting::

    batch = actor.generate_sequences(prompts)      # DataProtoFuture
    batch = actor.compute_log_prob(batch)          # old log-probs
    batch = actor.compute_ref_log_prob(batch)      # reference log-probs
    batch = reward.compute_reward(batch)
    batch = reward.compute_advantage(batch)        # group-relative (GRPO)
    stats = actor.update_actor(batch)              # DP_COMPUTE_METRIC: per-rank dicts

Every intermediate batch is a ``DataProtoFuture``; because both roles are fused on one
pool, shard ``i`` stays in rank ``i``'s process from sampling to the update and only
the prompts (in) and the metric dicts (out) pass through the driver.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import hybridflow_dask as hf
from hybridflow_dask.backends.base import Backend

from .config import GRPOConfig
from .workers import ActorRolloutRefWorker, RewardWorker, make_task

__all__ = ["grpo_workers", "run_demo"]

logger = logging.getLogger(__name__)

StepCallback = Callable[[dict[str, Any]], None]


@contextmanager
def grpo_workers(
    config: GRPOConfig, world_size: int, backend: Backend | None = None
) -> Iterator[tuple[hf.WorkerGroup, hf.WorkerGroup]]:
    """The ``actor_rollout_ref`` and ``reward`` groups, fused on one pool of ``world_size``.

    On exit the ranks leave their torch process group and the fused group shuts down.
    """
    config.validate(world_size)
    pool = hf.ResourcePool([world_size], use_gpu=False)
    fused_cls = hf.create_colocated_worker_cls(
        {
            "actor_rollout_ref": hf.ClassWithInitArgs(ActorRolloutRefWorker, config),
            "reward": hf.ClassWithInitArgs(RewardWorker, config),
        }
    )
    with hf.WorkerGroup(pool, fused_cls, backend=backend, name_prefix=_group_name()) as fused:
        roles = fused.spawn(prefix_set=["actor_rollout_ref", "reward"])
        actor = roles["actor_rollout_ref"]
        try:
            yield actor, roles["reward"]
        finally:
            try:
                actor.release()
            except Exception:  # a dead rank must not hide the error that killed it
                logger.warning("could not release the torch process groups", exc_info=True)


def _group_name() -> str:
    """``grpo_<id>``: how the group's tasks are labelled in the Dask dashboard."""
    return f"grpo_{uuid.uuid4().hex[:6]}"


def run_demo(
    steps: int = 60,
    *,
    world_size: int = 2,
    seed: int = 0,
    backend: Backend | None = None,
    config: GRPOConfig | None = None,
    on_step: StepCallback | None = None,
) -> dict[str, Any]:
    """Train the toy policy with GRPO for ``steps`` steps; return the per-step metrics.

    The result is ``{"steps": [{"step", "reward_mean", "loss", "time_s", ...}, ...],
    "config": {...}, "param_checksums": [...], "initial_checksum": ...}``: the checksums
    are the ranks' policy weights after the last update (all equal when the gradients
    were all-reduced). ``on_step`` is called with each step's record as it completes.
    ``seed`` is used only when no ``config`` is given. ``backend`` defaults to the
    process-wide one (``hf.init``), as for any WorkerGroup; it must run each rank in its
    own process (``DaskBackend``), since the ranks rendezvous over gloo.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    config = config or GRPOConfig(seed=seed)
    task = make_task(config)
    prompt_gen = torch.Generator().manual_seed(config.seed)
    records: list[dict[str, Any]] = []
    with grpo_workers(config, world_size, backend) as (actor, reward):
        initial_checksum = actor.param_checksum()[0]
        for step in range(1, steps + 1):
            start = time.perf_counter()
            prompts = task.sample_prompts(config.prompts_per_step, prompt_gen)
            prompts = prompts.repeat(config.samples_per_prompt, interleave=True)

            batch = actor.generate_sequences(prompts)
            batch = actor.compute_log_prob(batch)
            batch = actor.compute_ref_log_prob(batch)
            batch = reward.compute_reward(batch)
            batch = reward.compute_advantage(batch)
            reward_stats = reward.reward_metrics(batch)  # futures, one per rank
            actor_stats = actor.update_actor(batch)  # blocks: the step is done

            record = {"step": step, **_reduce(hf.get(reward_stats), actor_stats)}
            record["time_s"] = time.perf_counter() - start
            records.append(record)
            logger.info(
                "step %d: reward %.3f loss %.4f (%.2fs)",
                step,
                record["reward_mean"],
                record["loss"],
                record["time_s"],
            )
            if on_step is not None:
                on_step(record)
        checksums = actor.param_checksum()
    return {
        "steps": records,
        "config": {**config.to_dict(), "steps": steps, "world_size": world_size},
        "initial_checksum": initial_checksum,
        "param_checksums": checksums,
    }


def _reduce(reward_stats: list[dict[str, float]], actor_stats: list[dict[str, float]]) -> dict:
    """Cluster-wide numbers from per-rank ones: row-weighted rewards, mean actor stats."""
    rows = sum(s["rows"] for s in reward_stats)
    out = {
        "reward_mean": sum(s["reward_sum"] for s in reward_stats) / rows,
        "solved": sum(s["solved_sum"] for s in reward_stats) / rows,
    }
    for key in actor_stats[0]:
        out[key] = sum(s[key] for s in actor_stats) / len(actor_stats)
    return out
