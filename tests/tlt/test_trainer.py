"""The driver on a real local Ray instance: metrics, spot-training preemption, resume, TLT on == off.

Everything is tiny (a 2-layer 64-wide model, 4 prompts x 2 samples, 40 new tokens, sampled at
temperature 1) so the file runs in well under three minutes on 2 cores; the SFT'd policy is cached
under var/models. Sampling is keyed by (seed, sample, position), so TLT on and off draw the same
responses, and the groups' rewards differ: the policy really moves.
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile

import pytest
import ray
import torch

from workers.tlt.config import load_config, preset
from workers.tlt.checkpoint import CheckpointManager
from workers.tlt.metrics import SCALAR_KEYS, SERIES_KEYS, WHEN_MEASURED, JsonlSink, Tracking
from workers.tlt.models.transformer import Transformer
from workers.tlt.models.policies import prepare_policy_folder
from workers.tlt.cluster.rollout_workers import worker_actor
from workers.tlt.trainer import Trainer

STEPS = 3


def tiny_cfg(tlt: bool = True, steps: int = STEPS):
    return preset("tiny-cpu", {
        "run": {"steps": steps, "tlt": tlt, "checkpoint_interval": 1, "seed": 0},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 150},
        "task": {"prompts_per_step": 4},
        "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 40, "temperature": 1.0},
        "spec": {"threshold": 8},
        "drafter": {"warmup_steps": 10, "batch_tokens": 256},
        "grpo": {"lr": 1e-3, "micro_batch": 4, "learner_ranks": 2},  # the FSDP2 group across 2 ranks
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


def assert_moved(policy: dict[str, torch.Tensor], since: dict[str, torch.Tensor]) -> None:
    """The run's updates were real: some weight differs from where it started."""
    assert any(not torch.equal(policy[k], since[k]) for k in since), "the policy never changed"


@pytest.fixture(scope="module")
def start_policy() -> dict[str, torch.Tensor]:
    return Transformer.from_pretrained(prepare_policy_folder(tiny_cfg())).state_dict()


def test_a_tiny_two_worker_run_emits_every_dashboard_metric_consistently(tlt_run):
    out, history = tlt_run
    assert [h.step for h in history] == [1, 2, 3]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "scalars" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for h in history:
        s, series = h.scalars, h.series
        assert set(SCALAR_KEYS) - WHEN_MEASURED <= set(s), set(SCALAR_KEYS) - WHEN_MEASURED - set(s)
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
            assert all(seg[0] in ("generate", "pack", "drafter", "idle") and seg[1] <= seg[2] for seg in t["segments"])
        running = series["rollout/running"]
        assert len(running["t"]) == len(running["running"]) == len(running["sd"])
    assert sum(h.scalars["spec/verify_passes"] for h in history) > 0  # SD ran in the tail
    assert any("spec/acceptance_length" in h.scalars for h in history)
    for h in history:  # measured, or absent: never a placeholder
        assert ("spec/acceptance_length" in h.scalars) == (h.scalars["spec/verify_passes"] > 0)
        assert ("drafter/loss" in h.scalars) == (h.scalars.get("drafter/updates", 0) > 0)
    kinds = {r["artifact"] for r in records if "artifact" in r}
    assert kinds == {"drafter", "policy"}
    assert (out / "policy.zip").exists()


def test_every_checkpoint_of_a_tlt_run_audits_sd_and_cards_its_drafter(tlt_run):
    out, history = tlt_run
    for h in history:  # checkpoint_interval 1: every step audits
        assert h.scalars["audit/greedy_identical"] == 1.0
        assert h.scalars["audit/greedy_prompts"] == 2.0
        assert h.scalars["audit/acceptance_length"] >= 1.0
    with zipfile.ZipFile(out / "checkpoints" / f"step_{STEPS:06d}" / "drafter_eagle.zip") as z:
        name = next(n for n in z.namelist() if n.endswith("model_card.json"))
        card = json.loads(z.read(name))
    assert card["rl_step"] == STEPS and card["target_model"] == "tiny"
    assert card["acceptance_length"] == history[-1].scalars["audit/acceptance_length"]
    # the warm-up's steps plus the spot updates, at their token budgets
    assert card["training_tokens"] >= 10 * tiny_cfg().drafter.warmup_batch_tokens
    assert len(card["target_sha256"]) == 64


def test_a_baseline_run_has_no_drafter_to_audit(baseline_run):
    _, history = baseline_run
    assert not any(k.startswith("audit/") for h in history for k in h.scalars)


def test_sampled_rollouts_and_updates_are_identical_with_tlt_on_and_off(tlt_run, baseline_run, start_policy):
    (tlt_out, tlt_hist), (base_out, base_hist) = tlt_run, baseline_run
    for a, b in zip(tlt_hist, base_hist):
        assert a.responses == b.responses, f"step {a.step}: SD changed a sampled rollout"
        assert a.rewards == b.rewards
    assert sum(h.scalars["learner/rows_run"] for h in tlt_hist) > 0  # some groups had an advantage
    for step in range(1, STEPS + 1):
        pa, pb = policy_at(tlt_out, step), policy_at(base_out, step)
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"step {step}: {k} differs"
    assert_moved(policy_at(tlt_out, STEPS), start_policy)
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
    assert sum(h.scalars["learner/rows_run"] for h in ref_hist) > 0  # real updates (AdamW keeps moving after them)
    assert_moved(pa, policy_at(ref_out, STEPS - 1))  # the resumed step itself updated the policy
    # every worker's SD bandit and spot-trainer optimizer went into the checkpoint it resumed from
    workers = CheckpointManager.load(ref_out / "checkpoints" / f"step_{STEPS - 1:06d}")["state"]["worker_states"]
    assert len(workers) == 2 and all(w["bandit"] is not None and w["drafter_trainer"]["optimizer"] for w in workers)


def test_spot_training_resumes_the_warmups_adamw(tlt_run):
    """Every worker's spot trainer goes on from the warm-up's AdamW moments: its step count starts at
    the warm-up's, not at 0 (a fresh AdamW's first steps move every weight by the full rate)."""
    out, _ = tlt_run
    first = sorted((out / "checkpoints").glob("step_*"))[0]
    warm = tiny_cfg().drafter.warmup_steps
    for w in CheckpointManager.load(first)["state"]["worker_states"]:
        trainer = w["drafter_trainer"]
        counts = {float(s["step"]) for s in trainer["optimizer"]["state"].values()}
        assert counts == {warm + trainer["steps_done"]}


def test_preempting_real_drafter_training_leaves_a_whole_update(ray_local):
    """A rollout worker actor with the real DrafterTrainer, preempted mid-update by the driver: the
    update is dropped whole, or it finished first and is whole."""
    from workers.tlt.models.drafter import Drafter
    from workers.tlt.cluster.rollout_workers import RolloutWorker
    from workers.tlt.learn.sft import build_tiny_model
    from workers.tlt.cluster.spot import SpotRounds

    cfg = tiny_cfg()
    policy = build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2)
    start = {k: v.clone() for k, v in Drafter.for_target(policy).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    records = [{"tokens": torch.randint(4, 18, (30,), generator=g), "hidden": torch.randn(30, 64, generator=g).half(),
                "response_start": 10, "step": 1} for _ in range(8)]
    worker = RolloutWorker.options(num_cpus=0).remote(0, policy.config, cfg)
    ray.get(worker.load_weights.remote(policy.state_dict(), start))
    try:
        for preempt_after in (0.05, 3.0):
            rounds = SpotRounds(2, start, [ray.put(records)], seed=0, step=1, update_steps=4, put=ray.put)
            [(w, job)] = rounds.idle(0)
            ref = worker.spot_update.remote(job)
            ready, _ = ray.wait([ref], timeout=preempt_after)
            if not ready:  # the last shard came in: the driver preempts (a call that lands mid-update)
                ray.get(worker.preempt.remote(), timeout=5)
            out = ray.get(ref, timeout=60)
            rounds.preempt()  # the rollout is over, as in the driver, before the last answers come in
            rounds.done(0, out)
            master, stats = rounds.finish()
            if out["state"] is None:
                assert all(torch.equal(master[k], start[k]) for k in master)
                assert stats["drafter/steps"] == 0 and stats["drafter/dropped_updates"] == 1
            else:
                assert all(torch.equal(master[k], out["state"][k]) for k in master)
                assert stats["drafter/steps"] == 4 and stats["drafter/version"] == 1
            ray.get(worker.rollout.remote(1, [[1, 5, 6]], [2], 0, False))  # a new step clears the flag
    finally:
        ray.kill(worker)


def test_the_trainer_reports_its_progress_through_every_phase(tlt_run):
    """Tracking.progress: policy (SFT or cached), drafter warm-up, actors, then every RL step;
    each phase's first and last update always get through the throttle."""
    out, _ = tlt_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    progress = [r["progress"] for r in records if "progress" in r]
    phases = [p["phase"] for p in progress]
    assert phases[0] == "policy" and [p for i, p in enumerate(phases) if p != phases[i - 1] or i == 0] == [
        "policy", "drafter_warmup", "actors", "rl"]
    by_phase = {ph: [(p["done"], p["total"]) for p in progress if p["phase"] == ph] for ph in set(phases)}
    assert by_phase["policy"][0] == (0, 150) and by_phase["policy"][-1] == (150, 150)
    warm = tiny_cfg().drafter.warmup_prompts + tiny_cfg().drafter.warmup_steps  # answers, then steps
    assert by_phase["drafter_warmup"][0] == (0, warm) and by_phase["drafter_warmup"][-1] == (warm, warm)
    assert by_phase["actors"] == [(0, 2), (2, 2)]
    assert by_phase["rl"][0] == (0, STEPS) and by_phase["rl"][-1] == (STEPS, STEPS)


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


class FakeVllmEngine:
    """VllmRolloutEngine's small interface (from_config, generate, update_policy/drafter,
    returns_hidden False) over the built-in engine, so the vLLM path runs where vLLM is absent."""

    returns_hidden = False

    def __init__(self, cfg, policy_dir, drafter_dir):
        from workers.tlt.models.transformer import Transformer

        self.cfg, self.policy_dir, self.drafter_dir = cfg, policy_dir, drafter_dir
        self.policy = Transformer.from_pretrained(policy_dir)
        self.calls = {"generate": 0, "update_policy": 0, "update_drafter": 0}
        self.sleep_mode = False
        self.events: list[str] = []  # generate / update_policy / sleep / wake_up:<tags>, in order
        self.asleep: set[str] = set()  # what sleep() released and wake_up() has not brought back

    @classmethod
    def from_config(cls, cfg, policy_dir, drafter_dir=None, sleep_mode=False, **kw):
        engine = cls(cfg, policy_dir, drafter_dir if cfg.run.tlt else None)
        engine.sleep_mode = sleep_mode
        return engine

    def sleep(self):  # vLLM refuses sleep() on an engine built without sleep mode
        assert self.sleep_mode and not self.asleep
        self.asleep = {"weights", "kv_cache"}
        self.events.append("sleep")

    def wake_up(self, tags=None):
        tags = tags or ["weights", "kv_cache"]
        assert set(tags) <= self.asleep, (tags, self.asleep)
        self.asleep -= set(tags)
        self.events.append(f"wake_up:{','.join(tags)}")

    def generate(self, prompts, params, *, max_new_tokens, eos_ids=(), seed=0, **_):
        from workers.tlt.rollout.engine import generate

        assert not self.asleep, f"generate() with {self.asleep} asleep"
        self.events.append("generate")
        self.calls["generate"] += 1
        res = generate(self.policy, prompts, params, max_new_tokens=max_new_tokens, eos_ids=eos_ids, seed=seed,
                       harvest_hidden=False)
        assert res.hidden is None
        return res

    def update_policy(self, policy):
        assert "weights" not in self.asleep, "weights loaded into sleeping weights"
        self.events.append("update_policy")
        self.calls["update_policy"] += 1
        self.policy.load_state_dict(policy.state_dict())

    def update_drafter(self, drafter):
        assert self.drafter_dir is not None
        self.calls["update_drafter"] += 1


def vllm_cfg(steps: int = STEPS):
    data = tiny_cfg(steps=steps).model_dump(mode="json")
    data["rollout"]["engine"] = "vllm"
    data["drafter"]["warmup_steps"] = 0  # not what these tests are about
    return load_config(data)


def test_the_vllm_path_builds_the_engine_from_exported_folders_and_updates_it_in_place():
    from workers.tlt.models.drafter import Drafter
    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl

    cfg = vllm_cfg()
    policy = Transformer.from_pretrained(prepare_policy_folder(cfg))
    drafter_state = Drafter.for_target(policy).state_dict()
    worker = RolloutWorkerImpl(0, policy.config, cfg)
    worker.engine_factory = FakeVllmEngine.from_config
    worker.load_weights(policy.state_dict(), drafter_state)
    assert worker.engine is None  # lazily: nothing built (nor vLLM imported) before the first rollout
    out = worker.rollout(1, [[1, 5, 6, 7]] * 2, [2], seed=0, tlt=True)
    engine = worker.engine
    assert (engine.policy_dir / "config.json").exists() and (engine.drafter_dir / "model.safetensors").exists()
    assert engine.calls["generate"] == 1 and out["harvested"] is False and worker.pack()["records"] is None
    assert out["tokens"] == [list(t) for t in generate_ref(policy, cfg, [[1, 5, 6, 7]] * 2)]
    worker.load_weights(policy.state_dict(), drafter_state)  # next step's sync: in place, no rebuild
    assert worker.engine is engine and engine.calls["update_policy"] == 1 and engine.calls["update_drafter"] == 1
    worker.close()  # the exported folders go with the engine
    assert worker.engine is None and not engine.policy_dir.exists()


def generate_ref(policy, cfg, prompts):
    from workers.tlt.rollout.engine import generate
    from workers.tlt.rollout.sampling import SamplingParams

    rc = cfg.rollout
    return generate(policy, prompts, SamplingParams(temperature=rc.temperature), max_new_tokens=rc.max_new_tokens,
                    eos_ids=[2], seed=0, harvest_hidden=False).tokens


def test_without_hidden_states_from_the_engine_the_buffer_fills_from_the_learner_pass(ray_local, tmp_path):
    """A vLLM-path step with the fake engine: the learner's log-prob pass fills the drafter buffer
    (with the policy's own hidden states), and the next step ships every record to the coordinator."""
    import ray.cloudpickle

    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl

    class FakeVllmWorker(RolloutWorkerImpl):
        engine_factory = staticmethod(FakeVllmEngine.from_config)

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class lives in this test
    cfg = vllm_cfg(steps=1)
    tracking = Tracking([JsonlSink(tmp_path / "metrics.jsonl")])
    trainer = Trainer(cfg, tmp_path, tracking, worker_actor=worker_actor(FakeVllmWorker))
    try:
        trainer.setup()
        before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
        first = trainer.run_step()
        recs = trainer.buffer.records
        assert len(recs) == sum(1 for r in first.responses if r) > 0  # one record per response, from the learner
        # the hidden states are the policy's own (as it was for the rollout), over prompt + response
        policy = Transformer.from_pretrained(trainer.policy_folder)
        policy.load_state_dict(before)
        r = recs[0]
        with torch.no_grad():
            hidden = policy(r.tokens[None], logits=False).hidden
        torch.testing.assert_close(r.hidden.float(), hidden[0].float(), atol=2e-3, rtol=2e-3)
        assert all(res["harvested"] is False for res in trainer.last_results)
        # next step's begin_step ships all of them to the coordinator (this step's came too late)
        refs, tokens = trainer._prev_records_ref()
        shipped = [rec for ref in refs for rec in ray.get(ref)]
        assert len(shipped) == len(recs) and tokens == sum(r.trainable for r in recs) > 0
    finally:
        trainer.close()
        tracking.close()


def test_rollout_engines_sleep_through_the_learner_phase_and_wake_before_the_weights(ray_local, tmp_path):
    """rollout.sleep_while_learning (on by default where the learner shares the workers' GPUs): each
    step's engines sleep once their rollout is in and wake before the next weight sync, never
    generating or loading weights asleep, and the run's samples are those of a run that never slept."""
    import ray.cloudpickle

    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl

    class SleepyVllmWorker(RolloutWorkerImpl):
        engine_factory = staticmethod(FakeVllmEngine.from_config)

        def engine_events(self):
            return self.engine.events

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    runs = {}
    for sleeps in (True, False):
        data = vllm_cfg(steps=3).model_dump(mode="json")
        data["rollout"]["sleep_while_learning"] = sleeps
        out = tmp_path / str(sleeps)
        tracking = Tracking([JsonlSink(out / "metrics.jsonl")])
        trainer = Trainer(load_config(data), out, tracking, worker_actor=worker_actor(SleepyVllmWorker))
        try:
            trainer.setup()
            runs[sleeps] = [trainer.run_step() for _ in range(3)]
            events = ray.get([w.engine_events.remote() for w in trainer.workers])
        finally:
            trainer.close()
            tracking.close()
        if sleeps:
            # the engine is built at step 1's rollout (after that step's sync), then per step:
            for ev in events:
                assert ev == ["generate", "sleep"] + ["wake_up:weights", "update_policy", "wake_up:kv_cache", "generate",
                                                      "sleep"] * 2, ev
            assert all("timing_s/engine_sleep" in o.scalars for o in runs[True])
        else:
            assert all("sleep" not in ev for ev in events)
            assert all("timing_s/engine_sleep" not in o.scalars for o in runs[False])
    assert [o.responses for o in runs[True]] == [o.responses for o in runs[False]]


def test_engines_sleep_by_default_only_where_the_learner_shares_their_gpus():
    from workers.tlt.cluster.placement import sleeps_while_learning

    cfg = tiny_cfg()
    assert not sleeps_while_learning(cfg, gpu=False)
    assert sleeps_while_learning(cfg, gpu=True) == (cfg.grpo.placement == "colocated")
    data = cfg.model_dump(mode="json")
    data["grpo"]["placement"] = "separate"
    assert not sleeps_while_learning(load_config(data), gpu=True)
    data["rollout"]["sleep_while_learning"] = True
    assert sleeps_while_learning(load_config(data), gpu=False)


def test_an_auto_dtype_is_resolved_once_for_the_whole_run(tmp_path):
    from workers.tlt.models.linear import bf16_pays
    from workers.tlt.trainer import resolve_dtype

    data = preset("smollm2-mathmix-cpu").model_dump(mode="json")
    assert data["model"]["dtype"] == "auto"
    data["run"]["device"] = "cpu"
    cfg = load_config(data)
    trainer = Trainer(cfg, tmp_path, Tracking([]))
    assert trainer.cfg.model.dtype == trainer.cfg.grpo.compute_dtype == ("bfloat16" if bf16_pays() else "float32")
    assert resolve_dtype(cfg, "cuda").model.dtype == resolve_dtype(cfg, "cuda").grpo.compute_dtype == "bfloat16"
    data["model"]["dtype"] = data["grpo"]["compute_dtype"] = "float32"
    explicit = resolve_dtype(load_config(data), "cuda")  # an explicit dtype stays
    assert explicit.model.dtype == explicit.grpo.compute_dtype == "float32"


def test_a_static_drafter_run_speculates_but_never_trains_its_drafter(ray_local, tmp_path):
    data = tiny_cfg(steps=2).model_dump(mode="json")
    data["drafter"]["spot_training"] = False
    tracking = Tracking([JsonlSink(tmp_path / "metrics.jsonl")])
    trainer = Trainer(load_config(data), tmp_path, tracking)
    try:
        trainer.setup()
        warmed = {k: v.clone() for k, v in trainer.drafter_state.items()}
        trainer.run()
        assert sum(h.scalars["spec/verify_passes"] for h in trainer.history) > 0  # SD ran
        assert all(h.scalars["drafter/steps"] == 0 and h.scalars["idle/reclaimed_s"] == 0 for h in trainer.history)
        assert all(torch.equal(trainer.drafter_state[k], v) for k, v in warmed.items())  # frozen after warm-up
    finally:
        trainer.close()
        tracking.close()


def test_spot_training_on_demand_waits_until_the_drafter_goes_stale(ray_local, tmp_path):
    """drafter.spot_stale_drop > 0: steps before the drafter has a fresh level to fall from train
    nothing and lend their idle cores at once, yet keep their answers; a stale drafter trains again."""
    data = tiny_cfg(steps=3).model_dump(mode="json")
    data["drafter"]["spot_stale_drop"] = 0.2
    tracking = Tracking([JsonlSink(tmp_path / "metrics.jsonl")])
    trainer = Trainer(load_config(data), tmp_path, tracking)
    try:
        trainer.setup()
        warmed = {k: v.clone() for k, v in trainer.drafter_state.items()}
        for step in (1, 2):
            s = trainer.run_step().scalars
            assert s["drafter/spot_paused"] == 1.0 and s["drafter/steps"] == 0 and s["idle/reclaimed_s"] == 0
            assert {r.step for r in trainer.buffer.records} >= {step}  # the step's answers are kept
        assert all(torch.equal(trainer.drafter_state[k], v) for k, v in warmed.items())
        assert trainer.watch.version == trainer._drafter_version
        trainer.watch.readings = [3.0, 3.0, 1.0, 1.0]  # the drafter's chains fell from 3 tokens per pass to 1
        assert trainer.run_step().scalars["drafter/spot_paused"] == 0.0
    finally:
        trainer.close()
        tracking.close()


def test_each_step_keeps_a_few_responses_for_the_sample_viewer(tlt_run):
    _, history = tlt_run
    for h in history:
        samples = h.series["rollout/samples"]
        assert 1 <= len(samples) <= 8 and len({s["sample"] for s in samples}) == len(samples)
        for s in samples:
            toks = h.responses[s["sample"]]
            assert s["length"] == len(toks) == len(s["tokens"]) == len(s["from_draft"])
            assert s["reward"] == h.rewards[s["sample"]] and s["prompt"].startswith("sum ")
        lengths = [len(t) for t in h.responses]
        assert max(lengths) in [s["length"] for s in samples]  # the longest is always shown
    # SD ran in this run: some shown token came from an accepted draft
    assert any(f for h in history for s in h.series["rollout/samples"] for f in s["from_draft"])


def test_a_worker_decodes_on_lent_cores_only_for_the_step_they_were_lent_for(monkeypatch):
    from workers.tlt.cluster.rollout_workers import RolloutWorkerImpl
    from workers.tlt.models import cpu_kernels, linear

    if not cpu_kernels.available():
        pytest.skip("needs the gemv kernel (thread-invariant by construction)")
    cfg = tiny_cfg(tlt=False)
    policy = Transformer.from_pretrained(prepare_policy_folder(cfg))
    worker = RolloutWorkerImpl(0, policy.config, cfg, max_threads=2)
    assert linear.decode_threads() == (1, 2)  # its kernels are timed for the lent cores too
    worker.load_weights(policy.state_dict(), None)
    for layer in worker.policy.modules():
        if hasattr(layer, "kernel"):
            layer.kernel = "gemv"
    worker.policy._tlt_tuned = True
    prompts = [[1, 5, 6, 7]] * 3
    try:
        own = worker.rollout(3, prompts, [2], seed=0, tlt=False)
        assert own["metrics"]["borrowed_s"] == 0
        worker.lend_cores(2, 2)  # late, for a step that is over: ignored
        assert worker._cores == 1
        worker.lend_cores(3, 2)  # for the step in progress: its next decode steps take 2 threads
        lent = worker._generate(prompts, [2], seed=0, tlt=False)
        assert lent.metrics.borrowed_s > 0 and lent.tokens == own["tokens"]
        assert all(torch.equal(a, torch.tensor(b)) for a, b in zip(lent.logprobs, own["logprobs"]))
        again = worker.rollout(4, prompts, [2], seed=0, tlt=False)  # a new step starts on its own core
        assert again["metrics"]["borrowed_s"] == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("device,engine,lend,expected", [
    ("cpu", "builtin", True, {1: [(5, 1)], 2: [(5, 1)], 3: [(5, 1)]}),  # 4 workers, 2 cores: one each until 2 run
    ("cpu", "builtin", False, {}), ("cuda", "builtin", True, {}), ("cpu", "vllm", True, {})])
def test_the_driver_lends_finished_workers_cores_to_those_still_decoding(monkeypatch, device, engine, lend, expected):
    from types import SimpleNamespace

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    calls: dict[int, list] = {}

    def worker(j):
        return SimpleNamespace(lend_cores=SimpleNamespace(remote=lambda step, n: calls.setdefault(j, []).append((step, n))))

    data = tiny_cfg().model_dump(mode="json")
    data["rollout"].update(engine=engine, lend_idle_cores=lend)
    driver = SimpleNamespace(cfg=load_config(data), device=device, workers=[worker(j) for j in range(4)])
    Trainer._lend_cores(driver, 5, [{}, None, None, None])
    assert calls == expected
    if expected:
        Trainer._lend_cores(driver, 5, [{}, {}, None, None])
        Trainer._lend_cores(driver, 5, [{}, {}, {}, None])
        Trainer._lend_cores(driver, 5, [{}, {}, {}, {}])  # all in: nobody to lend to
        assert calls == {1: [(5, 1)], 2: [(5, 1), (5, 1)], 3: [(5, 1), (5, 1), (5, 2)]}


def test_a_finished_worker_keeps_its_core_while_it_trains_the_drafter(monkeypatch):
    """Spot training and a lent decode on one core slowed each other (README "Spot training and lent
    cores"): a finished worker's core goes to the tail only once its pack and spot updates are done."""
    from types import SimpleNamespace

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    calls: list = []
    lender = SimpleNamespace(lend_cores=SimpleNamespace(remote=lambda step, n: calls.append(("w0", n))))
    decoder = SimpleNamespace(lend_cores=SimpleNamespace(remote=lambda step, n: calls.append(("w1", n))))
    driver = SimpleNamespace(cfg=load_config(tiny_cfg().model_dump(mode="json")), device="cpu",
                             workers=[lender, decoder])
    Trainer._lend_cores(driver, 3, [{}, None], training={0})  # worker 0 packs, then trains
    Trainer._lend_cores(driver, 3, [{}, None], training={0, 1})  # a still-decoding worker's id is not a lent core
    Trainer._lend_cores(driver, 3, [{}, None], training=set())  # its spot budget spent: the core is lent
    Trainer._lend_cores(driver, 3, [{}, None], training={0})  # more data, another update: taken back
    assert calls == [("w1", 1), ("w1", 1), ("w1", 2), ("w1", 1)]
