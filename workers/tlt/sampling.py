"""Sampling parameters and the processed distribution every sampler and verifier uses.

    params = SamplingParams(temperature=0.7, top_p=0.9)
    probs = process(logits, params)          # [..., V] float32, temperature/top-k/top-p applied
    tokens = sample(probs, generator)        # one draw per row
    tokens = pick(logits, params, generator) # argmax when greedy, else sample(process(...))

Speculative verification compares *processed* distributions (target p, drafter q), so the tokens it
emits follow exactly the distribution plain sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0: all)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def process(logits: Tensor, params: SamplingParams) -> Tensor:
    """Logits [..., V] -> the distribution plain sampling draws from (float32, sums to 1)."""
    x = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    if params.temperature != 1.0:
        x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first one stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of probs [..., V] (exponential race: argmax p_i / E_i, E_i ~ Exp(1))."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_(min=1e-30)  # no 0/0
    return (probs / e).argmax(-1)


def pick(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """The next token for each row of logits [..., V]: argmax when greedy, else a draw."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(process(logits, params), generator)
