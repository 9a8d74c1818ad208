"""Faults inside a run (tiny model, local Ray): a rollout worker that dies or hangs is replaced and
the step's rollout run again; spot training that fails leaves the run on SD with a warning metric;
a learner rank that dies fails the run loudly and leaves its last checkpoint whole."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray

from workers.tlt.checkpoint import CheckpointManager
from workers.tlt.config import preset
from workers.tlt.metrics import JsonlSink, Tracking
from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl, worker_actor
from workers.tlt.trainer import Trainer

STEPS = 3


def tiny_cfg(**rollout):
    return preset("tiny-cpu", {
        "run": {"steps": STEPS, "tlt": True, "checkpoint_interval": 1, "seed": 0},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 150},
        "task": {"prompts_per_step": 4},
        "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 40, "temperature": 1.0, **rollout},
        "spec": {"threshold": 8},
        "drafter": {"warmup_steps": 10, "batch_tokens": 256},
        "grpo": {"lr": 1e-3, "micro_batch": 4, "learner_ranks": 2},
    })


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fake workers live in this file
    yield
    ray.shutdown()


def once(marker: Path) -> bool:
    """True the first time only (across processes: a restarted worker is a new one)."""
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


class FlakyWorker(RolloutWorkerImpl):
    """Worker 1 dies in its step-2 rollout; worker 0 hangs in its step-3 rollout (once each)."""

    marks: Path = Path("/nonexistent")

    def rollout(self, step, prompts, eos_ids, seed, tlt):
        if self.id == 1 and step == 2 and once(self.marks / "died"):
            os._exit(1)
        if self.id == 0 and step == 3 and once(self.marks / "hung"):
            time.sleep(3600)
        return super().rollout(step, prompts, eos_ids, seed, tlt)


class BrokenSpotWorker(RolloutWorkerImpl):
    def _spot_update(self, job):
        raise RuntimeError("the drafter trainer broke")


def run(cfg, out: Path, actor) -> Trainer:
    trainer = Trainer(cfg, out, Tracking([JsonlSink(out / "metrics.jsonl")]), worker_actor=actor)
    trainer.setup()
    return trainer


def test_a_dead_or_hung_rollout_worker_is_replaced_and_the_step_rerun(ray_local, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    cls = type("FlakyWorkerHere", (FlakyWorker,), {"marks": marks})
    trainer = run(tiny_cfg(timeout_s=30.0), tmp_path / "run", worker_actor(cls))
    try:
        trainer.run()
        assert [h.step for h in trainer.history] == [1, 2, 3]
        assert trainer.worker_retries == 2  # one death, one hang
        assert (marks / "died").exists() and (marks / "hung").exists()
        for h in trainer.history:
            assert len(h.responses) == 8 and h.scalars["drafter/stale_workers"] == 0.0
    finally:
        trainer.close()


def test_failing_spot_training_degrades_the_run_to_sd_without_retraining(ray_local, tmp_path):
    trainer = run(tiny_cfg(), tmp_path, worker_actor(BrokenSpotWorker))
    try:
        trainer.run()
        assert [h.step for h in trainer.history] == [1, 2, 3]
        flags = [h.scalars["drafter/spot_failed"] for h in trainer.history]
        assert flags[-1] == 1.0 and sorted(flags) == flags  # visible from the failure on
        assert all(h.scalars["drafter/stale_workers"] == 0.0 for h in trainer.history)
    finally:
        trainer.close()


def test_a_dead_learner_rank_fails_the_run_loudly_and_keeps_the_last_checkpoint(ray_local, tmp_path):
    trainer = Trainer(tiny_cfg(), tmp_path, Tracking([JsonlSink(tmp_path / "metrics.jsonl")]))
    try:
        trainer.setup()
        trainer.run_step()
        trainer.ckpt.flush()
        ray.kill(trainer.learner_group.ranks[1])
        with pytest.raises(ray.exceptions.RayActorError):
            trainer.run_step()
    finally:
        try:
            trainer.close()
        except Exception:  # noqa: BLE001 - closing a group with a dead rank may report it too
            pass
    latest = CheckpointManager(tmp_path / "checkpoints").latest()
    assert latest is not None and latest.name == "step_000001"
    assert list((latest / "learner").glob("*.distcp")) and CheckpointManager.load(latest)["state"]["step"] == 1
