"""Every knob of the demo in one frozen dataclass, shipped to the workers as-is."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GRPOConfig"]


@dataclass(frozen=True)
class GRPOConfig:
    """Task, policy and GRPO hyper-parameters.

    The defaults are tuned so the policy learns the reverse task surely within 60 steps
    (reward from about 0.12 to above 0.85 across seeds) while a step stays well under a
    second on two CPU cores.
    """

    seed: int = 0
    # task
    num_symbols: int = 8
    prompt_len: int = 6
    # policy
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 1
    # GRPO
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    lr: float = 3e-3
    clip_ratio: float = 0.2
    kl_coef: float = 0.001
    ppo_epochs: int = 1
    ppo_mini_batches: int = 2
    max_grad_norm: float = 1.0
    adv_eps: float = 1e-6
    # torch.distributed
    dist_timeout_s: float = 60.0
    # where the policy lives on each rank: "cpu" (gloo), or "cuda" (the rank's own GPU,
    # cuda:LOCAL_RANK, NCCL; one rank per GPU). Batches travel between roles on the CPU.
    device: str = "cpu"

    def validate(self, world_size: int) -> None:
        """Reject settings that would split a GRPO group across ranks or leave a rank idle."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.prompts_per_step % world_size:
            raise ValueError(
                f"prompts_per_step={self.prompts_per_step} must be divisible by the "
                f"{world_size} ranks, so every rank gets whole groups of samples"
            )
        if self.samples_per_prompt < 2:
            raise ValueError("GRPO needs samples_per_prompt >= 2 to compare samples in a group")
        rows_per_rank = self.prompts_per_step * self.samples_per_prompt // world_size
        if rows_per_rank % self.ppo_mini_batches:
            raise ValueError(
                f"{rows_per_rank} rows per rank do not split into "
                f"{self.ppo_mini_batches} mini-batches"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
