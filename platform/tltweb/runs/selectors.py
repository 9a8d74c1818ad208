"""Reads for runs, metrics and artifacts. Every read that takes a user checks the team role."""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q, QuerySet
from django.http import Http404

from tltweb.accounts.models import Member
from tltweb.accounts.services import token_matches
from tltweb.runs.errors import RunFinished
from tltweb.runs.models import Artifact, MetricStep, Run


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
    run = Run.objects.filter(pk=run_id).first()
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


def run_list_for_user(
    *,
    user: User,
    state: str = "",
    tag: str = "",
    creator: str = "",
    preset: str = "",
    q: str = "",
    team_id: int | None = None,
) -> QuerySet[Run]:
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
    return runs.distinct().order_by("-created_at")


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


def metrics_steps(*, run: Run) -> list[int]:
    return list(MetricStep.objects.filter(run=run).order_by("step").values_list("step", flat=True))


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
