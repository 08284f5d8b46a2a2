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

With ``checkpoint_every`` the run survives a lost worker: each step runs under
``hf.Recovery``, which on a dead rank calls ``recover()`` on the fused group (both roles
live in its processes), then ``restore``: every rank rejoins a fresh process group and
reloads the last checkpoint, and the step runs again. ``kill_worker_at`` is the fault
drill: it SIGKILLs one rank's process in the middle of that step.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

import hybridflow_dask as hf
from hybridflow_dask.backends import registry
from hybridflow_dask.backends.base import Backend

from .config import GRPOConfig
from .workers import ActorRolloutRefWorker, RewardWorker, make_task

__all__ = [
    "CHECKPOINT_NAME",
    "UnsuitableBackendError",
    "grpo_workers",
    "open_backend",
    "run_demo",
]

logger = logging.getLogger(__name__)

StepCallback = Callable[[dict[str, Any]], None]

#: The checkpoint's file name in ``checkpoint_dir`` (one file, replaced at each save).
CHECKPOINT_NAME = "checkpoint.pt"


class UnsuitableBackendError(ValueError):
    """The backend cannot run the demo as asked (two ranks in one process, say)."""


@contextmanager
def open_backend(name: str, address: str | None = None) -> Iterator[Backend]:
    """The installed backend called ``name`` (``"dask"``, ``"ray"``, ``"local"`` or one a
    package registers: ``hybridflow_dask.backends.registry``), started here, or attached
    to the cluster at ``address``, and shut down on exit: the one argument that moves the
    same driver code between backends."""
    kwargs = {} if address is None else {"address": address}
    backend: Backend = registry.open_backend(name, **kwargs)
    try:
        yield backend
    finally:
        backend.shutdown()


@contextmanager
def grpo_workers(
    config: GRPOConfig, world_size: int, backend: Backend | None = None, nodes: int = 1
) -> Iterator[tuple[hf.WorkerGroup, hf.WorkerGroup, hf.WorkerGroup]]:
    """``(fused, actor_rollout_ref, reward)``: the two roles fused on one pool of ``world_size``
    ranks spread evenly over ``nodes`` hosts.

    ``fused`` is the group that owns the ranks (the one to ``recover()``); the other two
    are its role views. The ranks have joined their torch process group (generation 0).
    On exit they leave it and the fused group shuts down.
    """
    config.validate(world_size)
    if nodes < 1 or world_size % nodes:
        raise ValueError(
            f"nodes must be a positive divisor of world_size={world_size}, got {nodes}"
        )
    pool = hf.ResourcePool([world_size // nodes] * nodes, use_gpu=False)
    fused_cls = hf.create_colocated_worker_cls(
        {
            "actor_rollout_ref": hf.ClassWithInitArgs(ActorRolloutRefWorker, config),
            "reward": hf.ClassWithInitArgs(RewardWorker, config),
        }
    )
    with hf.WorkerGroup(pool, fused_cls, backend=backend, name_prefix=_group_name()) as fused:
        roles = fused.spawn(prefix_set=["actor_rollout_ref", "reward"])
        actor = roles["actor_rollout_ref"]
        _check_a_process_per_rank(actor)
        try:
            actor.join_process_group(0)
            yield fused, actor, roles["reward"]
        finally:
            try:
                actor.release()
            except Exception:  # a dead rank must not hide the error that killed it
                logger.warning("could not release the torch process groups", exc_info=True)


def _check_a_process_per_rank(actor: hf.WorkerGroup) -> None:
    """The ranks join one gloo process group, which needs a process per rank: two ranks in
    one process (a backend that runs them inline, like ``local``) would wait for each
    other forever, so that is an error up front."""
    # A process is a slot's worker (its address and incarnation), not a pid: hosts in
    # PID namespaces of their own give their processes the same small pids.
    processes = {(ref.slot.address, ref.slot.worker_id) for ref in actor.workers}
    if len(processes) < actor.world_size:
        raise UnsuitableBackendError(
            f"the GRPO demo needs a process per rank (the ranks join one torch process "
            f"group), but backend {actor.backend.name!r} runs its {actor.world_size} ranks in "
            f"{len(processes)} process(es): use world_size=1 (--workers 1) or a backend with "
            "a process per rank, such as dask or ray"
        )


def _group_name() -> str:
    """``grpo_<id>``: how the group's tasks are labelled in the Dask dashboard."""
    return f"grpo_{uuid.uuid4().hex[:6]}"


def run_demo(
    steps: int = 60,
    *,
    world_size: int = 2,
    nodes: int = 1,
    seed: int = 0,
    backend: Backend | str | None = None,
    config: GRPOConfig | None = None,
    on_step: StepCallback | None = None,
    checkpoint_every: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    kill_worker_at: int | None = None,
    kill_rank: int | None = None,
) -> dict[str, Any]:
    """Train the toy policy with GRPO for ``steps`` steps; return the per-step metrics.

    The result is ``{"steps": [{"step", "reward_mean", "loss", "time_s", ...}, ...],
    "recoveries": [{"step", "ranks", "seconds"}, ...], "config": {...},
    "param_checksums": [...], "initial_checksum": ...}``: the checksums are the ranks'
    policy weights after the last update (all equal when the gradients were
    all-reduced). ``on_step`` is called with each step's record as it completes.
    ``seed`` is used only when no ``config`` is given. ``backend`` defaults to the
    process-wide one (``hf.init``), as for any WorkerGroup; it must run each rank in its
    own process (``DaskBackend``, ``RayBackend``), since the ranks rendezvous over gloo.
    ``nodes`` spreads the ranks evenly over that many hosts (``ResourcePool`` entries).
    A name (``"dask"`` or ``"ray"``) starts that backend for the run and shuts it down
    after (``open_backend``): the driver code is the same on both.

    ``checkpoint_every=K`` saves the policy and optimizer to
    ``checkpoint_dir/checkpoint.pt`` at the start and after every K-th step (rank 0
    writes, the others wait), and arms recovery: a step that loses a worker is retried
    once, after every rank reloads that checkpoint (the steps since it are undone, their
    metrics kept). The folder must be one the workers can write and read at the same
    path (any local cluster; shared storage across hosts).

    ``kill_worker_at=S`` (needs ``checkpoint_every``) is the fault drill: in step ``S``,
    once its dataflow is issued, the process of rank ``kill_rank`` (default: the last
    rank) is sent SIGKILL, by the pid the rank reports. It kills by pid, so the workers
    must run on this machine.
    """
    if isinstance(backend, str):
        with open_backend(backend) as opened:
            return run_demo(
                steps,
                world_size=world_size,
                nodes=nodes,
                seed=seed,
                backend=opened,
                config=config,
                on_step=on_step,
                checkpoint_every=checkpoint_every,
                checkpoint_dir=checkpoint_dir,
                kill_worker_at=kill_worker_at,
                kill_rank=kill_rank,
            )
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if checkpoint_every is not None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to write the policy to")
    if kill_worker_at is not None:
        if checkpoint_every is None:
            raise ValueError(
                "kill_worker_at needs checkpoint_every: a run without checkpoints has no "
                "state to restore after the drill kills a worker"
            )
        if not 1 <= kill_worker_at <= steps:
            raise ValueError(
                f"kill_worker_at must be a step from 1 to {steps}, got {kill_worker_at}"
            )
    victim = world_size - 1 if kill_rank is None else kill_rank
    if not 0 <= victim < world_size:
        raise ValueError(f"kill_rank must be a rank from 0 to {world_size - 1}, got {kill_rank}")
    config = config or GRPOConfig(seed=seed)
    task = make_task(config)
    prompt_gen = torch.Generator().manual_seed(config.seed)
    path = None
    if checkpoint_dir is not None:
        # absolute: worker processes need not share the driver's working directory
        path = str(Path(checkpoint_dir).resolve() / CHECKPOINT_NAME)
    records: list[dict[str, Any]] = []
    with grpo_workers(config, world_size, backend, nodes) as (fused, actor, reward):
        initial_checksum = actor.param_checksum()[0]
        victim_pid = _drill_target(actor, victim) if kill_worker_at is not None else None
        generation = 0  # of the torch process group: one more after each recovery

        def restore(rebuilt: dict[str, list[int]]) -> None:
            nonlocal generation
            generation += 1
            actor.join_process_group(generation)  # every rank: the survivors' group is broken
            restored = actor.load_checkpoint(path)[0]
            logger.warning(
                "restored the step-%d checkpoint on all %d ranks (rebuilt: %s)",
                restored,
                world_size,
                rebuilt[fused.name_prefix],
            )

        # Without checkpoints there is nothing to restore: a lost worker ends the run.
        armed = checkpoint_every is not None
        recovery = hf.Recovery([fused], restore, retries=1 if armed else 0)
        if armed:
            actor.save_checkpoint(path, 0)  # something to restore before the first save

        drill_pending = kill_worker_at is not None

        def one_step(step: int, prompts: hf.DataProto) -> dict[str, float]:
            """The whole dataflow of one step, and its checkpoint: what a retry runs again."""
            nonlocal drill_pending
            batch = actor.generate_sequences(prompts)
            batch = actor.compute_log_prob(batch)
            batch = actor.compute_ref_log_prob(batch)
            batch = reward.compute_reward(batch)
            batch = reward.compute_advantage(batch)
            reward_stats = reward.reward_metrics(batch)  # futures, one per rank
            if drill_pending and step == kill_worker_at:
                drill_pending = False  # once: the retried step runs whole
                logger.warning(
                    "fault drill: step %d: SIGKILL to rank %d (pid %d)", step, victim, victim_pid
                )
                os.kill(cast(int, victim_pid), signal.SIGKILL)  # set: a drill is pending
            actor_stats = actor.update_actor(batch)  # blocks: the step is done
            stats = _reduce(hf.get(reward_stats), actor_stats)
            if checkpoint_every is not None and step % checkpoint_every == 0:
                actor.save_checkpoint(path, step)
            return stats

        for step in range(1, steps + 1):
            start = time.perf_counter()
            prompts = task.sample_prompts(config.prompts_per_step, prompt_gen)
            prompts = prompts.repeat(config.samples_per_prompt, interleave=True)
            stats = recovery.run(functools.partial(one_step, step, prompts), step=step)
            record = {"step": step, **stats}
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
        "recoveries": [
            {"step": r.step, "ranks": r.ranks[fused.name_prefix], "seconds": r.seconds}
            for r in recovery.records
        ],
        "config": {
            **config.to_dict(),
            "steps": steps,
            "world_size": world_size,
            "checkpoint_every": checkpoint_every,
            "kill_worker_at": kill_worker_at,
        },
        "initial_checksum": initial_checksum,
        "param_checksums": checksums,
    }


def _drill_target(actor: hf.WorkerGroup, rank: int) -> int:
    """The pid of ``rank``'s process, checked to be on this machine (a pid is per host)."""
    hosts = actor.hostname()
    if hosts[rank] != socket.gethostname():
        raise RuntimeError(
            f"the fault drill kills rank {rank} by its pid, but it runs on {hosts[rank]!r}, "
            f"not on this machine ({socket.gethostname()!r}); run the drill on a local cluster"
        )
    pid = actor.pid()[rank]
    if pid == os.getpid():
        raise UnsuitableBackendError(
            f"the fault drill kills rank {rank}'s process, which is this driver's (backend "
            f"{actor.backend.name!r} runs ranks in the driver): use a backend with worker "
            "processes, such as dask or ray"
        )
    return pid


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
