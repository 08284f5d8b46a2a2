"""The toy task: reverse a short string of symbols.

A prompt is ``prompt_len`` symbols drawn from ``num_symbols``; the right response is the
same symbols in reverse order. The reward is the fraction of response positions that
match, so a random policy scores about ``1 / num_symbols`` and a perfect one scores 1.
Partial credit gives GRPO a dense signal inside each group of samples, which is why a
policy of a few thousand parameters learns it within a minute or two on a CPU.

Token ids: symbols are ``0 .. num_symbols - 1``; ``num_symbols`` is the separator that
ends the prompt, so the policy's vocabulary is ``num_symbols + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridflow_dask import DataProto

__all__ = ["ReverseTask"]


@dataclass(frozen=True)
class ReverseTask:
    """Prompts, the separator token and the reward of the reverse-the-prompt task."""

    num_symbols: int = 6
    prompt_len: int = 5

    @property
    def response_len(self) -> int:
        return self.prompt_len

    @property
    def vocab_size(self) -> int:
        """Symbols plus the separator."""
        return self.num_symbols + 1

    @property
    def sep_token(self) -> int:
        return self.num_symbols

    @property
    def seq_len(self) -> int:
        """Prompt, separator, response."""
        return self.prompt_len + 1 + self.response_len

    def sample_prompts(self, batch_size: int, generator: torch.Generator) -> DataProto:
        """``batch_size`` random prompts, each with a unique ``uid`` (GRPO's group key)."""
        prompts = torch.randint(
            0, self.num_symbols, (batch_size, self.prompt_len), generator=generator
        )
        uids = np.array(
            [f"p{int(x)}" for x in torch.randint(0, 2**62, (batch_size,), generator=generator)],
            dtype=object,
        )
        return DataProto.from_dict({"prompts": prompts}, {"uid": uids})

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of response positions equal to the reversed prompt, one float per row."""
        target = torch.flip(prompts, dims=[1])
        return (responses == target).float().mean(dim=1)
