"""`bench e2e`: preset overrides from the command line, the Amdahl bound, and one real (tiny) run of the
three arms (baseline, TLT, TLT with a frozen drafter)."""

from __future__ import annotations

import time

import pytest

from workers.tlt.bench import e2e as e2e_module
from workers.tlt.bench.e2e import _Eta, amdahl_bound, arm_passes, e2e, parse_overrides, summarize
from workers.tlt.models.linear import KERNELS

# the same tiny shape as test_trainer.py (its SFT'd policy is cached and shared)
TINY = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 150},
    "task": {"prompts_per_step": 4},
    "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 40, "temperature": 1.0},
    "drafter": {"warmup_steps": 10, "batch_tokens": 256},
    "grpo": {"lr": 1e-3, "micro_batch": 4},
}


def test_overrides_are_parsed_as_yaml_per_section():
    assert parse_overrides(["drafter.lr=2e-3", "spec.strategies=[[4, 1, 4]]", "run.tlt=false"]) == {
        "drafter": {"lr": "2e-3"}, "spec": {"strategies": [[4, 1, 4]]}, "run": {"tlt": False}}
    with pytest.raises(SystemExit, match="section.field=value"):
        parse_overrides(["warmup_steps=3"])


def test_the_amdahl_bound_is_what_a_rollout_speedup_allows():
    assert amdahl_bound(0.0, 3.0) == 1.0  # nothing to speed up
    assert amdahl_bound(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl_bound(0.75, 1.8) == pytest.approx(1.5)  # the headline goal's corner
    assert amdahl_bound(0.5, 0.0) == 0.0


def test_setup_progress_prints_each_phase_with_an_eta_and_leaves_the_steps_to_log(capsys):
    eta = _Eta("tlt", steps=4, total_steps=8, done_before=4, started=0.0)
    eta.progress("drafter_warmup", 0, 10, "answers 0/4")
    eta.progress("drafter_warmup", 5, 10, "answers 4/4")  # within 30 s of the last line: not printed
    eta.progress("drafter_warmup", 10, 10, "drafter ready")  # a phase's end always is
    eta.progress("rl", 0, 4, "step 0/4")  # the per-step lines say that
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[bench e2e] tlt setup: drafter_warmup 0/10 answers 0/4",
                     "[bench e2e] tlt setup: drafter_warmup 10/10 drafter ready"]


def test_the_eta_leaves_out_the_one_off_drafter_warm_up(capsys):
    # 100 s in, 90 of them an uncached warm-up the next arm will not pay again: 10 s per step, 3 to go
    eta = _Eta("tlt", steps=4, total_steps=4, done_before=0, started=time.perf_counter() - 100.0, one_off_s=90.0)
    eta.log(1, {"reward/mean": 0.5, "timing_s/step": 10.0}, {})
    assert capsys.readouterr().err.rstrip().endswith("ETA 0.5 min")  # not 5.0: the warm-up is not a step's cost


def test_e2e_trains_the_three_arms_and_reports_consistent_figures(tmp_path, monkeypatch):
    # the test session's RAY_ADDRESS is the platform's job API (http): the bench starts its own instance
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    r = e2e("tiny-cpu", 2, tmp_path, overrides=TINY, static=True)
    assert r["arms"] == ["baseline", "tlt", "static"]
    assert r["steps"] == 2 and len(r["reward_by_step_tlt"]) == len(r["reward_by_step_baseline"]) == 2
    # keyed sampling and lossless SD: every arm samples the same answers, so the curves coincide
    assert r["reward_by_step_tlt"] == r["reward_by_step_baseline"] == r["reward_by_step_static"]
    assert r["amdahl_bound"] == pytest.approx(amdahl_bound(r["rollout_share"], r["rollout_speedup"]))
    assert r["e2e_efficiency"] == pytest.approx(r["e2e_speedup"] / r["amdahl_bound"])
    assert len(r["acceptance_by_step_static"]) == 2 and r["acceptance_length_static"] >= 1.0
    # the arm-fixed figure the adapted and the static drafter compare on: a 4-deep chain emits 1-5 tokens
    assert len(r["chain4_acceptance_by_step"]) == len(r["chain4_acceptance_by_step_static"]) == 2
    assert 1.0 <= r["chain4_acceptance"] <= 5.0 and 1.0 <= r["chain4_acceptance_static"] <= 5.0
    assert r["chain4_last_fifth_static"] == r["chain4_acceptance_by_step_static"][-1]
    # acceptance per kind of draft that ran (drafter chain, tree, n-gram), in both SD arms
    for kinds in (r["acceptance_by_kind"], r["acceptance_by_kind_static"]):
        assert kinds and set(kinds) <= {"chain", "tree", "ngram"} and all(v >= 1.0 for v in kinds.values())
    # the learner's share of its cores, per step: what tells a starved learner from SD's effect
    assert all(len(p["learner_cpu_share_by_step"]) == 2 and min(p["learner_cpu_share_by_step"]) > 0
               for p in r["profile_s"].values())
    assert all(p["rollout_borrowed"] >= 0 for p in r["profile_s"].values())  # > 0 only where kernels allow
    assert "reward_rise_tlt" in r and r["cpu"]
    assert r["step_s_baseline"] > 0 and r["step_s_tlt"] > 0
    assert r["e2e_speedup"] == pytest.approx(r["step_s_baseline"] / r["step_s_tlt"])
    assert r["rollout_speedup"] > 0 and 0 < r["rollout_share"] < 1
    assert 0.0 <= r["idle_reclaimed_frac"] <= 1.0
    assert r["spot_paused_steps_tlt"] == []  # tiny-cpu spot-trains in every step (drafter.spot_stale_drop 0)
    assert r["acceptance_length"] >= 1.0  # 4 rows per worker: SD is on from the first token
    # the kernels each arm's workers decoded with (one choice per machine: the same in every arm);
    # drafter kernels only where a drafter drafted
    k = r["kernels"]
    assert set(k) == {"baseline", "tlt", "static"} and all(k[arm] for arm in k)
    assert k["baseline"]["0"]["policy"] == k["tlt"]["0"]["policy"] and k["tlt"]["0"]["policy"]
    assert "drafter" not in k["baseline"]["0"] and k["tlt"]["0"]["drafter"] and k["static"]["0"]["drafter"]
    # and how the baseline's passes ran on them against every kernel the tuner could have chosen
    # instead: a decode step at each thread count a worker decodes on, and each product size it ran
    check = r["decode_check"]
    assert "1" in check["decode_ms"] and check["tuned_vs_fastest"] > 0
    ran = arm_passes(tmp_path / "baseline")
    assert ran and all(set(check["pass_ms"][t]) == set(by_rows) | {"1"} for t, by_rows in ran.items())
    assert check["tuned_vs_fastest"] == pytest.approx(
        check["profile_s"]["tuned"] / min(v for w, v in check["profile_s"].items() if w != "tuned"), abs=1e-3)
    for ms in check["decode_ms"].values():
        assert "tuned" in ms and len(ms) >= 2 and all(v > 0 for v in ms.values())
        assert set(ms) - {"tuned"} <= set(KERNELS)
    for arm in r["arms"]:
        assert (tmp_path / arm / "metrics.jsonl").exists()
    # the figures come from the arms' folders: --summarize prints them again, without running anything
    again = summarize(tmp_path, "tiny-cpu")
    assert {k: v for k, v in again.items() if k != "loadavg_end"} == \
        {k: v for k, v in r.items() if k not in ("loadavg_end", "loadavg_start", "bench_s")}
    with pytest.raises(SystemExit, match="already holds arms"):  # a run there would resume those arms
        e2e("tiny-cpu", 2, tmp_path, overrides=TINY, static=True)


def test_an_arm_that_fails_is_reported_beside_the_figures_of_those_that_ran(tmp_path, monkeypatch):
    """Nothing lost: the static arm (here with a config its section rejects) fails, and the bench
    still reports the baseline and TLT arms, naming the failure."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(e2e_module.ARMS, "static", {"run": {"tlt": True}, "drafter": {"spot_training": "sometimes"}})
    r = e2e("tiny-cpu", 1, tmp_path, overrides=TINY, static=True)
    assert r["arms"] == ["baseline", "tlt", "static"] and "drafter.spot_training" in r["failed_arms"]["static"]
    assert r["steps"] == 1 and r["e2e_speedup"] > 0 and "acceptance_length_static" not in r
    monkeypatch.setitem(e2e_module.ARMS, "tlt", {"run": {"tlt": "sometimes"}})
    with pytest.raises(RuntimeError, match="no steps of the baseline or the TLT arm"):
        e2e("tiny-cpu", 1, tmp_path / "again", overrides=TINY, static=False)
