"""Reads behind TLT's evidence: the A/B pair (speedups, Amdahl bound, reward parity), the drafter
registry (versions by content hash, model cards, latest), alerts and long-tail analytics.

Every function that takes a user checks the team role (through selectors.run_get_for_user or the
team's membership); the rest work on a run the caller already holds.
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any

import numpy as np
from django.contrib.auth.models import User
from django.db.models.fields.json import KeyTransform
from django.http import Http404

from tltweb.accounts.models import Member, Team
from tltweb.accounts.selectors import team_get_for_user
from tltweb.runs.models import Artifact, MetricStep, Run, RunAlert
from tltweb.runs.selectors import run_get_for_user

PARITY_ALPHA = 0.05  # "within noise": the paired sign-flip test does not reject at this level
PARITY_MIN_STEPS = 6  # below this, no sign pattern can reach p < 0.05 (2 / 2^5 = 0.0625): say so
PARITY_EXACT_UP_TO = 14  # steps up to which all 2^n sign patterns are enumerated; beyond, sampled
PARITY_SAMPLES = 20_000
PROMPT_LENGTHS = "rollout/prompt_lengths"
CURVE_KEYS = {"reward": "reward/mean", "accuracy": "reward/accuracy", "length": "rollout/len_mean"}


# ---- A/B pair ----

def run_partner(run: Run) -> Run | None:
    """The run's A/B partner: the run it was launched against, else the newest launched against it."""
    if run.ab_partner_id:
        partner = Run.objects.filter(pk=run.ab_partner_id, team_id=run.team_id).first()
        if partner is not None:
            return partner
    return Run.objects.filter(ab_partner=run, team_id=run.team_id).order_by("-created_at").first()


def run_pair_get_for_user(*, user: User, run_id: uuid.UUID | str) -> tuple[Run, Run, Member]:
    """(TLT run, baseline run, the user's membership) of the run's pair; 404 for outsiders or no pair."""
    run, member = run_get_for_user(user=user, run_id=run_id, need="view")
    partner = run_partner(run)
    if partner is None:
        raise Http404("this run has no A/B partner yet")
    tlt, base = (run, partner) if run.is_tlt else (partner, run)
    if tlt.is_tlt == base.is_tlt:  # a pair that was edited into two of a kind: not an A/B pair
        raise Http404("this run's partner has the same run.tlt: not an A/B pair")
    return tlt, base, member


def pair_speedup(run: Run) -> float | None:
    """The run list's "TLT speedup": its pair's e2e_speedup (as ab_summary defines it), None
    without a partner or before both runs timed a common step. Reads step times only."""
    partner = run_partner(run)
    if partner is None or partner.is_tlt == run.is_tlt:
        return None
    tlt, base = (run, partner) if run.is_tlt else (partner, run)

    def times(r: Run) -> dict[int, float]:
        rows = MetricStep.objects.filter(run=r).annotate(t=KeyTransform("timing_s/step", "scalars"))
        return {step: float(t) for step, t in rows.values_list("step", "t") if t}

    t, b = times(tlt), times(base)
    common = t.keys() & b.keys()
    step_t = sum(t[k] for k in common)
    return sum(b[k] for k in common) / step_t if step_t else None


def _rows(run: Run) -> list[dict[str, Any]]:
    return list(MetricStep.objects.filter(run=run).order_by("step").values("step", "scalars"))


def pair_curve(run: Run, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step: the curve keys (None where not measured: a gap) and the wall-clock time at the
    step's end (the trainer's summed step times, so queueing before the run started is left out)."""
    wall, t = [], 0.0
    for r in rows:
        t += float(r["scalars"].get("timing_s/step") or 0.0)
        wall.append(round(t, 3))
    return {
        "id": str(run.id), "name": run.name, "state": run.state, "tlt": run.is_tlt,
        "step": [r["step"] for r in rows], "wall_s": wall,
        **{name: [r["scalars"].get(key) for r in rows] for name, key in CURVE_KEYS.items()},
    }


def reward_parity(tlt: list[float], base: list[float], *, seed: int = 0) -> dict[str, Any]:
    """Paired sign-flip permutation test of the per-step reward differences d = TLT - baseline.

    H0: at every step either run could as well have produced either reward (TLT changes nothing), so
    each difference's sign is a coin flip. Statistic |mean d|; p = share of sign patterns (all 2^n up
    to PARITY_EXACT_UP_TO steps, else PARITY_SAMPLES sampled, seeded) whose |mean| is at least the
    observed one.
    "Within noise": p >= PARITY_ALPHA, i.e. the observed gap is no larger than what swapping the two
    runs' rewards at random steps gives in 95% of cases. Fewer than PARITY_MIN_STEPS paired steps:
    the test cannot reject at all, so the verdict is "too few steps" rather than a false reassurance.
    """
    d = [a - b for a, b in zip(tlt, base)]
    n = len(d)
    out: dict[str, Any] = {
        "test": "paired sign-flip permutation test on per-step mean reward (two-sided, statistic |mean difference|)",
        "alpha": PARITY_ALPHA, "steps": n, "mean_difference": None, "sd_difference": None, "p_value": None,
        "within_noise": None, "verdict": "too few steps", "min_steps": PARITY_MIN_STEPS,
    }
    if not n:
        return out
    x = np.asarray(d, dtype=np.float64)
    observed = abs(float(x.mean()))
    out["mean_difference"] = float(x.mean())
    out["sd_difference"] = statistics.stdev(d) if n > 1 else 0.0
    if n <= PARITY_EXACT_UP_TO:  # every sign pattern: bit j of pattern i flips difference j
        bits = (np.arange(2 ** n)[:, None] >> np.arange(n)[None, :]) & 1
        signs = 1 - 2 * bits
    else:
        signs = np.random.default_rng(seed).choice(np.array([1, -1]), size=(PARITY_SAMPLES, n))
    means = np.abs(signs @ x) / n  # the pollers ask often: one matrix product, not a Python loop
    p = float(np.mean(means >= observed - 1e-12))
    out["p_value"] = p
    if n >= PARITY_MIN_STEPS:
        out["within_noise"] = p >= PARITY_ALPHA
        out["verdict"] = "within noise" if p >= PARITY_ALPHA else "differs"
    return out


def _total(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r["scalars"].get(key) or 0.0) for r in rows)


def ab_summary(*, tlt: Run, base: Run) -> dict[str, Any]:
    """The pair's curves and measured figures (None where a figure cannot be measured yet).

    Over the steps both runs recorded: e2e_speedup = baseline step time / TLT step time;
    rollout_speedup s = the same for the rollout phase; rollout_share r = the baseline's rollout
    time / its step time; amdahl_bound = 1 / ((1 - r) + r / s), the most end to end can gain from
    that rollout speedup; e2e_efficiency = e2e_speedup / amdahl_bound; idle worker-seconds and the
    part reclaimed for drafter training are the TLT run's totals.
    """
    rows_t, rows_b = _rows(tlt), _rows(base)
    by_t = {r["step"]: r for r in rows_t}
    by_b = {r["step"]: r for r in rows_b}
    common = sorted(s for s in by_t.keys() & by_b.keys()
                    if by_t[s]["scalars"].get("timing_s/step") and by_b[s]["scalars"].get("timing_s/step"))
    ct, cb = [by_t[s] for s in common], [by_b[s] for s in common]
    step_t, step_b = _total(ct, "timing_s/step"), _total(cb, "timing_s/step")
    roll_t, roll_b = _total(ct, "timing_s/rollout"), _total(cb, "timing_s/rollout")
    e2e = step_b / step_t if step_t else None
    s = roll_b / roll_t if roll_t and roll_b else None
    r = roll_b / step_b if step_b else None
    bound = 1.0 / ((1.0 - r) + r / s) if r is not None and s else None
    idle = _total(rows_t, "idle/worker_s")
    reclaimed = _total(rows_t, "idle/reclaimed_s")
    paired = [(by_t[k]["scalars"].get("reward/mean"), by_b[k]["scalars"].get("reward/mean"))
              for k in sorted(by_t.keys() & by_b.keys())]
    paired = [(a, b) for a, b in paired if a is not None and b is not None]
    return {
        "tlt": pair_curve(tlt, rows_t),
        "baseline": pair_curve(base, rows_b),
        "steps_compared": len(common),
        "e2e_speedup": e2e,
        "rollout_speedup": s,
        "rollout_share": r,
        "amdahl_bound": bound,
        "e2e_efficiency": e2e / bound if e2e is not None and bound else None,
        "idle_worker_s": idle,
        "idle_reclaimed_s": reclaimed,
        "idle_reclaimed_frac": reclaimed / idle if idle else None,
        "logprob_mismatch_max": {
            "tlt": max((float(x["scalars"]["rollout/logprob_mismatch_max"]) for x in rows_t
                        if x["scalars"].get("rollout/logprob_mismatch_max") is not None), default=None),
            "baseline": max((float(x["scalars"]["rollout/logprob_mismatch_max"]) for x in rows_b
                             if x["scalars"].get("rollout/logprob_mismatch_max") is not None), default=None),
        },
        "reward_parity": reward_parity([a for a, _ in paired], [b for _, b in paired]),
    }


# ---- alerts ----

def run_alerts(*, run: Run) -> list[RunAlert]:
    return list(RunAlert.objects.filter(run=run).order_by("created_at"))


def alert_out(alert: RunAlert) -> dict[str, Any]:
    return {"kind": alert.kind, "title": alert.get_kind_display(), "message": alert.message, "step": alert.step,
            "created_at": alert.created_at, "webhook": alert.webhook_state or None}


# ---- drafter registry ----

def _card(artifact: Artifact) -> dict[str, Any] | None:
    card = (artifact.meta or {}).get("model_card")
    return card if isinstance(card, dict) else None


def drafter_latest(*, run: Run) -> Artifact | None:
    return Artifact.objects.filter(run=run, kind="drafter").order_by("-step").first()


def drafter_versions(*, run: Run) -> list[dict[str, Any]]:
    """The run's drafter checkpoints grouped by content hash, newest version first: each version's
    steps, its newest checkpoint (what a download gets) and that checkpoint's model card."""
    versions: dict[str, dict[str, Any]] = {}
    for a in Artifact.objects.filter(run=run, kind="drafter").order_by("step"):
        key = a.content_sha256 or a.sha256
        v = versions.setdefault(key, {"content_sha256": key, "steps": [], "artifacts": []})
        v["steps"].append(a.step)
        v["artifacts"].append(a)
    out = []
    for v in versions.values():
        newest = v["artifacts"][-1]
        out.append({"content_sha256": v["content_sha256"], "steps": v["steps"], "first_step": v["steps"][0],
                    "last_step": v["steps"][-1], "artifact": newest, "model_card": _card(newest)})
    out.sort(key=lambda v: v["last_step"], reverse=True)
    for i, v in enumerate(reversed(out), start=1):
        v["version"] = i
    return out


def base_model(run: Run, card: dict[str, Any] | None) -> str:
    """What a drafter drafts for: the card's target model, else the run's model source (path for hf)."""
    if card and card.get("target_model"):
        return str(card["target_model"])
    model = (run.config or {}).get("model") or {}
    if model.get("source") == "hf" and model.get("path"):
        return f"hf:{model['path'].rstrip('/').rsplit('/', 1)[-1]}"
    return str(model.get("source") or "unknown")


def team_drafters_for_user(*, user: User, team_id: int) -> tuple[Team, list[dict[str, Any]]]:
    """The team's drafter versions by base model: [{base_model, versions: [{run, version...}]}],
    each base model's newest version first. 404 for non-members."""
    team, _ = team_get_for_user(user=user, team_id=team_id, need="view")
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in Run.objects.filter(team_id=team_id, artifacts__kind="drafter").distinct().order_by("-created_at"):
        for v in drafter_versions(run=run):
            groups.setdefault(base_model(run, v["model_card"]), []).append({**v, "run": run})
    out = [{"base_model": name, "versions": sorted(vs, key=lambda v: v["artifact"].created_at, reverse=True)}
           for name, vs in sorted(groups.items())]
    return team, out


# ---- long-tail analytics ----

def prompt_length_history(*, run: Run, top: int = 10) -> list[dict[str, Any]]:
    """The prompts that most often produce the step's longest answers, from the series
    rollout/prompt_lengths: per prompt, the steps it was drawn in, its longest sample each time,
    and how often it held the step's longest answer; most such steps first, then longest mean."""
    prompts: dict[str, dict[str, Any]] = {}
    rows = (MetricStep.objects.filter(run=run).order_by("step")
            .annotate(groups=KeyTransform(PROMPT_LENGTHS, "series")).values_list("step", "groups"))
    for step, groups in rows:  # only that series is read from the database, not the step's others
        groups = groups if isinstance(groups, list) else []
        groups = [g for g in groups if isinstance(g, dict) and g.get("lengths")]
        if not groups:
            continue
        longest = max(max(g["lengths"]) for g in groups)
        for g in groups:
            p = prompts.setdefault(str(g.get("prompt")), {"prompt": str(g.get("prompt")), "text": g.get("text", ""),
                                                          "steps": [], "max_length": [], "longest_count": 0})
            p["steps"].append(step)
            p["max_length"].append(max(g["lengths"]))
            p["longest_count"] += int(max(g["lengths"]) == longest)
    out = sorted(prompts.values(), key=lambda p: (-p["longest_count"], -statistics.mean(p["max_length"])))
    for p in out:
        p["mean_max_length"] = statistics.mean(p["max_length"])
        p["history"] = list(zip(p["steps"], p["max_length"]))
    return out[:top]
