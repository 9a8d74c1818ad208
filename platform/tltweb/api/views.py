"""The JSON API's routes (django-ninja): thin wrappers that check access through the selectors,
call one service or selector, and shape the answer with the schemas in tltweb.api.schemas.

Ingestion (`/api/ingest/runs/<id>/...`, the run token) keeps its rules in the services
(metrics_record, artifact_store, run_progress_record): these views only authenticate and parse.
"""

import uuid
from typing import Any, Literal

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import reverse
from ninja import Query, Router, Status
from ninja.errors import ValidationError as NinjaValidationError
import pydantic

from tltweb.accounts import selectors as team_selectors, services as team_services
from tltweb.api.api import api
from tltweb.api.auth import USER_AUTH, RunToken
from tltweb.api.schemas import (
    ARTIFACT_KIND_PATTERN,
    SHA256_PATTERN,
    ArtifactForm,
    ArtifactListOut,
    ArtifactOut,
    DrafterListOut,
    ErrorOut,
    IngestOut,
    LaunchBody,
    MemberBody,
    MemberOut,
    MetricsBody,
    MetricsOut,
    PairOut,
    ProgressBody,
    ProgressIngestOut,
    RunDetailOut,
    RunListOut,
    RunPatchBody,
    SamplesOut,
    StepRecordOut,
    TeamCreateBody,
    TeamDraftersOut,
    TeamListOut,
    TeamOut,
)
from tltweb.runs import downloads, evidence, selectors, services
from tltweb.runs.models import Artifact, Run
from tltweb.runs.uploads import HashedUpload, HashingUploadHandler

E = ErrorOut
USER_ERRORS = {400: E, 401: E, 403: E, 404: E}


def access(level: str, **extra: Any) -> dict[str, Any]:
    """openapi_extra saying who may call an operation (`x-tlt-access`, read by the docs and by the
    tests generated from /api/openapi.json): view | edit | own (a role in the path's run or team),
    signed-in (any user), editor-somewhere (editor or owner in some team), run-token (ingestion)."""
    return {"x-tlt-access": level, **extra}
SortKey = Literal[tuple(k for key in selectors.RUN_SORTS for k in (key, f"-{key}"))]  # type: ignore[valid-type]


# ---- answers ----

def run_out(run: Run, *, full: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": run.id,
        "name": run.name,
        "team": run.team_id,
        "team_name": run.team.name,
        "creator": run.creator.username if run.creator else None,
        "preset": run.preset,
        "state": run.state,
        "tags": run.tags,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "attempt": run.attempt,
        "resumable": run.is_resumable,
        "url": reverse("run-detail", args=[run.id]),
        "tlt": run.is_tlt,
        "alerts": selectors.run_alert_count(run),
        "ab_partner": run.ab_partner_id,
        **selectors.run_live(run),
    }
    if full:
        has_log = not run.is_active and selectors.run_log_text(run=run) is not None
        data.update(
            notes=run.notes,
            config=run.config,
            config_yaml=run.config_yaml,
            error=run.error,
            log_tail=run.log_tail,
            log_url=reverse("api-run-log", args=[run.id]) if has_log else None,
            submission_id=run.submission_id,
            failure=run.failure,
            auto_resumes=run.auto_resumes,
            attempts=[{k: a.get(k) for k in ("attempt", "submission_id", "state", "failure", "error", "finished_at",
                                              "resumed_by")} for a in run.attempts_log],
            alert_list=[evidence.alert_out(a) for a in evidence.run_alerts(run=run)],
            latest_drafter_url=reverse("api-run-drafter-latest", args=[run.id])
            if evidence.drafter_latest(run=run) else None,
        )
    return data


def artifact_out(artifact: Artifact, *, api_url: bool = True) -> dict[str, Any]:
    name = "api-artifact-download" if api_url else "artifact-download"
    return {
        "id": artifact.pk,
        "kind": artifact.kind,
        "step": artifact.step,
        "filename": artifact.filename,
        "size": artifact.size,
        "sha256": artifact.sha256,
        "content_sha256": artifact.content_sha256 or artifact.sha256,
        "created_at": artifact.created_at,
        "download_url": reverse(name, args=[artifact.run_id, artifact.pk]),
        "model_card": (artifact.meta or {}).get("model_card"),
    }


def drafter_version_out(v: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v[k] for k in ("version", "content_sha256", "steps", "first_step", "last_step", "model_card")},
            "artifact": artifact_out(v["artifact"])}


def metrics_out(run: Run, *, since: int) -> dict[str, Any]:
    steps = selectors.metrics_scalars(run=run, since=since)
    return {
        "state": run.state,
        "active": run.is_active,
        "attempt": run.attempt,
        "error": run.error,
        "steps": steps,
        "last_step": steps[-1]["step"] if steps else since,
        "progress": selectors.run_progress(run),
        "alerts": [evidence.alert_out(a) for a in evidence.run_alerts(run=run)],
    }


# ---- runs (a person: API token or session) ----

runs = Router(auth=USER_AUTH, tags=["runs"])


@runs.get("/runs", response={200: RunListOut, 400: E, 401: E}, url_name="api-runs", summary="Runs of your teams",
          openapi_extra=access("signed-in"))
def run_list(
    request: HttpRequest,
    state: str = Query("", description="queued | running | succeeded | failed | cancelled"),
    tag: str = "",
    creator: str = Query("", description="username"),
    preset: str = "",
    q: str = Query("", description="search in name, notes and tags"),
    team: int | None = Query(None, description="team id"),
    sort: SortKey = Query("-created", description="column, '-' for descending"),  # type: ignore[valid-type]
    limit: int = Query(200, ge=1, le=500),
):
    """The live columns of the run list (progress, phase, duration, latest reward and acceptance)."""
    qs = selectors.run_list_for_user(
        user=request.auth, state=state, tag=tag, creator=creator, preset=preset, q=q, team_id=team, sort=sort
    )
    return {"runs": [run_out(r) for r in qs[:limit]]}


@runs.post("/runs", response={201: RunDetailOut, **USER_ERRORS}, url_name="api-runs-launch", summary="Launch a run",
           openapi_extra=access("editor-somewhere"))
def run_launch(request: HttpRequest, body: LaunchBody):
    """Launch in a team where you are editor or owner (`team` may be left out when there is one)."""
    team = _launch_team(request.auth, body.team)
    run = services.run_launch(
        user=request.auth, team=team, name=body.name, preset=body.preset, config_yaml=body.config_yaml,
        tags=body.tags, notes=body.notes,
    )
    return Status(201, run_out(run, full=True))


def _launch_team(user: User, team_id: int | None):
    if team_id is not None:
        team, _ = team_selectors.team_get_for_user(user=user, team_id=team_id, need="edit")
        return team
    teams = team_selectors.team_list_for_user(user=user, need="edit")
    if not teams:
        raise PermissionDenied("you need editor access to a team to launch runs")
    if len(teams) != 1:
        raise ValidationError({"team": f"say which team: you can launch in {len(teams)} teams"})
    return teams[0]


@runs.get("/runs/{uuid:run_id}", response={200: RunDetailOut, **USER_ERRORS}, url_name="api-run",
          summary="A run with its config, progress, error and log tail",
          openapi_extra=access("view"))
def run_detail(request: HttpRequest, run_id: uuid.UUID):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    return run_out(run, full=True)


@runs.patch("/runs/{uuid:run_id}", response={200: RunDetailOut, **USER_ERRORS}, url_name="api-run-patch",
            summary="Edit name, tags, notes (editor)",
            openapi_extra=access("edit"))
def run_patch(request: HttpRequest, run_id: uuid.UUID, body: RunPatchBody):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="edit")
    run = services.run_update(run=run, name=body.name, tags=body.tags, notes=body.notes)
    return run_out(run, full=True)


@runs.post("/runs/{uuid:run_id}/cancel", response={200: RunDetailOut, 409: E, **USER_ERRORS},
           url_name="api-run-cancel", summary="Cancel a queued or running run (editor; checkpoints kept)",
           openapi_extra=access("edit"))
def run_cancel(request: HttpRequest, run_id: uuid.UUID):
    """409 when the run has already ended."""
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="edit")
    return run_out(services.run_cancel(run=run), full=True)


@runs.post("/runs/{uuid:run_id}/resume", response={200: RunDetailOut, 409: E, **USER_ERRORS},
           url_name="api-run-resume",
           summary="Resume a failed or cancelled run from its last checkpoint (editor)",
           openapi_extra=access("edit"))
def run_resume(request: HttpRequest, run_id: uuid.UUID):
    """A new Ray job (the next attempt) continues from the last complete checkpoint in the run's folder.
    409 when the run is active, failed of a bad config, or cancelled but its job not yet confirmed stopped."""
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="edit")
    return run_out(services.run_resume(run=run, user=request.auth), full=True)


@runs.post("/runs/{uuid:run_id}/clone", response={201: RunDetailOut, **USER_ERRORS}, url_name="api-run-clone",
           summary="Launch a copy (editor)",
           openapi_extra=access("edit"))
def run_clone(request: HttpRequest, run_id: uuid.UUID):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="edit")
    return Status(201, run_out(services.run_clone(user=request.auth, run=run), full=True))


@runs.get("/runs/{uuid:run_id}/metrics", response={200: MetricsOut, **USER_ERRORS}, url_name="api-run-metrics",
          summary="Scalars of the steps after `since`, the run's state and progress",
          openapi_extra=access("view"))
def run_metrics(request: HttpRequest, run_id: uuid.UUID, since: int = Query(-1, ge=-1, le=10_000_000)):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    return metrics_out(run, since=since)


@runs.get("/runs/{uuid:run_id}/metrics/{int:step}", response={200: StepRecordOut, **USER_ERRORS},
          url_name="api-run-metrics-step", summary="One step's record with its series",
          openapi_extra=access("view"))
def run_metrics_step(request: HttpRequest, run_id: uuid.UUID, step: int):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    row = selectors.metrics_series(run=run, step=step)
    if row is None:
        raise Http404(f"no metrics for step {step}")
    return row


@runs.get("/runs/{uuid:run_id}/samples", response={200: SamplesOut, **USER_ERRORS}, url_name="api-run-samples",
          summary="A step's stored responses, filtered by reward and length",
          openapi_extra=access("view"))
def run_samples(
    request: HttpRequest,
    run_id: uuid.UUID,
    step: int | None = Query(None, ge=0, description="default: the newest step with samples"),
    min_reward: float | None = None,
    max_reward: float | None = None,
    min_length: int | None = Query(None, ge=0),
    max_length: int | None = Query(None, ge=0),
):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    steps = selectors.rollout_sample_steps(run=run)
    if step is None:
        step = steps[-1] if steps else None
    samples = [] if step is None else selectors.rollout_samples(
        run=run, step=step, min_reward=min_reward, max_reward=max_reward, min_length=min_length, max_length=max_length
    )
    return {"step": step, "steps": steps, "samples": list(samples)}


_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}
_BINARY = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


@runs.get("/runs/{uuid:run_id}/log", response=USER_ERRORS, url_name="api-run-log",
          summary="The job's whole log, cleaned (no ANSI codes, tqdm bars collapsed)",
          openapi_extra=access("view", responses={200: {"description": "the log (text/plain attachment)", **_TEXT}}))
def run_log(request: HttpRequest, run_id: uuid.UUID):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    return downloads.log_response(run)


@runs.get("/runs/{uuid:run_id}/artifacts", response={200: ArtifactListOut, **USER_ERRORS},
          url_name="api-run-artifacts", summary="The run's artifacts (drafter, policy)",
          openapi_extra=access("view"))
def run_artifacts(request: HttpRequest, run_id: uuid.UUID):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    return {"artifacts": [artifact_out(a) for a in selectors.artifact_list(run=run)]}


@runs.get("/runs/{uuid:run_id}/artifacts/{int:artifact_id}/file", response=USER_ERRORS,
          url_name="api-artifact-download", summary="Download an artifact (streamed; X-Checksum-SHA256)",
          openapi_extra=access("view", responses={200: {"description": "the file", **_BINARY}}))
def artifact_download(request: HttpRequest, run_id: uuid.UUID, artifact_id: int) -> HttpResponse:
    artifact = selectors.artifact_get_for_user(user=request.auth, run_id=run_id, artifact_id=artifact_id)
    return downloads.artifact_response(artifact)


@runs.post("/runs/{uuid:run_id}/ab", response={201: RunDetailOut, **USER_ERRORS}, url_name="api-run-ab-launch",
           summary="Launch the run's A/B partner: same config and seed, TLT flipped (editor)",
           openapi_extra=access("edit"))
def run_ab_launch(request: HttpRequest, run_id: uuid.UUID):
    """A TLT run gets its baseline control, a baseline its TLT treatment; the new run links to this one."""
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="edit")
    return Status(201, run_out(services.run_launch_control(user=request.auth, run=run), full=True))


@runs.get("/runs/{uuid:run_id}/pair", response={200: PairOut, **USER_ERRORS}, url_name="api-run-pair",
          summary="The run's A/B pair: curves, measured speedups, Amdahl bound, idle reclaimed, reward parity",
          openapi_extra=access("view"))
def run_pair(request: HttpRequest, run_id: uuid.UUID):
    """404 when the run has no A/B partner. Figures are null until both runs have a step to compare."""
    tlt, base, _ = evidence.run_pair_get_for_user(user=request.auth, run_id=run_id)
    return {**evidence.ab_summary(tlt=tlt, base=base), "url": reverse("run-pair", args=[run_id])}


@runs.get("/runs/{uuid:run_id}/drafters", response={200: DrafterListOut, **USER_ERRORS},
          url_name="api-run-drafters", summary="The run's drafter versions (deduplicated by content hash) with model cards",
          openapi_extra=access("view"))
def run_drafters(request: HttpRequest, run_id: uuid.UUID):
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    latest = evidence.drafter_latest(run=run)
    return {"latest_url": reverse("api-run-drafter-latest", args=[run.id]) if latest else None,
            "versions": [drafter_version_out(v) for v in evidence.drafter_versions(run=run)]}


@runs.get("/runs/{uuid:run_id}/drafters/latest/file", response=USER_ERRORS, url_name="api-run-drafter-latest",
          summary="Download the newest drafter checkpoint (vLLM/SGLang EAGLE zip)",
          openapi_extra=access("view", responses={200: {"description": "the file", **_BINARY}}))
def run_drafter_latest(request: HttpRequest, run_id: uuid.UUID) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.auth, run_id=run_id, need="view")
    latest = evidence.drafter_latest(run=run)
    if latest is None:
        raise Http404("this run has no drafter yet")
    return downloads.artifact_response(latest)


# ---- teams ----

teams = Router(auth=USER_AUTH, tags=["teams"])


@teams.get("/teams", response={200: TeamListOut, 401: E}, url_name="api-teams", summary="Your teams and your role",
           openapi_extra=access("signed-in"))
def team_list(request: HttpRequest):
    members = team_selectors.member_list_for_user(user=request.auth)
    return {"teams": [{"id": m.team_id, "name": m.team.name, "role": m.role} for m in members]}


@teams.post("/teams", response={201: TeamOut, 400: E, 401: E}, url_name="api-teams-create",
            summary="Create a team (you become its owner)",
            openapi_extra=access("signed-in"))
def team_create(request: HttpRequest, body: TeamCreateBody):
    team = team_services.team_create(name=body.name, owner=request.auth)
    return Status(201, {"id": team.pk, "name": team.name, "role": "owner"})


@teams.put("/teams/{int:team_id}/members", response={200: MemberOut, **USER_ERRORS}, url_name="api-team-members",
           summary="Invite a user by username, or change a member's role (owner)",
           openapi_extra=access("own"))
def team_member_put(request: HttpRequest, team_id: int, body: MemberBody):
    team, _ = team_selectors.team_get_for_user(user=request.auth, team_id=team_id, need="own")
    member = team_services.team_member_add(team=team, actor=request.auth, username=body.username, role=body.role)
    return {"username": member.user.username, "role": member.role}


@teams.get("/teams/{int:team_id}/drafters", response={200: TeamDraftersOut, **USER_ERRORS}, url_name="api-team-drafters",
           summary="The team's drafter versions, grouped by base model", openapi_extra=access("view"))
def team_drafters(request: HttpRequest, team_id: int):
    _, groups = evidence.team_drafters_for_user(user=request.auth, team_id=team_id)
    return {"groups": [{"base_model": g["base_model"], "versions": [
        {**drafter_version_out(v), "run": v["run"].id, "run_name": v["run"].name} for v in g["versions"]]}
        for g in groups]}


# ---- ingestion (the training job, with the run's token) ----

ingest = Router(auth=RunToken(), tags=["ingestion"])
INGEST_ERRORS = {400: E, 401: E, 403: E}


@ingest.post("/ingest/runs/{uuid:run_id}/metrics", response={200: IngestOut, **INGEST_ERRORS},
             url_name="ingest-metrics", summary="Upsert one step's record (idempotent per step)",
             openapi_extra=access("run-token"))
def ingest_metrics(request: HttpRequest, run_id: uuid.UUID, body: MetricsBody):
    services.metrics_record(run=request.auth, step=body.step, scalars=body.scalars, series=body.series)
    return {"ok": True, "step": body.step}


@ingest.post("/ingest/runs/{uuid:run_id}/progress", response={200: ProgressIngestOut, **INGEST_ERRORS},
             url_name="ingest-progress", summary="The trainer's progress through a phase (the page derives an ETA)",
             openapi_extra=access("run-token"))
def ingest_progress(request: HttpRequest, run_id: uuid.UUID, body: ProgressBody):
    run = request.auth
    services.run_progress_record(run=run, phase=body.phase, done=body.done, total=body.total, message=body.message)
    return {"ok": True, "progress": selectors.run_progress(run)}


_MULTIPART = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "kind": {"type": "string", "pattern": ARTIFACT_KIND_PATTERN},
                        "step": {"type": "integer", "minimum": 0},
                        "size": {"type": "integer", "minimum": 0, "description": "bytes the sender measured"},
                        "sha256": {"type": "string", "pattern": SHA256_PATTERN,
                                   "description": "SHA-256 (hex) the sender measured"},
                        "file": {"type": "string", "format": "binary"},
                        "meta": {"type": "string", "description": 'optional JSON object, e.g. {"model_card": {...}}'},
                    },
                    "required": ["kind", "step", "size", "sha256", "file"],
                }
            }
        },
    }
}


@ingest.post("/ingest/runs/{uuid:run_id}/artifacts", response={201: ArtifactOut, **INGEST_ERRORS},
             url_name="ingest-artifacts",
             summary="Upload an artifact (multipart: kind, step, size, sha256, file); stored only if size and sha256 match",
             openapi_extra=access("run-token", **_MULTIPART))
def ingest_artifacts(request: HttpRequest, run_id: uuid.UUID):
    """The token is checked before a byte of the body is read; the file streams to disk, hashed, and is
    kept only when its size and sha256 are the ones the trainer measured (400 otherwise, nothing stored)."""
    run = request.auth
    request.upload_handlers = [HashingUploadHandler(services.artifact_folder(run), settings.TLT_MAX_ARTIFACT_BYTES, request)]
    uploads = request.FILES.getlist("file")
    try:
        try:
            form = ArtifactForm.model_validate({k: request.POST.get(k, "") for k in ("kind", "step", "size", "sha256")})
        except pydantic.ValidationError as exc:  # a bad form field: 400 naming it, like a bad JSON body
            raise NinjaValidationError([{**e, "loc": ("form", *e["loc"])} for e in exc.errors()]) from None
        if len(uploads) != 1:
            raise ValidationError({"file": "send exactly one multipart field 'file'"})
        artifact = services.artifact_store(run=run, kind=form.kind, step=form.step, upload=uploads[0],
                                           expected_size=form.size, expected_sha256=form.sha256,
                                           meta=_meta_field(request.POST.get("meta", "")))
    finally:
        for upload in uploads:  # streamed .part files: renamed when stored, removed otherwise
            if isinstance(upload, HashedUpload):
                upload.path.unlink(missing_ok=True)
    return Status(201, artifact_out(artifact))


def _meta_field(raw: str) -> dict[str, Any] | None:
    """The optional multipart field `meta`: a JSON object (a drafter's {"model_card": ...})."""
    import json

    if not raw:
        return None
    try:
        meta = json.loads(raw, parse_constant=lambda _c: None)
    except ValueError:
        raise ValidationError({"meta": "must be a JSON object"}) from None
    if not isinstance(meta, dict):
        raise ValidationError({"meta": "must be a JSON object"})
    return meta


api.add_router("", runs)
api.add_router("", teams)
api.add_router("", ingest)
