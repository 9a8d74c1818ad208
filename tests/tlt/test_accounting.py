"""Idle / reclaimed accounting from per-worker wall-clock stamps."""

from __future__ import annotations

import time

import pytest

from workers.tlt.cluster.accounting import Accounting, WorkerTimes


def test_the_last_worker_to_finish_is_never_idle():
    acct = Accounting()
    scalars, timeline = acct.rollout(100.0, [WorkerTimes(0, 100.0, 110.0), WorkerTimes(1, 100.0, 104.0)])
    assert scalars["idle/worker_s"] == pytest.approx(6.0)
    assert scalars["idle/reclaimed_s"] == 0.0
    assert scalars["idle/reclaimed_frac"] == 0.0
    assert timeline[0]["segments"] == [["generate", 0.0, 10.0]]
    assert timeline[1]["segments"] == [["generate", 0.0, 4.0], ["idle", 4.0, 10.0]]


def test_drafter_training_is_counted_only_inside_the_idle_window():
    acct = Accounting()
    workers = [
        WorkerTimes(0, 0.0, 10.0),
        # trains 5..9 and 9.2..10.5: the part after the rollout end (10.0) is not reclaimed idle time
        WorkerTimes(1, 0.0, 4.0, drafter=[(5.0, 9.0), (9.2, 10.5)]),
    ]
    scalars, timeline = acct.rollout(0.0, workers)
    assert scalars["idle/worker_s"] == pytest.approx(6.0)
    assert scalars["idle/reclaimed_s"] == pytest.approx(4.8)
    assert scalars["idle/reclaimed_frac"] == pytest.approx(0.8)
    assert "drafter/steps" not in scalars  # the spot schedule writes it, once
    kinds = [s[0] for s in timeline[1]["segments"]]
    assert kinds == ["generate", "idle", "drafter", "idle", "drafter"]
    assert timeline[1]["segments"][-1][2] == pytest.approx(10.0)


def test_packing_is_its_own_slice_and_never_reclaimed():
    acct = Accounting()
    workers = [WorkerTimes(0, 0.0, 10.0), WorkerTimes(1, 0.0, 4.0, pack=[(4.0, 5.0)], drafter=[(5.5, 7.5)])]
    scalars, timeline = acct.rollout(0.0, workers)
    assert scalars["idle/reclaimed_s"] == pytest.approx(2.0)  # optimizer time only
    assert [s[0] for s in timeline[1]["segments"]] == ["generate", "pack", "idle", "drafter", "idle"]


def test_totals_accumulate_over_steps_and_survive_a_checkpoint():
    acct = Accounting()
    acct.rollout(0.0, [WorkerTimes(0, 0.0, 2.0), WorkerTimes(1, 0.0, 1.0, drafter=[(1.0, 2.0)])])
    acct.rollout(0.0, [WorkerTimes(0, 0.0, 3.0), WorkerTimes(1, 0.0, 1.0)])
    assert acct.idle_total == pytest.approx(3.0)
    assert acct.reclaimed_total == pytest.approx(1.0)
    other = Accounting()
    other.load_state_dict(acct.state_dict())
    assert other.idle_total == acct.idle_total and other.reclaimed_total == acct.reclaimed_total


def test_phase_timings_cover_every_phase():
    acct = Accounting()
    acct.start_step()
    with acct.phase("rollout"):
        time.sleep(0.01)
    t = acct.timings()
    assert set(t) >= {"timing_s/step", "timing_s/rollout", "timing_s/reward", "timing_s/learner", "timing_s/sync"}
    assert t["timing_s/rollout"] >= 0.01 and t["timing_s/reward"] == 0.0
    assert t["timing_s/step"] >= t["timing_s/rollout"]
