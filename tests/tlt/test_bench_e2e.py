"""`bench e2e`: preset overrides from the command line, and one real (tiny) TLT-vs-baseline run."""

from __future__ import annotations

import pytest

from workers.tlt.bench import e2e, parse_overrides

# the same tiny shape as test_trainer.py (its SFT'd policy is cached and shared)
TINY = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 150},
    "task": {"prompts_per_step": 4},
    "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 40, "temperature": 0.0},
    "drafter": {"warmup_steps": 10, "batch_tokens": 256},
    "grpo": {"lr": 1e-3, "micro_batch": 4},
}


def test_overrides_are_parsed_as_yaml_per_section():
    assert parse_overrides(["drafter.lr=2e-3", "spec.strategies=[[4, 1, 4]]", "run.tlt=false"]) == {
        "drafter": {"lr": "2e-3"}, "spec": {"strategies": [[4, 1, 4]]}, "run": {"tlt": False}}
    with pytest.raises(SystemExit, match="section.field=value"):
        parse_overrides(["warmup_steps=3"])


def test_e2e_trains_baseline_and_tlt_and_reports_consistent_figures(tmp_path, monkeypatch):
    # the test session's RAY_ADDRESS is the platform's job API (http): the bench starts its own instance
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    r = e2e("tiny-cpu", 2, tmp_path, overrides=TINY)
    assert r["steps"] == 2 and len(r["reward_by_step_tlt"]) == len(r["reward_by_step_baseline"]) == 2
    # greedy: TLT is lossless, so both runs see the same answers and rewards
    assert r["reward_by_step_tlt"] == r["reward_by_step_baseline"]
    assert r["step_s_baseline"] > 0 and r["step_s_tlt"] > 0
    assert r["e2e_speedup"] == pytest.approx(r["step_s_baseline"] / r["step_s_tlt"])
    assert r["rollout_speedup"] > 0 and 0 < r["rollout_share"] < 1
    assert 0.0 <= r["idle_reclaimed_frac"] <= 1.0
    assert r["acceptance_length"] >= 1.0  # 4 rows per worker: SD is on from the first token
    assert (tmp_path / "baseline" / "metrics.jsonl").exists() and (tmp_path / "tlt" / "metrics.jsonl").exists()
