"""Reads for runs, metrics and artifacts. Every read that takes a user checks the team role."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import (Count, DurationField, Exists, ExpressionWrapper, F, FloatField, OuterRef, Q, QuerySet,
                              Subquery, Value)
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Now
from django.http import Http404
from django.utils import timezone

from tltweb.accounts.models import Member
from tltweb.accounts.services import token_matches
from tltweb.runs.errors import RunFinished
from tltweb.runs.models import Artifact, MetricStep, RolloutSample, Run, RunAlert

# Sort keys of the run list (API `sort`, page `?sort=`); "-" in front sorts descending.
RUN_SORTS = {
    "created": "created_at", "name": "name", "state": "state", "duration": "duration",
    "step": "last_step", "reward": "latest_reward", "acceptance": "latest_acceptance",
}
PHASE_LABELS = {
    "policy": "Policy preparation (SFT)", "drafter_warmup": "Drafter warm-up", "actors": "Starting actors",
    "rl": "RL training",
}


def _member(user: User, team_id: int) -> Member | None:
    if not user.is_authenticated:
        return None
    return Member.objects.filter(user=user, team_id=team_id).first()


def run_get_for_user(*, user: User, run_id: uuid.UUID | str, need: str = "view") -> tuple[Run, Member]:
    """The run and the user's membership: 404 for outsiders (and unknown ids), 403 for a too-low role."""
    try:
        run = Run.objects.select_related("team", "creator").get(pk=run_id)
    except (Run.DoesNotExist, ValueError, TypeError, ValidationError):  # ValidationError: not a UUID
        raise Http404("no such run") from None
    member = _member(user, run.team_id)
    if member is None:
        raise Http404("no such run")
    if not member.allows(need):
        raise PermissionDenied(f"needs {need} access")
    return run, member


def run_get_for_ingest(*, run_id: uuid.UUID | str, token: str) -> Run:
    """The run a trainer's token belongs to.

    PermissionDenied for an unknown run or a wrong token (the same answer: run ids are not secrets,
    but no oracle either); RunFinished when the token is right but was revoked because the run
    reached a final state (its metrics and artifacts are immutable from then on).
    """
    try:
        run = Run.objects.filter(pk=run_id).first()
    except (ValueError, TypeError, ValidationError):  # not a UUID (the API's URL patterns only pass UUIDs)
        run = None
    if run is None or not run.ingest_token_hash or not token_matches(token, run.ingest_token_hash):
        raise PermissionDenied("wrong run token")
    if run.ingest_token_revoked_at is not None:
        raise RunFinished(f"this run has ended ({run.state}) and its ingestion token is revoked: "
                          "its metrics and artifacts are immutable")
    return run


def artifact_get_for_user(*, user: User, run_id: uuid.UUID | str, artifact_id: int) -> Artifact:
    run, _ = run_get_for_user(user=user, run_id=run_id, need="view")
    artifact = Artifact.objects.filter(run=run, pk=artifact_id).first()
    if artifact is None:
        raise Http404("no such artifact")
    return artifact


def _latest(key: str) -> Subquery:
    """The newest step's scalar `key` as a float column (for the run list's columns and sorts)."""
    rows = MetricStep.objects.filter(run=OuterRef("pk")).order_by("-step")
    value = Cast(KeyTextTransform(key, "scalars"), FloatField())
    return Subquery(rows.annotate(v=value).values("v")[:1], output_field=FloatField())


def run_list_for_user(
    *,
    user: User,
    state: str = "",
    tag: str = "",
    creator: str = "",
    preset: str = "",
    q: str = "",
    team_id: int | None = None,
    sort: str = "-created",
) -> QuerySet[Run]:
    """The user's runs, filtered, with the list's live columns annotated: last_step,
    latest_reward, latest_acceptance (the newest step's scalars) and duration."""
    if any("\x00" in value for value in (state, tag, creator, preset, q)):
        return Run.objects.none()  # nothing stored contains NUL (and PostgreSQL refuses it in a query)
    runs = Run.objects.select_related("team", "creator").filter(team__members__user=user)
    if team_id:
        runs = runs.filter(team_id=team_id)
    if state:
        runs = runs.filter(state=state)
    if tag:
        runs = runs.filter(tags__contains=[tag]) if _json_contains_ok() else runs.filter(tags__icontains=f'"{tag}"')
    if creator:
        runs = runs.filter(creator__username=creator)
    if preset:
        runs = runs.filter(preset=preset)
    if q:
        runs = runs.filter(Q(name__icontains=q) | Q(notes__icontains=q) | Q(tags__icontains=q))
    runs = runs.distinct().annotate(
        last_step=Subquery(MetricStep.objects.filter(run=OuterRef("pk")).order_by("-step").values("step")[:1]),
        latest_reward=_latest("reward/mean"),
        latest_acceptance=_latest("spec/acceptance_length"),
        has_ab_partner=Exists(Run.objects.filter(ab_partner=OuterRef("pk"))),  # launched against it
        alert_count=Coalesce(Subquery(RunAlert.objects.filter(run=OuterRef("pk")).values("run").annotate(n=Count("pk"))
                                       .values("n")[:1]), Value(0)),
        duration=ExpressionWrapper(Coalesce(F("finished_at"), Now()) - F("started_at"), output_field=DurationField()),
    )
    desc = sort.startswith("-")
    column = RUN_SORTS.get(sort.lstrip("-"), "created_at")
    order = F(column).desc(nulls_last=True) if desc else F(column).asc(nulls_last=True)
    return runs.order_by(order, "-created_at")


def run_alert_count(run: Run) -> int:
    """Alerts raised on the run (the run list's badge): the list's annotation when present."""
    count = getattr(run, "alert_count", None)
    return int(count) if count is not None else RunAlert.objects.filter(run=run).count()


def run_sort_valid(sort: str) -> bool:
    return sort.lstrip("-") in RUN_SORTS


def run_live(run: Run) -> dict[str, Any]:
    """What the run list shows live: progress step/total, phase, duration, latest reward and
    acceptance, and the TLT speedup of its A/B pair. Reads the annotations of run_list_for_user
    when present, else queries."""
    from tltweb.runs.evidence import pair_speedup  # evidence reads through these selectors
    if not hasattr(run, "last_step"):
        last = MetricStep.objects.filter(run=run).order_by("-step").values("step", "scalars").first()
        run.last_step = last["step"] if last else None
        run.latest_reward = (last or {}).get("scalars", {}).get("reward/mean")
        run.latest_acceptance = (last or {}).get("scalars", {}).get("spec/acceptance_length")
    total = int(((run.config or {}).get("run") or {}).get("steps") or 0) or None
    progress = run_progress(run)
    if run.started_at:
        end = run.finished_at or timezone.now()
        duration_s: float | None = max(0.0, (end - run.started_at).total_seconds())
    else:
        duration_s = None
    if not run.is_active:
        phase = ""  # the state column says how it ended
    elif progress and progress["phase"] != "rl":
        phase = progress["label"]  # setup: SFT, drafter warm-up, actors
    elif progress or run.last_step is not None:
        phase = PHASE_LABELS["rl"]
    else:
        phase = "waiting for the trainer" if run.submitted_at else "queued"
    setup = run.is_active and progress is not None and progress["phase"] != "rl"
    return {
        "step": run.last_step,
        "steps_total": total,
        "phase": phase,
        "phase_fraction": progress["fraction"] if setup else None,
        "progress": progress,
        "duration_s": duration_s,
        "reward": run.latest_reward,
        "acceptance": run.latest_acceptance,
        "tlt_speedup": pair_speedup(run) if run.ab_partner_id or getattr(run, "has_ab_partner", True) else None,
    }


def run_progress(run: Run) -> dict[str, Any] | None:
    """The trainer's latest progress with what the page shows: label, fraction, elapsed and ETA.

    The ETA comes from the phase's rate so far: (done - done at the phase's start) / elapsed.
    """
    p = run.progress or {}
    if not p.get("phase"):
        return None
    done, total = int(p.get("done", 0)), int(p.get("total", 0))
    began = datetime.fromisoformat(p["began_at"])
    updated = datetime.fromisoformat(p["updated_at"])
    elapsed = max(0.0, ((timezone.now() if run.is_active else updated) - began).total_seconds())
    ran = max(0.0, (updated - began).total_seconds())
    rate = (done - int(p.get("began_done", 0))) / ran if ran > 0 else 0.0
    eta = (total - done) / rate if rate > 0 and total > done and run.is_active else None
    return {
        "phase": p["phase"],
        "label": PHASE_LABELS.get(p["phase"], p["phase"]),
        "done": done,
        "total": total,
        "fraction": min(1.0, done / total) if total > 0 else None,
        "message": p.get("message", ""),
        "elapsed_s": round(elapsed, 1),
        "rate_per_s": round(rate, 4) if rate > 0 else None,
        "eta_s": round(eta, 1) if eta is not None else None,
        "updated_at": p["updated_at"],
        "history": [
            {**h, "label": PHASE_LABELS.get(h["phase"], h["phase"])} for h in p.get("history", [])
        ],
    }


def _json_contains_ok() -> bool:
    from django.db import connection

    return connection.vendor == "postgresql"


def run_filter_choices(*, user: User) -> dict[str, list[str]]:
    runs = Run.objects.filter(team__members__user=user)
    tags: set[str] = set()
    for row in runs.values_list("tags", flat=True):
        tags.update(row or [])
    return {
        "creators": sorted({u for u in runs.values_list("creator__username", flat=True) if u}),
        "presets": sorted({p for p in runs.values_list("preset", flat=True) if p}),
        "tags": sorted(tags),
    }


def metrics_scalars(*, run: Run, since: int = -1) -> list[dict[str, Any]]:
    """[{"step", "scalars"}] for steps after `since`, in order (what the charts extend)."""
    rows = MetricStep.objects.filter(run=run, step__gt=since).order_by("step").values("step", "scalars")
    return list(rows)


def metrics_series(*, run: Run, step: int) -> dict[str, Any] | None:
    row = MetricStep.objects.filter(run=run, step=step).values("step", "scalars", "series").first()
    return row


def rollout_sample_steps(*, run: Run) -> list[int]:
    """Steps that have stored sample responses, in order."""
    return list(RolloutSample.objects.filter(run=run).order_by("step").values_list("step", flat=True).distinct())


def rollout_samples(
    *,
    run: Run,
    step: int,
    min_reward: float | None = None,
    max_reward: float | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
) -> QuerySet[RolloutSample]:
    """One step's stored responses, filtered by reward and length (inclusive bounds)."""
    rows = RolloutSample.objects.filter(run=run, step=step)
    if min_reward is not None:
        rows = rows.filter(reward__gte=min_reward)
    if max_reward is not None:
        rows = rows.filter(reward__lte=max_reward)
    if min_length is not None:
        rows = rows.filter(length__gte=min_length)
    if max_length is not None:
        rows = rows.filter(length__lte=max_length)
    return rows.order_by("sample")


def run_log_text(*, run: Run) -> str | None:
    """The job's whole log, cleaned (kept when the run ended), or its tail for older runs; None: no log."""
    from tltweb.runs.services import run_log_path

    path = run_log_path(run)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    return run.log_tail or None


def artifact_list(*, run: Run) -> QuerySet[Artifact]:
    return Artifact.objects.filter(run=run).order_by("step", "kind")


def runs_for_compare(*, user: User, run_ids: list[str]) -> list[Run]:
    """The runs among `run_ids` that the user may view (others are silently left out)."""
    out = []
    for run_id in run_ids[:10]:
        try:
            run, _ = run_get_for_user(user=user, run_id=run_id, need="view")
        except (Http404, PermissionDenied):
            continue
        out.append(run)
    return out


def config_diff(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dotted keys whose values differ between configs: [{"key", "values": [...]}]."""

    def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out: dict[str, Any] = {}
            for k, v in d.items():
                out.update(flatten(v, f"{prefix}{k}."))
            return out
        return {prefix.rstrip("."): d}

    flats = [flatten(c) for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    diff = []
    for key in keys:
        values = [f.get(key, missing) for f in flats]
        if any(v != values[0] for v in values[1:]):
            diff.append({"key": key, "values": [None if v is missing else v for v in values]})
    return diff
