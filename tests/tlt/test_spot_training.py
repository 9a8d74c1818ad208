"""Spot drafter training: one drafter, whole updates only, rounds scheduled by the driver (spot.py)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from workers.tlt.cluster.spot import DrafterWatch, SpotRounds


def rounds_for(workers=3, data=("r",), steps=4) -> SpotRounds:
    return SpotRounds(workers, {"w": torch.zeros(3)}, list(data), seed=0, step=1, update_steps=steps)


def whole(job, loss=0.5):
    """What a member's spot_update returns for a whole update: the round's master + its steps."""
    return {"version": job["version"], "state": {"w": job["state"]["w"] + job["steps"]}, "steps": job["steps"],
            "loss": loss, "accuracy": 0.5, "interval": (0.0, 1.0)}


def dropped(job):
    return {"version": job["version"], "state": None, "steps": 0, "dropped": True, "interval": (0.0, 0.5)}


def test_idle_workers_form_a_round_and_the_master_averages_their_whole_updates():
    r = rounds_for()
    jobs = r.idle(0)
    assert [w for w, _ in jobs] == [0]
    assert r.idle(1) == []  # a round is open: worker 1 waits for the next one
    assert r.done(0, whole(jobs[0][1])) != []  # round 0 closes; 0 and 1 form round 1
    assert r.version == 1 and torch.equal(r.master["w"], torch.full((3,), 4.0))
    assert sorted(r.round.members) == [0, 1]


def test_slices_are_disjoint_within_a_round_and_rotate_across_rounds():
    r = rounds_for(workers=2, data=("r",))
    r.waiting = [0, 1]
    jobs = dict(r._maybe_open())
    assert {jobs[0]["slice"], jobs[1]["slice"]} == {(0, 2), (1, 2)}
    for w, job in jobs.items():
        nxt = r.done(w, whole(job))
    assert {j["slice"] for _, j in nxt} == {(1, 2), (0, 2)} and dict(nxt)[0]["slice"] == (1, 2)


def test_preemption_never_leaves_a_half_applied_update():
    for cut in range(4):  # preempt after 0..3 whole rounds, one member mid-update
        r = rounds_for(workers=3)
        jobs = r.idle(0) + r.idle(1)
        for _ in range(cut):
            nxt = []
            for w, job in jobs:
                nxt += r.done(w, whole(job))
            jobs = nxt
        r.preempt()
        for w, job in jobs:
            r.done(w, dropped(job))
        master, stats = r.finish()
        assert torch.all(master["w"] == 4 * r.version) and r.version == cut
        assert stats["drafter/dropped_updates"] == len(jobs) and stats["drafter/version"] == cut
        assert stats["drafter/steps"] == 4 * stats["drafter/updates"]


def test_the_drafter_steps_and_the_reclaimed_time_count_applied_updates_only():
    r = rounds_for(workers=2)
    [(w, job)] = r.idle(0)
    [(w, job)] = r.done(0, whole(job, loss=0.25))
    r.preempt()
    r.done(0, dropped(job))
    master, stats = r.finish()
    assert stats["drafter/steps"] == 4 and stats["drafter/updates"] == 1 and stats["drafter/dropped_updates"] == 1
    assert stats["drafter/loss"] == 0.25
    assert r.trained_intervals == {0: [(0.0, 1.0)]}  # the dropped update's time is not reclaimed


def test_nothing_starts_without_data_or_after_preemption():
    r = rounds_for(data=())
    assert r.idle(0) == []
    assert [w for w, _ in r.add_data(["records"])] == [0]
    r = rounds_for()
    r.preempt()
    assert r.idle(0) == [] and r.finish()[1]["drafter/updates"] == 0


def test_a_step_trains_at_most_max_epochs_over_its_data_and_more_data_reopens_the_budget():
    # 1000 trainable tokens at 100 per step: one epoch is 10 optimizer steps, rounds of 4 each
    r = SpotRounds(2, {"w": torch.zeros(3)}, ["a"], seed=0, step=1, update_steps=4, data_tokens=1000,
                   batch_tokens=100, max_epochs=1.0)
    opened = []
    jobs = r.idle(0)
    while jobs:
        [(w, job)] = jobs
        opened.append(job["steps"])
        jobs = r.done(w, whole(job))
    assert opened == [4, 4, 4] and r.waiting == [0]  # the third round crosses the cap and still runs whole
    assert [w for w, _ in r.add_data(["b"], 500)] == [0]  # 1500 tokens: 15 steps, 12 sent
    assert r.finish()[1]["drafter/data_tokens"] == 1500
    uncapped = SpotRounds(2, {"w": torch.zeros(3)}, ["a"], seed=0, step=1, update_steps=4, data_tokens=1000,
                          batch_tokens=100)
    jobs = uncapped.idle(0)
    for _ in range(10):  # max_epochs 0: rounds go on for as long as the worker is idle
        [(w, job)] = jobs
        jobs = uncapped.done(w, whole(job))
    assert uncapped.version == 10 and jobs


def test_a_paused_step_opens_no_round_but_keeps_every_answer():
    r = SpotRounds(2, {"w": torch.zeros(3)}, ["a"], seed=0, step=1, update_steps=4, data_tokens=1000,
                   batch_tokens=100, paused=True)
    assert r.idle(0) == [] and r.add_data(["b"], 500) == [] and r.idle(1) == []
    master, stats = r.finish()
    assert r.data_refs == ["a", "b"] and stats["drafter/data_tokens"] == 1500
    assert stats["drafter/updates"] == 0 and r.version == 0 and torch.equal(master["w"], torch.zeros(3))


def test_the_watch_trains_once_the_drafter_falls_below_its_fresh_level():
    w = DrafterWatch(drop=0.1)
    assert not w.should_train()  # no reading yet
    for acceptance in (2.4, 2.2):  # the fresh level: 2.3
        w.observe(version=1, chain_acceptance=acceptance, passes=200)
        assert not w.should_train()
    w.observe(1, 1.5, 200)  # one low step: a reading is noisy, two are averaged
    assert w.reference == pytest.approx(2.3) and not w.should_train()
    w.observe(1, 2.7, 200)  # (1.5 + 2.7) / 2 = 2.1 >= 0.9 * 2.3
    assert not w.should_train()
    w.observe(1, 1.4, 200)  # (2.7 + 1.4) / 2 = 2.05 < 2.07: stale
    assert w.should_train()
    w.observe(1, 2.6, DrafterWatch.MIN_PASSES - 1)  # too few chain passes to count
    assert w.readings[-1] == 1.4 and w.should_train()
    w.observe(2, 1.5, 200)  # a trained drafter starts its own readings
    assert w.readings == [1.5] and not w.should_train()
    resumed = DrafterWatch(drop=0.1)
    resumed.load_state_dict(w.state_dict())
    assert (resumed.version, resumed.readings) == (2, [1.5])


def test_without_a_drop_every_step_trains():
    w = DrafterWatch()
    assert w.should_train()
    for acceptance in (3.0, 3.0, 1.0, 3.5):
        w.observe(1, acceptance, 200)
        assert w.should_train()


def test_a_member_that_never_answers_is_dropped_with_its_round():
    r = rounds_for()
    r.idle(0)
    master, stats = r.finish()
    assert stats["drafter/dropped_updates"] == 1 and torch.equal(master["w"], torch.zeros(3))


def test_a_stale_answer_changes_nothing():
    r = rounds_for()
    [(w, job)] = r.idle(0)
    assert r.done(0, {**whole(job), "version": 7}) == [] and r.round is not None


def test_a_worker_state_carries_the_spot_trainers_optimizer_into_a_resumed_worker():
    """Checkpoints keep each worker's AdamW moments, so a resumed run's spot training goes on from them."""
    from workers.tlt.learn.buffer import DrafterBuffer
    from workers.tlt.config import preset
    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl
    from workers.tlt.learn.sft import build_tiny_model

    cfg = preset("tiny-cpu", {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
                              "drafter": {"batch_tokens": 64}})
    config = build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2).config
    trained, fresh = (RolloutWorkerImpl(i, config, cfg) for i in (0, 1))
    buf = DrafterBuffer(max_tokens=10_000)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        buf.add(torch.randint(4, 18, (20,), generator=g), torch.randn(20, 32, generator=g), 5, 1)
    assert trained._get_trainer().train(buf, max_steps=3) == 3

    fresh.load_worker_state(trained.worker_state())
    a, b = trained._get_trainer(), fresh._get_trainer()
    assert b.steps_done == 3
    moments = [(sa, sb) for sa, sb in zip(a.opt.state_dict()["state"].values(), b.opt.state_dict()["state"].values())]
    assert moments and all(torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) for sa, sb in moments)
    assert fresh.load_worker_state(None) and fresh._bandit is None  # a checkpoint from before worker states


def test_a_worker_state_carries_the_bandit_and_drops_one_of_an_older_layout():
    import pickle

    from workers.tlt.config import preset
    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl
    from workers.tlt.learn.sft import build_tiny_model
    from workers.tlt.rollout.bandit import BucketedBandit

    cfg = preset("tiny-cpu", {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}})
    worker = RolloutWorkerImpl(0, build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2).config, cfg)
    bandit = BucketedBandit(["off", "d4k1v4"])
    bandit.update(1, "d4k1v4", 3, 0.05)
    worker.load_worker_state(pickle.loads(pickle.dumps({"bandit": bandit})))  # as a checkpoint carries it
    assert worker._bandit.rates()["1"] == pytest.approx({"d4k1v4": 60.0})
    old = pickle.loads(pickle.dumps(bandit))
    del old.passes
    old.rewards = [{"off": [30.0]}]  # per-pass rates, as before the bandit ranked by throughput
    worker.load_worker_state({"bandit": old})
    assert worker._bandit is None  # a fresh bandit at the next rollout, not a crash at its first select
    by_bucket = pickle.loads(pickle.dumps(bandit))
    by_bucket.passes = [window for window in bandit.passes.values()]  # by bucket, before per thread count
    worker.load_worker_state({"bandit": by_bucket})
    assert worker._bandit is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_spot_training_thread_yields_the_cpu_to_generation_and_the_learner():
    from workers.tlt.cluster.rollout_workers import _lowest_cpu_priority

    seen = {}
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def probe():
        _lowest_cpu_priority()
        seen["spot"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    th = threading.Thread(target=probe)
    th.start()
    th.join()
    assert seen["spot"] == 19
    # only that thread (compared with where it started: the suite may itself run under nice 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
