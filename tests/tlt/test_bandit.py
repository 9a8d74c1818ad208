"""BEG-MAB: tries every arm per bucket, exploits the best throughput, keeps buckets apart."""

import pytest

from workers.tlt.rollout.bandit import BucketedBandit

ARMS = ["off", "ngram", "d4k1v4", "d5k3v16"]
RATE = {"off": 10.0, "ngram": 12.0, "d4k1v4": 30.0, "d5k3v16": 20.0}  # tokens per second, one token per pass


def _run(bandit, batch, steps, rate=RATE):
    chosen = []
    for _ in range(steps):
        arm = bandit.select(batch)
        bandit.update(batch, arm, tokens=1, seconds=1 / rate[arm])
        chosen.append(arm)
    return chosen


def test_it_tries_every_arm_once_before_exploiting():
    chosen = _run(BucketedBandit(ARMS, epsilon=0.0), batch=1, steps=len(ARMS))
    assert sorted(chosen) == sorted(ARMS)


def test_epsilon_zero_is_greedy_on_the_best_rate():
    bandit = BucketedBandit(ARMS, epsilon=0.0)
    chosen = _run(bandit, batch=1, steps=20)
    assert chosen[len(ARMS):] == ["d4k1v4"] * (20 - len(ARMS))


def test_it_converges_to_the_best_arm_while_exploring():
    bandit = BucketedBandit(ARMS, epsilon=0.2, seed=1)
    chosen = _run(bandit, batch=3, steps=400)
    counts = {a: chosen.count(a) for a in ARMS}
    assert max(counts, key=counts.get) == "d4k1v4"
    assert all(counts[a] >= 5 for a in ARMS)  # epsilon keeps exploring every arm
    assert 0.75 < counts["d4k1v4"] / 400 < 0.95


def test_the_rate_is_throughput_so_skewed_acceptance_counts_in_full():
    """An SD arm whose passes keep 1, 1 and 7 tokens (3 per pass on average, median 1) at 0.05 s a pass
    decodes 60 tokens/s; plain decoding's 1 token per 0.03 s is 33: SD must win, though its median
    per-pass rate (20/s) is below plain decoding's."""
    bandit = BucketedBandit(["off", "sd"], epsilon=0.0)
    for tokens in (1, 1, 7):
        bandit.update(1, "sd", tokens, 0.05)
    for _ in range(3):
        bandit.update(1, "off", 1, 0.03)
    assert bandit.select(1) == "sd"
    assert bandit.rates()["1"] == pytest.approx({"sd": 60.0, "off": 1 / 0.03})


def test_the_window_forgets_old_passes():
    bandit = BucketedBandit(["a", "b"], epsilon=0.0, window=3)
    for _ in range(3):
        bandit.update(1, "a", 1, 1.0)
    bandit.update(1, "b", 2, 1.0)
    assert bandit.select(1) == "b"
    for _ in range(3):
        bandit.update(1, "a", 5, 1.0)  # the window drops the old passes
    assert bandit.select(1) == "a"


def test_buckets_learn_separately_and_have_readable_labels():
    bandit = BucketedBandit(ARMS, buckets=[1, 4, 20], epsilon=0.0)
    _run(bandit, batch=1, steps=10)
    _run(bandit, batch=16, steps=10, rate={**RATE, "off": 50.0})  # at batch 16 SD does not pay
    assert bandit.best(1) == "d4k1v4"
    assert bandit.best(16) == "off"
    assert bandit.best(3) == "off"  # bucket 2-4 has no passes yet: ties go to the first arm
    assert [bandit.label(bandit.bucket(b)) for b in (1, 2, 4, 5, 20, 21, 500)] == ["1", "2-4", "2-4", "5-20", "5-20",
                                                                                     "21+", "21+"]
    assert set(bandit.rates()) == {"1", "5-20"}  # the buckets that have passes


def test_passes_on_more_threads_are_rated_apart():
    """On one core SD loses to plain decoding, on two it wins: each thread count learns its own best
    arm, and passes on one never decide for the other."""
    bandit = BucketedBandit(["off", "sd"], epsilon=0.0)
    one, two = {"off": 30.0, "sd": 25.0}, {"off": 40.0, "sd": 60.0}
    for _ in range(10):
        for threads, rate in ((1, one), (2, two)):
            arm = bandit.select(1, threads)
            bandit.update(1, arm, tokens=1, seconds=1 / rate[arm], threads=threads)
    assert bandit.best(1, threads=1) == "off" and bandit.best(1, threads=2) == "sd"
    rates = bandit.rates()
    assert set(rates) == {"1", "1 on 2 threads"}
    assert rates["1"] == pytest.approx(one) and rates["1 on 2 threads"] == pytest.approx(two)
