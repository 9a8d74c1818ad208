"""The end-to-end benchmark: `python -m workers.tlt.bench e2e` (the CLI is cli.py).

e2e trains the same config, same seed, in one invocation on the same machine and Ray instance, as
two or three arms: the baseline (run.tlt false: no SD, no spot training), TLT, and (with
--static-drafter, the default for presets that list it) TLT with the drafter frozen after its
warm-up (the paper's stale-drafter control). Sampling is keyed by (seed, sample, position), so
the arms draw the same responses (up to float rounding) and their learners do the same work: the
step-time ratio is TLT's own effect. It reports

    e2e_speedup          baseline mean step time / TLT mean step time
    rollout_share        rollout time / step time in the baseline (the part TLT can shrink): r
    rollout_speedup      baseline / TLT mean rollout time: s
    amdahl_bound         1 / ((1 - r) + r / s): the end-to-end speedup a rollout speedup s allows
    e2e_efficiency       e2e_speedup / amdahl_bound (1: TLT costs nothing outside the rollout)
    idle_reclaimed_frac  idle worker-seconds used for drafter training, TLT run (spot_paused_steps_tlt:
                         the steps that trained nothing because the drafter had not gone stale)
    acceptance_length    mean tokens per verify pass while SD was on, TLT run (and per step; and
                         *_static for the frozen drafter)
    acceptance_by_kind   the same per kind of draft that ran: the drafter's chains and trees, n-grams
    chain4_acceptance    the same with the arm held fixed (a 4-deep chain at the measured rates per
                         position): the bandit's picks differ between arms and a deeper arm emits
                         more per pass, so the adapted and the static drafter compare on this one
    reward_by_step_*     each arm's reward curve; reward_rise_* = mean of the last fifth of the
                         steps minus the first fifth's
    profile_s            mean seconds per step of each phase (sync, rollout, its tail, learner), every arm,
                         the decode seconds workers ran on cores finished peers lent them
                         (rollout_borrowed), and the learner's share of its cores' time per step (below 1:
                         it waited for cores)
    setup_s / wall_s     one-off costs outside the steps (policy, drafter warm-up, actors); whole runs
    cpu, loadavg_*       the machine: figures from a shared machine are only as good as its load
    dtype                the rollout's dtype (model.dtype; bfloat16 takes oneDNN kernels where the CPU has them)
    kernels              per arm and rollout worker, the few-row kernel each policy (and drafter) layer
                         shape decoded with (linear.chosen_kernels): the tuner chooses them per machine,
                         and a choice that favours verify passes slows the baseline's plain decoding
    decode_check         CPU runs, after the arms: the baseline's few-row passes (rollout/passes_by_rows:
                         how many at each thread count and product size) timed on those kernels against
                         each kernel the tuner could have given every layer (bench verify's
                         decode_check); `tuned_vs_fastest` above FAIR_DECODE is warned about: the
                         baseline was handicapped

The baseline is the strong one: the same engine and batching (finished rows leave the batch),
SD and spot training off. Step means skip the first step (one-off warm-up costs). Progress, with
an ETA, goes to stderr.

Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from .progress import PhaseProgress

log = logging.getLogger("workers.tlt.bench")

FAIR_DECODE = 1.05  # decode_check: the baseline's passes slower on the tuned kernels than on the fastest by more: flagged
CHECK_PASSES = 12  # decode_check's timed passes per product size (a baseline ran up to ~20 sizes per thread count)
# presets whose e2e runs the static-drafter arm unless told otherwise (it costs a third run)
STATIC_BY_DEFAULT = {"smollm2-mathmix-cpu"}
ARMS = {  # arm -> config overrides on top of the preset
    "baseline": {"run": {"tlt": False}},
    "tlt": {"run": {"tlt": True}},
    "static": {"run": {"tlt": True}, "drafter": {"spot_training": False}},
}
ARM_FILE = "arm.json"  # beside an arm's metrics.jsonl: its setup and wall seconds, and its error if it failed
CHECK_FILE = "decode_check.json"  # beside the arms' folders: decode_check's figures


# --- e2e --------------------------------------------------------------------------------------


class _Eta:
    """A metrics sink that prints one progress line per step to stderr, with an ETA for the bench."""

    def __init__(self, arm: str, steps: int, total_steps: int, done_before: int, started: float, one_off_s: float = 0.0):
        self.arm, self.steps, self.total, self.done, self.started = arm, steps, total_steps, done_before, started
        # seconds of drafter warm-up so far: paid once (the next arm loads the cached drafter in a
        # second), so they stay out of the per-step rate the ETA extrapolates
        self.one_off_s = one_off_s
        self._setup = PhaseProgress(f"[bench e2e] {arm} setup")

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        self.done += 1
        per_step = (time.perf_counter() - self.started - self.one_off_s) / self.done  # the other setups included
        eta = per_step * (self.total - self.done)
        print(f"[bench e2e] {self.arm} step {step}/{self.steps}: reward {scalars.get('reward/mean', 0):.3f}, "
              f"{scalars.get('timing_s/step', 0):.1f} s (rollout {scalars.get('timing_s/rollout', 0):.1f} s), "
              f"acceptance {scalars.get('spec/acceptance_length', 0):.2f}; ETA {eta / 60:.1f} min",
              file=sys.stderr, flush=True)

    def artifact(self, kind: str, step: int, path: Path) -> None:
        pass

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        """Setup phases (bench/progress.py); the RL steps have their own lines (log)."""
        if phase != "rl":
            self._setup(phase, done, total, message)

    def close(self) -> None:
        pass


def _train(cfg, out: Path, eta: _Eta) -> dict[str, Any]:
    """Run one config (its steps' metrics go to out/metrics.jsonl); returns its setup seconds (policy,
    drafter_warmup, actors) and each worker's kernels."""
    from ..metrics import JsonlSink, Tracking
    from ..trainer import Trainer

    tracking = Tracking([eta, JsonlSink(out / "metrics.jsonl")])
    trainer = Trainer(cfg, out, tracking)
    try:
        trainer.setup()
        eta.one_off_s += trainer.setup_s.get("drafter_warmup", 0.0)
        trainer.run()
        return {"setup_s": dict(trainer.setup_s), "kernels": {str(w): k for w, k in trainer.kernels.items()}}
    finally:
        trainer.close()
        tracking.close()


def _mean(rows: list[dict[str, float]], key: str, skip: int = 0) -> float:
    vals = [r[key] for r in rows[skip:] if key in r] or [r[key] for r in rows if key in r]
    return float(sum(vals) / len(vals)) if vals else 0.0


def _fifths(curve: list[float]) -> tuple[float, float]:
    """Means of the first and the last fifth of a curve (at least one point each)."""
    k = max(1, len(curve) // 5)
    return sum(curve[:k]) / k, sum(curve[-k:]) / k


def _by_kind(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean acceptance per step of each kind of draft that ran (drafter chain, tree, n-gram)."""
    from ..rollout.speculative import SpecStats

    return {kind: round(_mean(rows, f"spec/acceptance_{kind}"), 3) for kind in SpecStats.KINDS
            if any(f"spec/acceptance_{kind}" in r for r in rows)}


def amdahl_bound(rollout_share: float, rollout_speedup: float) -> float:
    """1 / ((1 - r) + r / s): the end-to-end speedup a rollout speedup s allows when rollout is r of a step."""
    if rollout_speedup <= 0:
        return 0.0
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_speedup)


def e2e(preset_name: str, steps: int | None, out: Path, overrides: dict[str, dict[str, Any]] | None = None,
        warm_skip: int = 1, static: bool | None = None) -> dict[str, Any]:
    """The arms on one Ray instance; returns the figures (see the module doc)."""
    import ray

    from ..config import load_config, preset
    from ..trainer import ensure_ray, resolve_device
    from .verify import decode_check

    if stale := sorted(name for name in ARMS if (out / name).exists()):
        raise SystemExit(f"bench e2e: {out} already holds arms {', '.join(stale)} (a run there would resume "
                         "them): pass a new --out, or --summarize it")
    base = preset(preset_name, overrides)
    data = base.model_dump(mode="json")
    if steps is not None:
        data["run"]["steps"] = steps
    data["run"]["checkpoint_interval"] = 0
    arms = ["baseline", "tlt"] + (["static"] if (preset_name in STATIC_BY_DEFAULT if static is None else static) else [])
    n_steps = data["run"]["steps"]
    load_start = os.getloadavg()
    started = ensure_ray(num_cpus=max(data["rollout"]["num_workers"], os.cpu_count() or 1))
    t_bench = time.perf_counter()
    try:
        warmup_s = 0.0
        for i, name in enumerate(arms):
            d = json.loads(json.dumps(data))
            for section, values in ARMS[name].items():
                d[section].update(values)
            t = time.perf_counter()
            eta = _Eta(name, n_steps, n_steps * len(arms), i * n_steps, t_bench, one_off_s=warmup_s)
            arm: dict[str, Any] = {"setup_s": {}}
            try:
                arm.update(_train(load_config(d), out / name, eta))
            except Exception as exc:  # noqa: BLE001 - the other arms and the steps this one logged still count
                log.exception("%s arm failed", name)
                arm["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            arm["wall_s"] = round(time.perf_counter() - t, 1)
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / ARM_FILE).write_text(json.dumps(arm))
            warmup_s += arm["setup_s"].get("drafter_warmup", 0.0)
            log.info("%s: %.1fs (setup %s)%s", name, arm["wall_s"], {k: round(v, 1) for k, v in arm["setup_s"].items()},
                     f"; failed: {arm['error']}" if "error" in arm else "")
    finally:
        if started:
            ray.shutdown()
    if resolve_device(base) == "cpu":
        print("[bench e2e] timing the baseline's passes on the tuned and the other kernels (decode_check)", file=sys.stderr, flush=True)
        check = decode_check(base, arm_passes(out / "baseline"), passes=CHECK_PASSES)
        (out / CHECK_FILE).write_text(json.dumps(check))
        if check["tuned_vs_fastest"] > FAIR_DECODE:
            log.warning("the baseline's passes ran %.0f%% slower on its kernels than on the fastest here (decode_check): this "
                        "A/B favours TLT", (check["tuned_vs_fastest"] - 1) * 100)
    result = summarize(out, preset_name, warm_skip, arms)
    result.update(loadavg_start=[round(x, 2) for x in load_start], bench_s=round(time.perf_counter() - t_bench, 1))
    return result


def _arm_records(folder: Path) -> list[dict[str, Any]]:
    """The step records an arm's run logged (metrics.jsonl; none where it logged nothing)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arm_passes(folder: Path) -> dict[str, dict[str, int]]:
    """The target passes an arm's rollouts ran over all its steps, {threads: {rows: passes}}."""
    from ..rollout.engine import sum_passes

    return sum_passes([r["series"].get("rollout/passes_by_rows", {}) for r in _arm_records(folder) if "series" in r])


def arm_rows(folder: Path) -> list[dict[str, float]]:
    """An arm's scalars per step, as its run logged them (metrics.jsonl): what a failed arm finished counts."""
    return [r["scalars"] for r in _arm_records(folder) if "scalars" in r]


def summarize(out: Path, preset_name: str, warm_skip: int = 1, arms: list[str] | None = None) -> dict[str, Any]:
    """The figures (module doc) from the arms' folders under `out`, as e2e left them (`arms`: those
    it ran; default: every arm folder there); also what `bench e2e --summarize OUT` prints for a
    bench that was cut short. Needs steps of both the baseline and the TLT arm; a failed arm is
    named in `failed_arms`, with what it logged before it failed."""
    from ..config import load_config
    from ..models.linear import cpu_flags, cpu_name

    arms = arms or [name for name in ARMS if (out / name).exists()]
    runs = {name: arm_rows(out / name) for name in arms}
    info = {name: json.loads(p.read_text()) if (p := out / name / ARM_FILE).exists() else {} for name in arms}
    if not runs.get("baseline") or not runs.get("tlt"):
        raise RuntimeError(f"bench e2e: {out} holds no steps of the baseline or the TLT arm "
                           f"({ {n: info[n].get('error', f'{len(runs[n])} steps') for n in arms} })")
    setup = {name: info[name].get("setup_s", {}) for name in arms}
    wall = {name: info[name].get("wall_s", 0.0) for name in arms}
    cfg = load_config((out / "tlt" / "config.yaml").read_text()) if (out / "tlt" / "config.yaml").exists() else None
    b, t = runs["baseline"], runs["tlt"]
    skip = warm_skip if len(b) > warm_skip else 0  # the first step pays one-off warm-up costs
    base_step, tlt_step = _mean(b, "timing_s/step", skip), _mean(t, "timing_s/step", skip)
    base_roll, tlt_roll = _mean(b, "timing_s/rollout", skip), _mean(t, "timing_s/rollout", skip)
    e2e_speedup = base_step / tlt_step if tlt_step > 0 else 0.0
    share = base_roll / base_step if base_step > 0 else 0.0
    rollout_speedup = base_roll / tlt_roll if tlt_roll > 0 else 0.0
    bound = amdahl_bound(share, rollout_speedup)
    # where the step time goes (mean seconds per step, after the skipped warm-up steps)
    phases = ("sync", "rollout", "reward", "learner", "buffer")
    profile = {name: {p: round(_mean(rows, f"timing_s/{p}", skip), 4) for p in phases} for name, rows in runs.items()}
    for name, rows in runs.items():
        profile[name]["rollout_tail"] = round(_mean(rows, "rollout/tail_s", skip), 4)
        profile[name]["rollout_borrowed"] = round(_mean(rows, "rollout/borrowed_s", skip), 4)  # on lent cores
        # a learner that waited for cores makes its arm's steps slower through no fault of SD's
        profile[name]["learner_cpu_share_by_step"] = [round(r.get("learner/cpu_share", 0.0), 2) for r in rows]
    curves = {name: [round(r["reward/mean"], 4) for r in rows] for name, rows in runs.items()}
    acceptance = {name: [round(r.get("spec/acceptance_length", 0.0), 3) for r in rows] for name, rows in runs.items()}
    chain4 = {name: [round(r.get("spec/chain4_acceptance", 0.0), 3) for r in rows] for name, rows in runs.items()}
    result: dict[str, Any] = {
        "bench": "e2e",
        "preset": preset_name,
        "arms": arms,
        "steps": len(t),
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cpus": os.cpu_count(),
        "dtype": cfg.model.dtype if cfg is not None else "",  # the rollout's, as the run resolved it
        "kernels": {name: info[name].get("kernels", {}) for name in arms},
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "e2e_speedup": e2e_speedup,
        "step_s_baseline": base_step,
        "step_s_tlt": tlt_step,
        "rollout_share": share,
        "rollout_share_tlt": tlt_roll / tlt_step if tlt_step > 0 else 0.0,
        "rollout_speedup": rollout_speedup,
        "amdahl_bound": bound,
        "e2e_efficiency": e2e_speedup / bound if bound > 0 else 0.0,
        "idle_reclaimed_frac": (sum(r["idle/reclaimed_s"] for r in t) / max(sum(r["idle/worker_s"] for r in t), 1e-9)),
        "idle_worker_s_tlt": sum(r["idle/worker_s"] for r in t),
        "acceptance_length": _mean(t, "spec/acceptance_length"),
        "acceptance_by_step": acceptance["tlt"],
        "chain4_acceptance": _mean(t, "spec/chain4_acceptance"),
        "chain4_acceptance_by_step": chain4["tlt"],
        "acceptance_by_kind": _by_kind(t),
        "tail_tokens_per_s_sd": _mean(t, "rollout/tail_tokens_per_s_sd"),
        "tail_tokens_per_s_no_sd": _mean(b, "rollout/tail_tokens_per_s_no_sd"),
        "reward_tlt": _mean(t, "reward/mean"),
        "reward_baseline": _mean(b, "reward/mean"),
        "logprob_mismatch_max_tlt": max((r.get("rollout/logprob_mismatch_max", 0.0) for r in t), default=0.0),
        "drafter_steps_tlt": sum(r.get("drafter/steps", 0.0) for r in t),
        "drafter_accuracy_by_step": [round(r.get("drafter/accuracy", 0.0), 3) for r in t],
        "drafter_updates_tlt": sum(r.get("drafter/updates", 0.0) for r in t),
        "drafter_dropped_updates_tlt": sum(r.get("drafter/dropped_updates", 0.0) for r in t),
        # steps whose spot training waited for a stale drafter (drafter.spot_stale_drop)
        "spot_paused_steps_tlt": [i for i, r in enumerate(t, 1) if r.get("drafter/spot_paused")],
        "len_p50_by_step": [int(r.get("rollout/len_p50", 0)) for r in b],
        "len_max_by_step": [int(r.get("rollout/len_max", 0)) for r in b],
        "profile_s": profile,
        # one-off costs outside the steps: the policy (cached after the first run), the TLT
        # drafter's offline warm-up (cached too), actor start; and each arm's whole wall time
        "setup_s": {name: {k: round(v, 2) for k, v in st.items()} for name, st in setup.items()},
        "wall_s": wall,
    }
    if failed := {name: info[name]["error"] for name in arms if "error" in info[name]}:
        result["failed_arms"] = failed
    for name in arms:
        first, last = _fifths(curves[name])
        result[f"reward_by_step_{name}"] = curves[name]
        result[f"reward_rise_{name}"] = round(last - first, 4)
    if runs.get("static"):
        s_rows = runs["static"]
        result["acceptance_length_static"] = _mean(s_rows, "spec/acceptance_length")
        result["acceptance_by_step_static"] = acceptance["static"]
        result["acceptance_last_fifth_tlt"] = round(_fifths(acceptance["tlt"])[1], 3)
        result["acceptance_last_fifth_static"] = round(_fifths(acceptance["static"])[1], 3)
        # the drafters compared with the arm held fixed (acceptance_length mixes the bandit's picks)
        result["chain4_acceptance_static"] = _mean(s_rows, "spec/chain4_acceptance")
        result["acceptance_by_kind_static"] = _by_kind(s_rows)
        result["chain4_acceptance_by_step_static"] = chain4["static"]
        result["chain4_last_fifth_tlt"] = round(_fifths(chain4["tlt"])[1], 3)
        result["chain4_last_fifth_static"] = round(_fifths(chain4["static"])[1], 3)
        result["step_s_static"] = _mean(s_rows, "timing_s/step", skip)
    if (check := out / CHECK_FILE).exists():
        result["decode_check"] = json.loads(check.read_text())
    return result


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """["drafter.lr=2e-3", "spec.strategies=[[4,1,4]]"] -> {"drafter": {"lr": ...}, "spec": {...}}
    (values are YAML; the config validates them and names a bad field)."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not (sep and dot and section and field):
            raise SystemExit(f"--set {item!r}: expected section.field=value")
        out.setdefault(section, {})[field] = yaml.safe_load(value)
    return out
