"""The driver on a real local Ray instance: metrics, spot-training preemption, resume, TLT on == off.

Everything is tiny (a 2-layer 64-wide model, 4 prompts x 2 samples, 40 new tokens, greedy) so the
file runs in well under three minutes on 2 cores; the SFT'd policy is cached under var/models.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import ray
import torch

from workers.tlt.config import preset
from workers.tlt.metrics import SCALAR_KEYS, SERIES_KEYS, JsonlSink, Tracking
from workers.tlt.model import Transformer
from workers.tlt.trainer import Trainer

STEPS = 3


def tiny_cfg(tlt: bool = True, steps: int = STEPS):
    return preset("tiny-cpu", {
        "run": {"steps": steps, "tlt": tlt, "checkpoint_interval": 1, "seed": 0},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 150},
        "task": {"prompts_per_step": 4},
        "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 40, "temperature": 0.0},
        "spec": {"threshold": 8},
        "drafter": {"warmup_steps": 10, "batch_tokens": 256},
        "grpo": {"lr": 1e-3, "micro_batch": 4},
    })


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def train(cfg, out, resume=False, steps=None):
    tracking = Tracking([JsonlSink(out / "metrics.jsonl")])
    trainer = Trainer(cfg, out, tracking, resume=resume)
    try:
        trainer.setup()
        if steps is None:
            trainer.run()
        else:
            for _ in range(steps):
                trainer.run_step()
        return trainer.history, trainer.ckpt.flush()
    finally:
        trainer.close()
        tracking.close()


@pytest.fixture(scope="module")
def tlt_run(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("tlt")
    history, _ = train(tiny_cfg(tlt=True), out)
    return out, history


@pytest.fixture(scope="module")
def baseline_run(ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    history, _ = train(tiny_cfg(tlt=False), out)
    return out, history


def policy_at(out, step) -> dict[str, torch.Tensor]:
    return Transformer.from_pretrained(out / "checkpoints" / f"step_{step:06d}" / "policy").state_dict()


def test_a_tiny_two_worker_run_emits_every_dashboard_metric_consistently(tlt_run):
    out, history = tlt_run
    assert [h.step for h in history] == [1, 2, 3]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "scalars" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for h in history:
        s, series = h.scalars, h.series
        assert set(SCALAR_KEYS) <= set(s), set(SCALAR_KEYS) - set(s)
        assert set(SERIES_KEYS) <= set(series), set(SERIES_KEYS) - set(series)
        assert all(isinstance(v, float) for v in s.values())
        assert 0.0 <= s["idle/reclaimed_s"] <= s["idle/worker_s"] + 1e-9
        assert 0.0 <= s["idle/reclaimed_frac"] <= 1.0
        assert series["rollout/lengths"] == [len(t) for t in h.responses]
        assert s["rollout/len_max"] == max(series["rollout/lengths"])
        assert len(h.responses) == 8 and len(h.rewards) == 8
        if s["spec/verify_passes"] > 0:
            assert s["spec/acceptance_length"] >= 1.0
            assert all(0.0 <= a <= 1.0 for a in series["spec/accept_by_position"])
        assert s["timing_s/step"] >= s["timing_s/rollout"] + s["timing_s/learner"] - 1e-6
        workers = sorted(t["worker"] for t in series["idle/timeline"])
        assert workers == [0, 1]
        for t in series["idle/timeline"]:
            assert t["segments"][0][0] == "generate"
            assert all(seg[0] in ("generate", "idle", "drafter") and seg[1] <= seg[2] for seg in t["segments"])
        running = series["rollout/running"]
        assert len(running["t"]) == len(running["running"]) == len(running["sd"])
    assert sum(h.scalars["spec/verify_passes"] for h in history) > 0  # SD ran in the tail
    kinds = {r["artifact"] for r in records if "artifact" in r}
    assert kinds == {"drafter", "policy"}
    assert (out / "policy.zip").exists()


def test_greedy_rollouts_and_updates_are_identical_with_tlt_on_and_off(tlt_run, baseline_run):
    (tlt_out, tlt_hist), (base_out, base_hist) = tlt_run, baseline_run
    for a, b in zip(tlt_hist, base_hist):
        assert a.responses == b.responses, f"step {a.step}: SD changed a greedy rollout"
        assert a.rewards == b.rewards
    for step in range(1, STEPS + 1):
        pa, pb = policy_at(tlt_out, step), policy_at(base_out, step)
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"step {step}: {k} differs"
    # the baseline really was the baseline
    assert all(h.scalars["spec/verify_passes"] == 0 for h in base_hist)
    assert all(h.scalars["idle/reclaimed_s"] == 0 for h in base_hist)


def test_a_resumed_run_equals_the_uninterrupted_one(tlt_run, tmp_path):
    ref_out, ref_hist = tlt_run
    out = tmp_path / "resumed"
    shutil.copytree(ref_out / "checkpoints", out / "checkpoints")
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:06d}")  # "crashed" after step STEPS-1
    history, _ = train(tiny_cfg(tlt=True), out, resume=True)
    assert [h.step for h in history] == [STEPS]
    assert history[0].responses == ref_hist[-1].responses
    assert history[0].rewards == ref_hist[-1].rewards
    assert history[0].scalars["learner/loss"] == ref_hist[-1].scalars["learner/loss"]
    pa, pb = policy_at(out, STEPS), policy_at(ref_out, STEPS)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_preempting_real_drafter_training_leaves_a_whole_update(ray_local):
    """Coordinator actor + the real DrafterTrainer: stop mid-training, the master is a whole update."""
    from workers.tlt.drafter import Drafter
    from workers.tlt.drafter_train import DrafterTrainer
    from workers.tlt.ray_workers import Coordinator, spot_train
    from workers.tlt.sft import build_tiny_model

    cfg = tiny_cfg()
    policy = build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2)
    drafter = Drafter.for_target(policy)
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    records = [{"tokens": torch.randint(4, 18, (30,), generator=g), "hidden": torch.randn(30, 64, generator=g).half(),
                "response_start": 10, "step": 1} for _ in range(8)]
    for preempt_after in (0.05, 0.3):
        coord = Coordinator.remote(2)
        ray.get(coord.begin_step.remote(1, start, [ray.put(records)]))
        submitted: list[dict] = []
        trainer = DrafterTrainer(drafter, cfg.drafter)
        result = {}

        def work():
            assert ray.get(coord.report_done.remote(0, []))
            result["out"] = spot_train(0, coord, drafter, trainer, 256, chunk_steps=4,
                                       on_update=lambda v, s: submitted.append(s))

        th = threading.Thread(target=work)
        th.start()
        time.sleep(preempt_after)
        ray.get(coord.report_done.remote(1, []))  # the last worker finishes: preempts
        th.join(timeout=30)
        master, stats = ray.get(coord.finish.remote())
        candidates = [start] + submitted
        assert any(all(torch.equal(master[k], c[k]) for k in master) for c in candidates), \
            "the master drafter is not a whole update"
        assert stats["drafter/steps"] == 4 * len(submitted) == result["out"][1]
        ray.kill(coord)


def test_the_entry_point_rejects_a_bad_config_with_exit_code_2(tmp_path, capsys, monkeypatch):
    from workers.tlt.train import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("spec:\n  threshold: 0\n")
    assert main([str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "spec.threshold" in capsys.readouterr().err
    monkeypatch.setenv("TLT_CONFIG", "rollout: {temperature: -1}")
    assert main(["--out", str(tmp_path / "out")]) == 2
    assert "rollout.temperature" in capsys.readouterr().err
    monkeypatch.delenv("TLT_CONFIG")
    assert main(["--out", str(tmp_path / "out")]) == 2
