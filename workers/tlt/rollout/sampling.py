"""Sampling: the processed distribution, keyed randomness, and the log-probs the learner scores.

    params = SamplingParams(temperature=0.7, top_p=0.9)
    probs = process(logits, params)            # [..., V] float32, temperature/top-k/top-p applied
    u = uniforms(keys, positions)              # [B, J] one uniform per (sample, sequence position)
    tokens = sample(probs, u)                  # inverse CDF: the token whose CDF interval holds u
    tokens = pick(logits, params, u)           # argmax when greedy, else sample(process(...), u)
    lp = token_logprobs(logits, tokens, params)  # what the learner scores: same processed distribution

Keyed randomness. The token at position t of sample s is F_p^{-1}(u(s, t)): the inverse CDF (in
token-id order) of the processed distribution p at one uniform that depends only on the sample's key
and the position. Whatever computes p (a plain decode step, a speculative verify pass over a draft
tree, another batch composition) then emits the same token, so:

- speculative decoding is lossless token for token under sampling, not only in distribution: a
  draft is accepted iff it equals the token plain decoding would have drawn (speculative.walk), and
  the drafter draws its chain with the same u (F_q^{-1}(u) for its own q), so a drafter close to
  the target agrees with it most of the time;
- a run samples the same responses with TLT on and off, whatever arm the bandit picks (up to float
  rounding of p between kernels, which moves a token only when u lands within ~1e-7 of an interval
  edge).
Each (sample, position) uniform decides exactly one emitted token and is independent of everything
that decided p, so every emitted token has law exactly p. Inverse-CDF sampling also costs one
cumulative sum per row (~40 us for 49k tokens on one core) where an exponential race over the
vocabulary costs ~1.3 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p
    top_k: int = 0  # keep the k most likely tokens (0: all)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_params(rollout) -> SamplingParams:
    """The run's sampling parameters from its config.RolloutSection (any object with its fields)."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)


def processed_logits(logits: Tensor, params: SamplingParams, keep: Tensor | None = None) -> Tensor:
    """Logits [..., V] -> float32 logits of the distribution sampling draws from: divided by the
    temperature, -inf outside the top-k / top-p set. Greedy rollouts are scored at temperature 1
    (a one-hot distribution has no gradient), so greedy returns the raw logits.

    keep [...]: token ids that stay in the support whatever the truncation says (the learner passes
    the sampled tokens: its logits may round a sampled token just outside the nucleus).
    """
    x = logits.float()
    if params.greedy:
        return x
    if params.temperature != 1.0:
        x = x / params.temperature
    drop = None
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        drop = x < kth
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first one stays)
        nucleus_drop = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) >= params.top_p)
        drop = nucleus_drop if drop is None else drop | nucleus_drop
    if drop is None:
        return x
    if keep is not None:
        drop = drop.scatter(-1, keep[..., None], False)
    return x.masked_fill(drop, float("-inf"))


def process(logits: Tensor, params: SamplingParams) -> Tensor:
    """Logits [..., V] -> the distribution plain sampling draws from (float32, sums to 1)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return processed_logits(logits, params).softmax(-1)


def token_logprobs(logits: Tensor, tokens: Tensor, params: SamplingParams) -> Tensor:
    """log p(tokens) under the processed distribution: logits [..., V], tokens [...] -> [...] float32.

    The one definition of "the log-prob of a sampled token" shared by the rollout engine (which
    records it) and the learner (which differentiates it), so their mismatch measures the engines'
    numerics only.
    """
    z = processed_logits(logits, params, keep=tokens)
    return z.gather(-1, tokens[..., None])[..., 0] - torch.logsumexp(z, dim=-1)


def _splitmix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 tensors (two's-complement wrap-around is the intent)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15
    x = x ^ ((x >> 30) & ((1 << 34) - 1))  # logical shifts: mask the sign bits an arithmetic shift drags in
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def sample_keys(seed: int, count: int, device=None) -> Tensor:
    """[count] int64 keys of samples 0..count-1 of a generate() call with this seed."""
    seed &= _MASK64
    base = int(_splitmix64(torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed], dtype=torch.int64)))
    return _splitmix64(torch.arange(count, dtype=torch.int64) + base).to(device)


def uniforms(keys: Tensor, positions: Tensor) -> Tensor:
    """u(key, position) in [0, 1): keys [B] int64, positions [B, J] int64 -> [B, J] float64."""
    x = _splitmix64(keys[:, None] ^ _splitmix64(positions.to(torch.int64)))
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw per row of probs [..., V] at u [...] in [0, 1): the first token whose
    cumulative mass exceeds u * total (token-id order; zero-mass tokens are never drawn)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf, target, right=True)[..., 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


def pick(logits: Tensor, params: SamplingParams, u: Tensor | None) -> Tensor:
    """The next token for each row of logits [..., V]: argmax when greedy, else sample(process(...), u)."""
    if params.greedy:
        return logits.argmax(-1)
    if u is None:
        raise ValueError("sampling needs uniforms (see uniforms())")
    return sample(process(logits, params), u)
