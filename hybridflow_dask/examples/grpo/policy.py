"""A tiny causal transformer: the "LLM" of the demo.

One or two attention layers over ``prompt + separator + response`` with learned position
embeddings: enough to learn the reverse task, small enough (a few thousand to tens of
thousands of parameters) that sampling and a PPO update take milliseconds on one CPU
core. Sampling is autoregressive without a KV cache; at these lengths recomputing the
whole prefix is cheaper than managing one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyCausalLM", "response_log_probs", "sample_responses"]


class TinyCausalLM(nn.Module):
    """Token + position embeddings, ``num_layers`` pre-norm transformer blocks, a linear head."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int = 32,
        num_heads: int = 2,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=4 * d_model,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[batch, length, vocab]`` for every prefix of ``tokens``."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        # Built per call rather than kept as a buffer: a model without buffers gives DDP
        # nothing to broadcast on every forward.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


def response_log_probs(
    model: nn.Module, context: torch.Tensor, responses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``responses`` after ``context``, and the per-token entropy.

    Both are ``[batch, response_len]``. ``context`` is the prompt plus separator.
    """
    tokens = torch.cat([context, responses[:, :-1]], dim=1)
    logits = model(tokens)[:, context.shape[1] - 1 :]
    log_probs = F.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    context: torch.Tensor,
    length: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Sample ``length`` tokens after ``context`` (the sampling distribution is the model's)."""
    tokens = context
    for _ in range(length):
        logits = model(tokens)[:, -1] / temperature
        probs = torch.softmax(logits, dim=-1)
        # drawn where the generator lives (the CPU), so a GPU run samples as a CPU run does
        nxt = torch.multinomial(probs.to(generator.device), 1, generator=generator)
        tokens = torch.cat([tokens, nxt.to(tokens.device)], dim=1)
    return tokens[:, context.shape[1] :]
