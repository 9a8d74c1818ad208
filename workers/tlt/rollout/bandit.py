"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit that picks the SD strategy per batch size.

    bandit = BucketedBandit(["off", "ngram", "d4k1v4", "d5k3v16"], buckets=[1, 4, 20], epsilon=0.1)
    arm = bandit.select(batch=3, threads=2)   # bucket "2-4", passes on 2 threads
    bandit.update(batch=3, arm=arm, tokens=emitted, seconds=pass_wall_clock, threads=2)

Buckets are upper batch sizes: [1, 4, 20] gives buckets 1, 2-4, 5-20 and 21+. Each bucket keeps,
per arm, a window of its latest passes (tokens emitted, wall-clock seconds including drafting).
`select` tries every arm of the bucket once, then explores a random arm with probability epsilon
and otherwise exploits the best rate (ties: the earlier arm).

A bucket is also per thread count: a CPU rollout worker decodes on one core until its peers lend
theirs (rollout_workers.py), and what a pass costs, so which arm wins, depends on the cores it runs
on (SmolLM2 on an AVX-512 EPYC: a 6-token verify pass costs 1.32 decode steps on one thread, 1.22 on
two; 1.64-1.83 on one before the few-row kernel prefetched its weights): rates measured on one core
must not decide for passes on two.

An arm's rate is its throughput over the window: tokens summed over seconds summed. The paper
ranks arms by the median of per-pass rates, which undercounts SD: the tokens a pass accepts are
skewed (many passes keep one or two drafted tokens, a few keep the whole chain), so the median pass
is below the mean while plain decoding emits exactly one token per pass. Measured on SmolLM2 at
batch 1 and T = 0.7, the median ranked arms 15-45% below their throughput and left SD off for
most of the tail (bench e2e's `spec/strategy`) where the best arm decoded 1.3-1.6x faster.

The state lives across rollouts, so one bandit per rollout worker learns over the whole run.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from typing import Sequence


class BucketedBandit:
    def __init__(self, arms: Sequence[str], buckets: Sequence[int] = (1, 4, 20), *, epsilon: float = 0.1,
                 window: int = 16, seed: int = 0):
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("buckets must be strictly increasing")
        self.arms = list(arms)
        self.buckets = list(buckets)
        self.epsilon = epsilon
        self.window = window
        self.rng = random.Random(seed)
        # per (bucket, threads) and arm: the latest passes as (tokens, seconds)
        self.passes: dict[tuple[int, int], dict[str, deque[tuple[float, float]]]] = {}

    def bucket(self, batch: int) -> int:
        """Index of the bucket holding this batch size (the last bucket is open-ended)."""
        return bisect.bisect_left(self.buckets, batch)

    def window_of(self, batch: int, threads: int = 1) -> dict[str, deque[tuple[float, float]]]:
        """The latest passes per arm at this batch size's bucket on this many threads."""
        key = (self.bucket(batch), threads)
        if key not in self.passes:
            self.passes[key] = {a: deque(maxlen=self.window) for a in self.arms}
        return self.passes[key]

    def label(self, bucket: int) -> str:
        lo = 1 if bucket == 0 else self.buckets[bucket - 1] + 1
        if bucket == len(self.buckets):
            return f"{lo}+"
        hi = self.buckets[bucket]
        return str(hi) if lo == hi else f"{lo}-{hi}"

    def select(self, batch: int, threads: int = 1) -> str:
        passes = self.window_of(batch, threads)
        for arm in self.arms:
            if not passes[arm]:
                return arm  # every arm is tried once per bucket before anything else
        if self.epsilon > 0 and self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return self.best(batch, threads)

    def best(self, batch: int, threads: int = 1) -> str:
        """The arm with the best rate in the batch's bucket on these threads (untried arms rank last)."""
        passes = self.window_of(batch, threads)
        return max(self.arms, key=lambda a: (len(passes[a]) > 0, _rate(passes[a]), -self.arms.index(a)))

    def update(self, batch: int, arm: str, tokens: float, seconds: float, threads: int = 1) -> None:
        self.window_of(batch, threads)[arm].append((float(tokens), float(seconds)))

    def rates(self) -> dict[str, dict[str, float]]:
        """{bucket label: {arm: tokens per second over its window}} for the arms that have passes; a
        bucket's passes on more than one thread are labelled "<bucket> on <threads> threads"."""
        out = {}
        for (b, threads), arms in sorted(self.passes.items()):
            label = self.label(b) if threads == 1 else f"{self.label(b)} on {threads} threads"
            if rates := {a: _rate(p) for a, p in arms.items() if p}:
                out[label] = rates
        return out


def _rate(passes: deque[tuple[float, float]]) -> float:
    seconds = sum(s for _, s in passes)
    return sum(t for t, _ in passes) / seconds if seconds > 0 else 0.0
