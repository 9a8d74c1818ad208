"""The JSON API (personal token or session) and the trainer's ingestion endpoints (run token)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from tltweb.accounts.selectors import team_get_for_user, team_list_for_user
from tltweb.api.http import BadRequest, api_endpoint, bearer, ingest_endpoint, json_error, parse_json
from tltweb.api.openapi import OPENAPI
from tltweb.api.schemas import ArtifactForm, LaunchBody, MetricsBody, RunPatchBody
from tltweb.runs import selectors, services
from tltweb.runs.models import Artifact, Run
from tltweb.runs.uploads import HashedUpload, HashingUploadHandler


# ---- serializers ----

def run_json(run: Run, *, full: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": str(run.id),
        "name": run.name,
        "team": run.team_id,
        "creator": run.creator.username if run.creator else None,
        "preset": run.preset,
        "state": run.state,
        "tags": run.tags,
        "created_at": run.created_at.isoformat(),
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "attempt": run.attempt,
        "resumable": run.is_resumable,
        "url": reverse("run-detail", args=[run.id]),
    }
    if full:
        data.update(
            notes=run.notes,
            config=run.config,
            config_yaml=run.config_yaml,
            error=run.error,
            log_tail=run.log_tail,
            submission_id=run.submission_id,
            failure=run.failure,
            auto_resumes=run.auto_resumes,
            attempts=[{k: a.get(k) for k in ("attempt", "submission_id", "state", "failure", "error", "finished_at",
                                              "resumed_by")} for a in run.attempts_log],
        )
    return data


def artifact_json(artifact: Artifact, *, api: bool) -> dict[str, Any]:
    name = "api-artifact-download" if api else "artifact-download"
    return {
        "id": artifact.pk,
        "kind": artifact.kind,
        "step": artifact.step,
        "filename": artifact.filename,
        "size": artifact.size,
        "sha256": artifact.sha256,
        "created_at": artifact.created_at.isoformat(),
        "download_url": reverse(name, args=[artifact.run_id, artifact.pk]),
    }


def metrics_json(run: Run, *, since: int) -> dict[str, Any]:
    steps = selectors.metrics_scalars(run=run, since=since)
    return {
        "state": run.state,
        "active": run.is_active,
        "attempt": run.attempt,
        "error": run.error,
        "steps": steps,
        "last_step": steps[-1]["step"] if steps else since,
    }


def _int_param(request: HttpRequest, name: str, default: int) -> int:
    try:
        return int(request.GET.get(name, default))
    except ValueError:
        raise BadRequest(f"{name} must be an integer") from None


# ---- user API ----

@api_endpoint(("GET", "POST"))
def runs(request: HttpRequest) -> JsonResponse:
    if request.method == "GET":
        qs = selectors.run_list_for_user(
            user=request.user,
            state=request.GET.get("state", ""),
            tag=request.GET.get("tag", ""),
            creator=request.GET.get("creator", ""),
            preset=request.GET.get("preset", ""),
            q=request.GET.get("q", ""),
        )[:200]
        return JsonResponse({"runs": [run_json(r) for r in qs]})
    body = LaunchBody.model_validate(parse_json(request))
    team = _launch_team(request.user, body.team)
    run = services.run_launch(
        user=request.user,
        team=team,
        name=body.name,
        preset=body.preset,
        config_yaml=body.config_yaml,
        tags=body.tags,
        notes=body.notes,
    )
    return JsonResponse(run_json(run, full=True), status=201)


def _launch_team(user: User, team_id: int | None):
    if team_id is not None:
        team, _ = team_get_for_user(user=user, team_id=team_id, need="edit")
        return team
    teams = team_list_for_user(user=user, need="edit")
    if len(teams) != 1:
        raise BadRequest("say which team: you can launch in %d teams" % len(teams), errors={"team": "required"})
    return teams[0]


@api_endpoint(("GET", "PATCH"))
def run_detail(request: HttpRequest, run_id: str) -> JsonResponse:
    need = "view" if request.method == "GET" else "edit"
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need=need)
    if request.method == "PATCH":
        body = RunPatchBody.model_validate(parse_json(request))
        run = services.run_update(run=run, name=body.name, tags=body.tags, notes=body.notes)
    return JsonResponse(run_json(run, full=True))


@api_endpoint(("POST",))
def run_cancel(request: HttpRequest, run_id: str) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    run = services.run_cancel(run=run)
    return JsonResponse(run_json(run, full=True))


@api_endpoint(("POST",))
def run_resume(request: HttpRequest, run_id: str) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    run = services.run_resume(run=run, user=request.user)
    return JsonResponse(run_json(run, full=True))


@api_endpoint(("POST",))
def run_clone(request: HttpRequest, run_id: str) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    clone = services.run_clone(user=request.user, run=run)
    return JsonResponse(run_json(clone, full=True), status=201)


@api_endpoint(("GET",))
def run_metrics(request: HttpRequest, run_id: str) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    return JsonResponse(metrics_json(run, since=_int_param(request, "since", -1)))


@api_endpoint(("GET",))
def run_metrics_step(request: HttpRequest, run_id: str, step: int) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    row = selectors.metrics_series(run=run, step=step)
    if row is None:
        raise Http404(f"no metrics for step {step}")
    return JsonResponse(row)


@api_endpoint(("GET",))
def run_artifacts(request: HttpRequest, run_id: str) -> JsonResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    return JsonResponse({"artifacts": [artifact_json(a, api=True) for a in selectors.artifact_list(run=run)]})


@api_endpoint(("GET",))
def artifact_download(request: HttpRequest, run_id: str, artifact_id: int) -> HttpResponse:
    artifact = selectors.artifact_get_for_user(user=request.user, run_id=run_id, artifact_id=artifact_id)
    return artifact_file_response(artifact)


def artifact_file_response(artifact: Artifact) -> FileResponse:
    path = services.artifact_path(artifact)
    if not path.exists():
        raise Http404("artifact file is missing")
    response = FileResponse(path.open("rb"), as_attachment=True, filename=artifact.filename)
    response["X-Checksum-SHA256"] = artifact.sha256
    return response


@csrf_exempt
def openapi(request: HttpRequest) -> JsonResponse:
    return JsonResponse(OPENAPI)


# ---- ingestion (the trainer, with the run's token) ----

def _ingest_run(request: HttpRequest, run_id: str) -> Run | JsonResponse:
    token = bearer(request)
    if token is None:
        return json_error(401, "missing 'Authorization: Bearer <run token>'")
    return selectors.run_get_for_ingest(run_id=run_id, token=token)  # PermissionDenied -> 403


@ingest_endpoint
def ingest_metrics(request: HttpRequest, run_id: str) -> JsonResponse:
    run = _ingest_run(request, run_id)
    if isinstance(run, JsonResponse):
        return run
    body = MetricsBody.model_validate(parse_json(request))
    services.metrics_record(run=run, step=body.step, scalars=body.scalars, series=body.series)
    return JsonResponse({"ok": True, "step": body.step})


@ingest_endpoint
def ingest_artifacts(request: HttpRequest, run_id: str) -> JsonResponse:
    run = _ingest_run(request, run_id)  # the token is checked before a byte of the body is read
    if isinstance(run, JsonResponse):
        return run
    request.upload_handlers = [HashingUploadHandler(services.artifact_folder(run), settings.TLT_MAX_ARTIFACT_BYTES, request)]
    uploads = request.FILES.getlist("file")
    try:
        form = ArtifactForm.model_validate({k: request.POST.get(k, "") for k in ("kind", "step", "size", "sha256")})
        if len(uploads) != 1:
            raise BadRequest("send exactly one multipart field 'file'", errors={"file": "required"})
        artifact = services.artifact_store(run=run, kind=form.kind, step=form.step, upload=uploads[0],
                                           expected_size=form.size, expected_sha256=form.sha256)
    finally:
        for upload in uploads:  # streamed .part files: renamed when stored, removed otherwise
            if isinstance(upload, HashedUpload):
                upload.path.unlink(missing_ok=True)
    return JsonResponse(artifact_json(artifact, api=True), status=201)
