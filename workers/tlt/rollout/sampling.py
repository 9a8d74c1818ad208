"""Sampling: the processed distribution, keyed randomness, and the log-probs the learner scores.

    params = SamplingParams(temperature=0.7, top_p=0.9)
    probs = process(logits, params)            # [..., V] float32, temperature/top-k/top-p applied
    tokens = draw(probs, keys, positions)      # the keyed draw: an exponential race (below)
    lp = token_logprobs(logits, tokens, params)  # what the learner scores: same processed distribution

Keyed randomness. The token at position t of sample s is decided by randomness that depends only on
the sample's key and t, never on what computed p (a plain decode step, a speculative verify pass
over a draft tree, another batch composition). So:

- speculative decoding is lossless token for token under sampling, not only in distribution: a
  draft is accepted iff it equals the token plain decoding would have drawn (speculative.walk), and
  the drafter draws its proposals with the same randomness from its own q, so a drafter close to
  the target agrees with it most of the time;
- a run samples the same responses with TLT on and off, whatever arm the bandit picks (up to float
  rounding of p between kernels, which moves a token only when two racers finish within ~1e-7).

The draw is an exponential race (Gumbel-max): token x finishes at E(s, t, x) / p_x with E ~ Exp(1)
hashed from (key, position, token id), and the first to finish is drawn, which happens with
probability exactly p_x. Only the RACE_TOKENS likeliest tokens race one by one; all the others race
as one block at their total mass, and if the block wins, the token inside it is the inverse-CDF draw
(`sample`, token-id order) at one more keyed uniform: still exactly p. Each token's noise is the
same for the drafter's q and the target's p, so their draws agree where both put a token first. The
inverse CDF alone, the rule until e070cd7, lines their intervals up in token-id order, where every
token between two likely ones shifts them apart: on the preset's held-out answers the drafter's
first draft token agreed with the target's on 0.740 of positions under the race against 0.713 under
the inverse CDF (a Gumbel race over the whole vocabulary: 0.745; README "Coupling headroom"). Its
cost is a top-k over the vocabulary: 0.35 against 0.07 ms for one row on one EPYC core, but less
than the inverse CDF's float64 cumulative sum from about six rows on (4.5 against 6.3 ms at 16).
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


def _stream(keys: Tensor, positions: Tensor) -> Tensor:
    """The hash of each (key, position): keys [B] int64, positions [B, ...] -> [B, ...] int64."""
    return _splitmix64(keys.view(-1, *[1] * (positions.dim() - 1)) ^ _splitmix64(positions.to(torch.int64)))


def _unit(x: Tensor) -> Tensor:
    """int64 hashes -> float64 uniforms in [0, 1) from their top 53 bits."""
    return ((x >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def _keyed(stream: Tensor, ids: Tensor | int) -> Tensor:
    """The uniform of each (key, position) stream [...] and token id ids [..., K] (or one int) -> [..., K]."""
    ids = torch.as_tensor(ids, dtype=torch.int64, device=stream.device)
    return _unit(_splitmix64(stream[..., None] ^ _splitmix64(ids)))


# racers one by one: the likeliest tokens of a distribution (the rest race as one block). With 32, the
# block wins on 0.26% of draws at the preset's T = 0.7 (`bench coupling`'s race_block_mass, 2026-12-07)
RACE_TOKENS = 32
_BLOCK, _BLOCK_DRAW = -1, -2  # the ids the block's noise and its inverse-CDF uniform are keyed by


def draw(probs: Tensor, keys: Tensor, positions: Tensor, ids: Tensor | None = None, places: int = 1) -> Tensor:
    """The keyed draw from each distribution probs [B, ..., V] (module doc): keys [B] int64, positions
    [B, ...] (probs' shape without V) -> [B, ...] indices into probs' last dimension.

    ids [V]: the token id of each entry of the last dimension, when probs covers only part of the
    vocabulary (a drafter's reduced draft vocabulary; entries outside it have q = 0): the noise is
    keyed by token id, so a subset distribution races with the same noise as the full one.
    places > 1: [B, ..., places], the draw and then the next racers to finish, in order (racers one
    by one only, at most RACE_TOKENS): where the draw misses another distribution's, that one's
    draw is most often the runner-up, since both raced with the same noise.
    """
    if positions.shape != probs.shape[:-1] or keys.shape != positions.shape[:1]:
        raise ValueError(f"draw: probs {tuple(probs.shape)} needs positions {tuple(probs.shape[:-1])} and keys "
                         f"{tuple(probs.shape[:1])}, not {tuple(positions.shape)} and {tuple(keys.shape)}")
    K = min(RACE_TOKENS, probs.shape[-1])
    head, idx = probs.topk(K, dim=-1)  # [..., K]
    stream = _stream(keys, positions)
    finish = torch.where(head > 0, -torch.log1p(-_keyed(stream, idx if ids is None else ids[idx])) / head.double(),
                         torch.inf)
    first, at = finish.topk(min(places, K), dim=-1, largest=False)  # [..., places]
    order = idx.gather(-1, at)
    tok = order[..., 0].clone()
    rest = (probs.sum(-1, dtype=torch.float64) - head.sum(-1, dtype=torch.float64)).clamp(min=0)
    block = -torch.log1p(-_keyed(stream, _BLOCK)[..., 0]) / rest  # inf where nothing is left outside the head
    wins = block < first[..., 0]
    if bool(wins.any()):
        outside = probs[wins].scatter(-1, idx[wins], 0.0)
        inside = sample(outside, _keyed(stream[wins], _BLOCK_DRAW)[..., 0])
        # a block whose mass was float rounding (every token outside the head at zero) keeps the head's winner
        tok[wins] = torch.where(outside.sum(-1) > 0, inside, tok[wins])
    if places == 1:
        return tok
    runners = torch.where(wins[..., None], order[..., :-1], order[..., 1:])  # behind a block win: the head's first
    return torch.cat([tok[..., None], runners], -1)


def sample(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw per row of probs [..., V] at u [...] in [0, 1): the first token whose
    cumulative mass exceeds u * total (token-id order; zero-mass tokens are never drawn)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf, target, right=True)[..., 0]
    return idx.clamp_(max=probs.shape[-1] - 1)
