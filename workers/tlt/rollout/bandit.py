"""BEG-MAB: a bucketed epsilon-greedy multi-armed bandit that picks the SD strategy per batch size.

    bandit = BucketedBandit(["off", "ngram", "d4k1v4", "d5k3v16"], buckets=[1, 4, 20], epsilon=0.1)
    arm = bandit.select(batch=3)          # bucket "2-4"
    bandit.update(batch=3, arm=arm, reward=tokens / seconds)

Buckets are upper batch sizes: [1, 4, 20] gives buckets 1, 2-4, 5-20 and 21+. Each bucket keeps,
per arm, a window of the latest rewards (accepted tokens per second, wall clock per verify pass
including drafting). `select` tries every arm of the bucket once, then explores a random arm with
probability epsilon and otherwise exploits the best median (ties: the earlier arm). The state lives
across rollouts, so one bandit per rollout worker learns over the whole run.
"""

from __future__ import annotations

import bisect
import random
import statistics
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
        self.rewards: list[dict[str, deque[float]]] = [{a: deque(maxlen=window) for a in self.arms} for _ in range(n)]

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
        rewards = self.rewards[self.bucket(batch)]
        for arm in self.arms:
            if not rewards[arm]:
                return arm  # every arm is tried once per bucket before anything else
        if self.epsilon > 0 and self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return self.best(batch)

    def best(self, batch: int) -> str:
        """The arm with the best median reward in the batch's bucket (untried arms rank last)."""
        rewards = self.rewards[self.bucket(batch)]
        return max(self.arms, key=lambda a: (len(rewards[a]) > 0, statistics.median(rewards[a]) if rewards[a] else 0.0,
                                              -self.arms.index(a)))

    def update(self, batch: int, arm: str, reward: float) -> None:
        self.rewards[self.bucket(batch)][arm].append(float(reward))

    def medians(self) -> dict[str, dict[str, float]]:
        """{bucket label: {arm: median reward}} for the arms that have rewards."""
        return {self.label(b): {a: statistics.median(r) for a, r in arms.items() if r}
                for b, arms in enumerate(self.rewards)}
