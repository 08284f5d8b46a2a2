"""The two roles of the demo, written as verl writes its workers.

``ActorRolloutRefWorker`` fuses what verl's ``actor_rollout_ref`` role does: sample
responses (rollout), recompute log-probs under the current policy (old) and under the
frozen initial policy (reference), and run the PPO-clip update. Its gradients are averaged
across ranks by ``DistributedDataParallel`` over gloo (NCCL when ``config.device`` is
``"cuda"``: the policy then lives on the rank's GPU), so every rank keeps identical
weights. ``RewardWorker`` scores responses and turns scores into group-relative (GRPO)
advantages. Both roles are fused into one object per rank with
``create_colocated_worker_cls``, so a batch shard never leaves its process between them.

The torch process group is not joined in ``__init__`` but by ``join_process_group``,
which the driver calls on every rank: a rank that ``WorkerGroup.recover()`` rebuilds runs
``__init__`` again on its own, and must not sit in a rendezvous the survivors are not in.
After a recovery the driver calls it again with the next ``generation`` (a fresh key
space in the rendezvous store), then ``load_checkpoint`` on every rank.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hybridflow_dask as hf
from hybridflow_dask import DataProto, Dispatch, register

from .config import GRPOConfig
from .policy import TinyCausalLM, response_log_probs, sample_responses
from .task import ReverseTask

__all__ = ["ActorRolloutRefWorker", "RewardWorker", "group_relative_advantages"]

logger = logging.getLogger(__name__)


def _with_columns(data: DataProto, **tensors: torch.Tensor) -> DataProto:
    """A new DataProto with ``tensors`` added; ``data`` (maybe a cached future result) is kept."""
    return copy.copy(data).union(DataProto.from_dict(tensors))


def make_task(config: GRPOConfig) -> ReverseTask:
    return ReverseTask(num_symbols=config.num_symbols, prompt_len=config.prompt_len)


def rank_device(config: GRPOConfig) -> torch.device:
    """The CPU, or the rank's own GPU: ``cuda:LOCAL_RANK`` (the rank env lists its node's
    GPUs in local-rank order in ``CUDA_VISIBLE_DEVICES``)."""
    if config.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


class ActorRolloutRefWorker(hf.Worker):
    """Policy, reference policy and optimizer of one data-parallel rank.

    The only role in its process that joins a torch process group: the default process
    group is per process, and colocated roles share the process.
    """

    def __init__(self, config: GRPOConfig) -> None:
        super().__init__()
        torch.set_num_threads(1)  # one core per rank; more threads only contend
        self.config = config
        self.task = make_task(config)
        self.device = rank_device(config)
        torch.manual_seed(config.seed)  # every rank, first built or rebuilt, starts equal
        model = TinyCausalLM(
            self.task.vocab_size,
            self.task.seq_len,
            d_model=config.d_model,
            num_heads=config.num_heads,
            num_layers=config.num_layers,
        ).to(self.device)
        self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.policy = model
        self.ddp: DistributedDataParallel | None = None  # set by join_process_group
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.generator = torch.Generator().manual_seed(config.seed * 1_000_003 + self.rank)
        self.updates = 0
        self._store: dist.Store | None = None  # rank 0: the rendezvous server it hosts

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_process_group(self, generation: int = 0) -> int:
        """(Re)join the process group of all ranks (gloo; NCCL on GPUs); returns this rank.

        Every rank must be called together (one ``ONE_TO_ALL`` call). Each ``generation``
        rendezvouses under its own key prefix of the store, so keys left by an earlier
        generation (from a rank that has since died) are never read. Rank 0 hosts the
        store at ``MASTER_ADDR:MASTER_PORT`` and keeps it while its process lives; a rank
        0 rebuilt on a new process hosts a new one at the same port.
        """
        if dist.is_initialized():
            # A survivor's group has a dead peer, or a reused Dask worker still holds
            # the group of an earlier run that was not released: start over.
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=self.config.dist_timeout_s)
        if self.rank != 0 or self._store is None:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                self.world_size,
                is_master=self.rank == 0,
                timeout=timeout,
                wait_for_workers=False,
            )
        on_gpu = self.device.type == "cuda"
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            store=dist.PrefixStore(f"grpo/generation{generation}/", self._store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        # broadcasts rank 0's weights
        ids = [self.device.index] if on_gpu else None
        self.ddp = DistributedDataParallel(self.policy, device_ids=ids)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """The worker process's id (the fault drill kills it by this)."""
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hostname(self) -> str:
        """The worker's host: a pid means something only on the same machine."""
        return socket.gethostname()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int) -> int:
        """Rank 0 writes policy, optimizer and update count to ``path``; the others wait.

        The file is written next to ``path`` and renamed over it, so a process killed
        mid-write leaves the previous checkpoint whole. Every rank returns once the file
        is complete (a barrier), so the call finishing means the checkpoint is there.
        """
        if self.rank == 0:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.partial")
            state = {
                "step": step,
                "policy": self.policy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "updates": self.updates,
            }
            torch.save(state, partial)
            os.replace(partial, target)
        dist.barrier()
        return step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Every rank reloads policy and optimizer from ``path``; returns the saved step.

        Sampling is re-seeded from the saved step, so every rank, survivor or rebuilt,
        continues from a known state.
        """
        state = torch.load(path, weights_only=True, map_location=self.device)
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        step = int(state["step"])
        self.generator.manual_seed((self.config.seed * 1_000_003 + self.rank) * 10_007 + step)
        return step

    def _context(self, data: DataProto) -> torch.Tensor:
        prompts = data.batch["prompts"]
        sep = torch.full((prompts.shape[0], 1), self.task.sep_token, dtype=prompts.dtype)
        return torch.cat([prompts, sep], dim=1).to(self.device)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample one response per row (rows of a group are the same prompt, repeated)."""
        self.policy.eval()
        responses = sample_responses(
            self.policy, self._context(prompts), self.task.response_len, self.generator
        )
        return _with_columns(prompts, responses=responses.cpu())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs of the responses under the policy that sampled them (PPO's "old")."""
        self.policy.eval()
        with torch.no_grad():
            log_probs, _ = response_log_probs(
                self.policy, self._context(data), data.batch["responses"].to(self.device)
            )
        return _with_columns(data, old_log_probs=log_probs.cpu())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Log-probs under the frozen initial policy, for the KL penalty."""
        with torch.no_grad():
            log_probs, _ = response_log_probs(
                self.ref, self._context(data), data.batch["responses"].to(self.device)
            )
        return _with_columns(data, ref_log_prob=log_probs.cpu())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO-clip with a k3 KL penalty to the reference; gradients all-reduced by DDP.

        Every rank must see the same number of mini-batches (one all-reduce each), which
        ``GRPOConfig.validate`` guarantees by requiring equal, evenly divisible shards.
        """
        cfg = self.config
        ddp = self.ddp
        if ddp is None:
            raise RuntimeError("update_actor before join_process_group: the ranks have no group")
        self.policy.train()
        context = self._context(data)
        batch = data.batch
        responses = batch["responses"].to(self.device)
        old = batch["old_log_probs"].to(self.device)
        ref = batch["ref_log_prob"].to(self.device)
        advantages = batch["advantages"].unsqueeze(1).to(self.device)
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0}
        sums["grad_norm"] = 0.0
        passes = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(data), generator=self.generator).to(self.device)
            for rows in order.chunk(cfg.ppo_mini_batches):
                log_probs, entropy = response_log_probs(ddp, context[rows], responses[rows])
                ratio = torch.exp(log_probs - old[rows])
                adv = advantages[rows]
                clipped = ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
                pg_loss = -torch.min(ratio * adv, clipped * adv).mean()
                log_ratio_ref = ref[rows] - log_probs
                kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1).mean()
                loss = pg_loss + cfg.kl_coef * kl
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages the gradients over the ranks here
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    self.policy.parameters(), cfg.max_grad_norm
                )
                self.optimizer.step()
                passes += 1
                sums["loss"] += loss.item()
                sums["pg_loss"] += pg_loss.item()
                sums["kl"] += kl.item()
                sums["clip_frac"] += ((ratio - clipped).abs() > 0).float().mean().item()
                sums["entropy"] += entropy.mean().item()
                sums["grad_norm"] += float(grad_norm)
        self.updates += 1
        return {key: value / passes for key, value in sums.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def param_checksum(self) -> str:
        """SHA-256 of the policy weights: equal on every rank iff the update stayed in sync."""
        digest = hashlib.sha256()
        for param in self.policy.parameters():
            digest.update(param.detach().contiguous().cpu().numpy().tobytes())
        return digest.hexdigest()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release(self) -> None:
        """Leave the process group, so the Dask worker can host a later run's group."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.ddp = None
        self._store = None  # rank 0: closes the rendezvous server


def group_relative_advantages(
    scores: torch.Tensor, uids: np.ndarray, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, over the group's standard deviation.

    Every group must be whole in ``scores``: a group cut by a rank boundary would be
    normalized by the wrong statistics, so it is an error rather than a silent bias.
    """
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    advantages = torch.empty_like(scores)
    for uid, rows in groups.items():
        if len(rows) != group_size:
            raise ValueError(
                f"group {uid!r} has {len(rows)} of its {group_size} samples in this shard; "
                "send whole groups to each rank (prompts per step divisible by world size)"
            )
        index = torch.tensor(rows)
        group = scores[index]
        advantages[index] = (group - group.mean()) / (group.std() + eps)
    return advantages


class RewardWorker(hf.Worker):
    """Scores responses with the task's rule and normalizes them within each group."""

    def __init__(self, config: GRPOConfig) -> None:
        super().__init__()
        self.config = config
        self.task = make_task(config)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_reward(self, data: DataProto) -> DataProto:
        scores = self.task.reward(data.batch["prompts"], data.batch["responses"])
        return _with_columns(data, scores=scores)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_advantage(self, data: DataProto) -> DataProto:
        advantages = group_relative_advantages(
            data.batch["scores"],
            data.non_tensor_batch["uid"],
            self.config.samples_per_prompt,
            self.config.adv_eps,
        )
        return _with_columns(data, advantages=advantages)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC, blocking=False)
    def reward_metrics(self, data: DataProto) -> dict[str, float]:
        """Sums, not means, so the driver can weight ranks by their row counts."""
        scores = data.batch["scores"]
        return {
            "rows": float(len(scores)),
            "reward_sum": float(scores.sum()),
            "solved_sum": float((scores == 1.0).sum()),
        }
