"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit that picks the SD strategy per batch size.

    bandit = BucketedBandit(["off", "ngram", "d4k1v4", "d5k3v16"], buckets=[1, 4, 20], epsilon=0.1)
    arm = bandit.select(batch=3)          # bucket "2-4"
    bandit.update(batch=3, arm=arm, tokens=emitted, seconds=pass_wall_clock)

Buckets are upper batch sizes: [1, 4, 20] gives buckets 1, 2-4, 5-20 and 21+. Each bucket keeps,
per arm, a window of its latest passes (tokens emitted, wall-clock seconds including drafting).
`select` tries every arm of the bucket once, then explores a random arm with probability epsilon
and otherwise exploits the best rate (ties: the earlier arm).

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
        n = len(self.buckets) + 1
        # per bucket and arm: the latest passes as (tokens, seconds)
        self.passes: list[dict[str, deque[tuple[float, float]]]] = [
            {a: deque(maxlen=window) for a in self.arms} for _ in range(n)]

    def bucket(self, batch: int) -> int:
        """Index of the bucket holding this batch size (the last bucket is open-ended)."""
        return bisect.bisect_left(self.buckets, batch)

    def label(self, bucket: int) -> str:
        lo = 1 if bucket == 0 else self.buckets[bucket - 1] + 1
        if bucket == len(self.buckets):
            return f"{lo}+"
        hi = self.buckets[bucket]
        return str(hi) if lo == hi else f"{lo}-{hi}"

    def select(self, batch: int) -> str:
        passes = self.passes[self.bucket(batch)]
        for arm in self.arms:
            if not passes[arm]:
                return arm  # every arm is tried once per bucket before anything else
        if self.epsilon > 0 and self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return self.best(batch)

    def best(self, batch: int) -> str:
        """The arm with the best rate in the batch's bucket (untried arms rank last)."""
        passes = self.passes[self.bucket(batch)]
        return max(self.arms, key=lambda a: (len(passes[a]) > 0, _rate(passes[a]), -self.arms.index(a)))

    def update(self, batch: int, arm: str, tokens: float, seconds: float) -> None:
        self.passes[self.bucket(batch)][arm].append((float(tokens), float(seconds)))

    def rates(self) -> dict[str, dict[str, float]]:
        """{bucket label: {arm: tokens per second over its window}} for the arms that have passes."""
        return {self.label(b): {a: _rate(p) for a, p in arms.items() if p} for b, arms in enumerate(self.passes)}


def _rate(passes: deque[tuple[float, float]]) -> float:
    seconds = sum(s for _, s in passes)
    return sum(t for t, _ in passes) / seconds if seconds > 0 else 0.0
