"""Spot drafter training: one drafter, whole updates only, preemption at the end of the rollout."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from torch import nn

from workers.tlt.ray_workers import CoordinatorImpl, spot_train


class CountingDrafter(nn.Module):
    """Stands in for the drafter: one weight that a training step increments by 1."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


class SlowTrainer:
    """DrafterTrainer's contract: train(buffer, max_steps, should_stop), stop between micro-steps."""

    def __init__(self, drafter, step_s=0.002):
        self.drafter = drafter
        self.step_s = step_s
        self.last_metrics = {}
        self.rng = None

    def train(self, buffer, max_steps, should_stop):
        assert len(buffer) > 0
        done = 0
        for _ in range(max_steps):
            if should_stop():
                return done
            time.sleep(self.step_s)
            with torch.no_grad():
                self.drafter.w += 1.0
            done += 1
        self.last_metrics = {"loss": 1.0 / (1 + done), "accuracy": 0.5}
        return done


def records(n=4):
    return [{"tokens": torch.arange(6), "hidden": torch.zeros(6, 2), "response_start": 2, "step": 1} for _ in range(n)]


def run_workers(coord, n_workers, preempt_after_s, chunk=4):
    results = {}

    def work(i):
        d = CountingDrafter()
        coord.report_done(i, 1, [records()])
        results[i] = spot_train(i, coord, d, SlowTrainer(d), chunk_steps=chunk, should_stop=coord.should_stop)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_workers)]
    for t in threads:
        t.start()
    time.sleep(preempt_after_s)
    coord.preempt()
    for t in threads:
        t.join(timeout=10)
    return results


def test_preemption_never_leaves_a_half_applied_update():
    for preempt_after in (0.0, 0.005, 0.013, 0.03, 0.051):
        coord = CoordinatorImpl(num_workers=3)
        coord.begin_step(1, {"w": torch.zeros(3)}, [])
        results = run_workers(coord, n_workers=2, preempt_after_s=preempt_after, chunk=4)
        master, stats = coord.finish()
        # each whole update adds exactly 4 from its round's start; averaging whole updates keeps that
        assert torch.all(master["w"] == master["w"][0])
        assert float(master["w"][0]) % 4 == 0, (preempt_after, master)
        assert float(master["w"][0]) == 4 * coord.version
        assert stats["drafter/version"] == coord.version
        assert all(steps % 4 == 0 for _, steps in results.values())


def test_idle_workers_train_one_drafter_that_keeps_improving_until_preempted():
    coord = CoordinatorImpl(num_workers=3)
    coord.begin_step(1, {"w": torch.zeros(3)}, [records()])
    results = run_workers(coord, n_workers=2, preempt_after_s=0.2)
    master, stats = coord.finish()
    assert coord.version >= 3  # several rounds of averaged whole updates
    assert stats["drafter/updates"] >= coord.version
    assert stats["drafter/steps"] == sum(steps for _, steps in results.values())
    assert 0.0 < stats["drafter/loss"] < 1.0
    for intervals, _ in results.values():
        assert intervals and intervals[0][1] >= intervals[0][0]


def test_an_update_still_training_when_the_rollout_ends_counts_as_dropped():
    coord = CoordinatorImpl(num_workers=2)
    coord.begin_step(1, {"w": torch.zeros(3)}, [records()])
    assert isinstance(coord.fetch(0), dict)  # worker 0 is mid-update ...
    master, stats = coord.finish()  # ... when the last worker finishes
    assert stats["drafter/dropped_updates"] == 1.0 and stats["drafter/updates"] == 0.0
    assert torch.equal(master["w"], torch.zeros(3))


def test_the_last_worker_to_finish_preempts_and_does_not_train():
    coord = CoordinatorImpl(num_workers=2)
    coord.begin_step(1, {"w": torch.zeros(3)}, [])
    assert coord.report_done(0, 1, [records()]) is True
    assert coord.should_stop() is False
    assert coord.report_done(1, 1, [records()]) is False  # the rollout is over
    assert coord.should_stop() is True
    assert coord.fetch(0) is None


def test_a_report_that_overtakes_its_begin_step_waits_for_it():
    """The driver does not wait for begin_step; a worker's report of that step must not land in the
    previous step's bookkeeping."""
    coord = CoordinatorImpl(num_workers=2)
    coord.begin_step(1, {"w": torch.zeros(3)}, [])
    answer = {}
    th = threading.Thread(target=lambda: answer.setdefault("may_train", coord.report_done(0, 2, [records()])))
    th.start()
    th.join(timeout=0.2)
    assert th.is_alive() and not coord.done  # held back: step 2 has not begun
    coord.begin_step(2, {"w": torch.ones(3)}, [])
    th.join(timeout=5)
    assert answer == {"may_train": True} and list(coord.done) == [0]
    assert coord.report_done(1, 1, []) is False  # a straggler from step 1 changes nothing
    assert list(coord.done) == [0] and not coord.should_stop()


def test_a_worker_state_carries_the_spot_trainers_optimizer_into_a_resumed_worker():
    """Checkpoints keep each worker's AdamW moments, so a resumed run's spot training goes on from them."""
    from workers.tlt.buffer import DrafterBuffer
    from workers.tlt.config import preset
    from workers.tlt.ray_workers import RolloutWorkerImpl
    from workers.tlt.sft import build_tiny_model

    cfg = preset("tiny-cpu", {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
                              "drafter": {"batch_tokens": 64}})
    config = build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2).config
    trained, fresh = (RolloutWorkerImpl(i, config, cfg, coordinator=None) for i in (0, 1))
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_spot_training_thread_yields_the_cpu_to_generation_and_the_learner():
    from workers.tlt.ray_workers import _lowest_cpu_priority

    seen = {}

    def probe():
        _lowest_cpu_priority()
        seen["spot"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    th = threading.Thread(target=probe)
    th.start()
    th.join()
    assert seen["spot"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # only that thread
