"""Writes for runs, metrics and artifacts (HackSoftware styleguide: `<entity>_<action>`).

Views, the API, Celery tasks and management commands only call these and the selectors.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import shutil
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from tltweb.accounts.models import Member, Team
from tltweb.accounts.services import token_hash
from tltweb.runs import dispatch
from tltweb.runs.logtext import log_clean, log_tail
from tltweb.runs.models import ACTIVE_STATES, Artifact, MetricStep, RolloutSample, Run, RunState
from tltweb.runs.uploads import HashedUpload
from workers.tlt.config import PRESETS, ConfigError, load_config, preset as preset_config
from workers.tlt.metrics import SAMPLES_KEY  # the series of a step's sample responses (stored in RolloutSample)

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 8000
MAX_TAGS = 20
PROGRESS_PHASES = ("policy", "drafter_warmup", "actors", "rl")  # the trainer's, in order


class RunStateError(Exception):
    """An action the run's state does not allow (cancelling a finished run): HTTP 409 in the API."""


def tags_clean(tags: list[str] | str) -> list[str]:
    if isinstance(tags, str):
        tags = tags.split(",")
    out: list[str] = []
    for tag in tags:
        tag = str(tag).strip()[:40]
        if tag and tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise ValidationError({"tags": f"at most {MAX_TAGS} tags"})
    return out


def preset_yaml(name: str) -> str:
    return preset_config(name).to_yaml()


def _require_role(user: User, team: Team, need: str) -> None:
    member = Member.objects.filter(user=user, team=team).first()
    if member is None or not member.allows(need):
        raise PermissionDenied(f"needs {need} access to team {team.name}")


def run_launch(
    *,
    user: User,
    team: Team,
    name: str,
    preset: str = "",
    config_yaml: str = "",
    tags: list[str] | str = (),
    notes: str = "",
    cloned_from: Run | None = None,
) -> Run:
    """Validate the config, create the run, and submit it to Ray once the row is committed.

    Raises ConfigError (field -> message) for a bad config or preset, PermissionDenied when the
    user cannot launch in this team. Nothing is written when it raises.
    """
    _require_role(user, team, "edit")
    if preset and preset not in PRESETS:
        raise ConfigError({"preset": f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}"})
    if not config_yaml.strip():
        if not preset:
            raise ConfigError({"config": "give a preset or a config"})
        config_yaml = preset_yaml(preset)
    cfg = load_config(config_yaml)
    name = name.strip()[:200] or f"{preset or 'run'} {timezone.now():%Y-%m-%d %H:%M}"
    with transaction.atomic():
        run = Run.objects.create(
            team=team,
            creator=user,
            name=name,
            preset=preset,
            config=cfg.model_dump(mode="json"),
            config_yaml=config_yaml,
            tags=tags_clean(tags),
            notes=notes,
            cloned_from=cloned_from,
        )
        transaction.on_commit(lambda: _enqueue("run_submit", run.id))
    return run


def _enqueue(task_name: str, run_id: uuid.UUID) -> None:
    from workers import tasks  # the Celery side imports Django; keep the import out of module load

    getattr(tasks, task_name).delay(str(run_id))


def run_clone(*, user: User, run: Run) -> Run:
    """A new run with the same team, config, preset and tags."""
    return run_launch(
        user=user,
        team=run.team,
        name=f"{run.name} (clone)"[:200],
        preset=run.preset,
        config_yaml=run.config_yaml,
        tags=run.tags,
        notes=run.notes,
        cloned_from=run,
    )


def run_update(*, run: Run, tags: list[str] | str | None = None, notes: str | None = None, name: str | None = None) -> Run:
    fields = []
    if tags is not None:
        run.tags = tags_clean(tags)
        fields.append("tags")
    if notes is not None:
        run.notes = notes[:20_000]
        fields.append("notes")
    if name is not None and name.strip():
        run.name = name.strip()[:200]
        fields.append("name")
    if fields:
        run.save(update_fields=fields)
    return run


def run_cancel(*, run: Run) -> Run:
    """Mark an active run cancelled now and stop its Ray job in the background (checkpoints kept).

    Raises RunStateError when the run has already ended: there is nothing left to cancel.
    """
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if run.state not in ACTIVE_STATES:
            raise RunStateError(f"the run is {run.state}: only queued or running runs can be cancelled")
        run.state = RunState.CANCELLED
        run.finished_at = timezone.now()
        run.save(update_fields=["state", "finished_at"])
        transaction.on_commit(lambda: _enqueue("run_cancel", run.id))
    return run


def run_token_rotate(*, run: Run) -> str:
    """A fresh ingestion token for the run; only its hash is kept. Returns the plaintext."""
    token = secrets.token_urlsafe(32)
    Run.objects.filter(pk=run.pk).update(ingest_token_hash=token_hash(token))
    run.ingest_token_hash = token_hash(token)
    return token


def run_ingest_url(run: Run) -> str:
    return f"{settings.TLT_PUBLIC_URL}/api/ingest/runs/{run.id}/"


def run_submit(*, run_id: uuid.UUID | str, client: Any = None) -> str:
    """Submit the run's Ray job; idempotent (a job with the run's submission id is never resubmitted).

    Returns what happened: "submitted", "exists" or "skipped" (run gone or no longer queued).
    """
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.state != RunState.QUEUED:
            return "skipped"
        client = client or dispatch.ray_client()
        if run.submitted_at or dispatch.job_info_or_none(client, run.submission_id) is not None:
            # Already submitted (a retried task): the job holds the token it was given.
            if not run.submitted_at:
                run.submitted_at = timezone.now()
                run.save(update_fields=["submitted_at"])
            return "exists"
        token = run_token_rotate(run=run)
        out_dir = Path(settings.TLT_RUNS_DIR) / str(run.id)
        out_dir.mkdir(parents=True, exist_ok=True)
        client.submit_job(
            entrypoint=dispatch.job_entrypoint(out_dir=str(out_dir)),
            submission_id=run.submission_id,
            runtime_env={
                "env_vars": {
                    "TLT_CONFIG": run.config_yaml,
                    "TLT_INGEST_URL": run_ingest_url(run),
                    "TLT_RUN_TOKEN": token,
                    "PYTHONPATH": settings.TLT_JOB_WORKDIR,
                    **run_mlflow_env(run),
                }
            },
            metadata={"run": str(run.id), "team": str(run.team_id)},
        )
        run.submitted_at = timezone.now()
        run.save(update_fields=["submitted_at"])
    log.info("submitted run %s as Ray job %s", run.id, run.submission_id)
    return "submitted"


def run_mlflow_env(run: Run) -> dict[str, str]:
    """The job's MLflow mirror settings (workers.tlt.train.build_tracking); {} when none is configured."""
    if not settings.TLT_MLFLOW_TRACKING_URI:
        return {}
    return {
        "TLT_MLFLOW_TRACKING_URI": settings.TLT_MLFLOW_TRACKING_URI,
        "TLT_MLFLOW_EXPERIMENT": settings.TLT_MLFLOW_EXPERIMENT or run.team.name,
        "TLT_RUN_NAME": run.name,
        "TLT_RUN_ID": str(run.id),
        "TLT_RUN_TEAM": run.team.name,
        "TLT_MLFLOW_ARTIFACTS": "1" if settings.TLT_MLFLOW_ARTIFACTS else "0",
    }


def run_stop_job(*, run_id: uuid.UUID | str, client: Any = None) -> None:
    """Stop the run's Ray job if there is one (the trainer's --out folder and checkpoints stay)."""
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return
    client = client or dispatch.ray_client()
    info = dispatch.job_info_or_none(client, run.submission_id)
    if info is not None and dispatch.job_status(info) in {"PENDING", "RUNNING"}:
        client.stop_job(run.submission_id)
        log.info("stopped Ray job %s", run.submission_id)


def run_sync_status(*, run: Run, client: Any) -> Run:
    """Map the Ray job's status onto an active run (and keep the log tail when it ends)."""
    if run.state not in ACTIVE_STATES or not run.submitted_at:
        return run
    info = dispatch.job_info_or_none(client, run.submission_id)
    now = timezone.now()
    if info is None:
        state, error = RunState.FAILED, "the Ray job disappeared (cluster restarted?)"
    else:
        state = dispatch.JOB_STATE.get(dispatch.job_status(info), run.state)
        error = (getattr(info, "message", "") or "") if state == RunState.FAILED else ""
    if state == run.state:
        return run
    logs = ""
    if state not in ACTIVE_STATES and info is not None:
        try:
            logs = run_log_save(run=run, text=client.get_job_logs(run.submission_id))
        except Exception as exc:  # logs are a nicety; the state change is not
            log.warning("no logs for %s: %s", run.submission_id, exc)
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if run.state not in ACTIVE_STATES:  # cancelled meanwhile
            return run
        run.state = state
        if state == RunState.RUNNING:
            run.started_at = run.started_at or now
        else:
            run.finished_at = now
            run.error = error[:LOG_TAIL_CHARS]
            run.log_tail = logs
        run.save(update_fields=["state", "started_at", "finished_at", "error", "log_tail"])
    return run


def runs_sync(*, client: Any = None, resubmit_after_s: int = 120) -> int:
    """Sync every active run; re-enqueue submits that never happened (a lost task). Returns runs checked."""
    active = list(Run.objects.filter(state__in=ACTIVE_STATES))
    if not active:
        return 0
    if client is None and any(run.submitted_at for run in active):
        try:
            client = dispatch.ray_client()
        except (ConnectionError, RuntimeError, OSError) as exc:  # Ray down: runs keep their state
            log.warning("Ray job API unreachable, runs not synced: %s", exc)
    for run in active:
        if run.submitted_at and client is not None:
            try:
                run_sync_status(run=run, client=client)
            except Exception:
                log.exception("sync of run %s failed", run.id)
        elif (timezone.now() - run.created_at).total_seconds() > resubmit_after_s:
            _enqueue("run_submit", run.id)
    return len(active)


def metrics_record(*, run: Run, step: int, scalars: dict[str, float], series: dict[str, Any]) -> MetricStep:
    """Upsert one step's record (a retried post replaces it); a queued run becomes running.

    The step's sample responses (series "rollout/samples") go to their own table (RolloutSample).
    """
    samples = series.get(SAMPLES_KEY)
    series = {k: v for k, v in series.items() if k != SAMPLES_KEY}
    row, _ = MetricStep.objects.update_or_create(run=run, step=step, defaults={"scalars": scalars, "series": series})
    if samples is not None:
        rollout_samples_store(run=run, step=step, samples=samples)
    if run.state == RunState.QUEUED:
        Run.objects.filter(pk=run.pk, state=RunState.QUEUED).update(
            state=RunState.RUNNING, started_at=timezone.now()
        )
    return row


def rollout_samples_store(*, run: Run, step: int, samples: list[dict[str, Any]]) -> list[RolloutSample]:
    """Replace the step's stored samples (a retried post replaces them, as its metrics).

    `samples`: validated dicts {sample, prompt, tokens, from_draft, reward, length, truncated}.
    """
    rows = [
        RolloutSample(
            run=run, step=step, sample=int(s["sample"]), prompt=s["prompt"], tokens=list(s["tokens"]),
            from_draft=[int(bool(x)) for x in s["from_draft"]], drafted=sum(1 for x in s["from_draft"] if x),
            reward=s.get("reward"), length=int(s["length"]), truncated=bool(s.get("truncated", False)),
        )
        for s in samples
    ]
    with transaction.atomic():
        RolloutSample.objects.filter(run=run, step=step).delete()
        RolloutSample.objects.bulk_create(rows)
    return rows


def run_progress_record(*, run: Run, phase: str, done: int, total: int, message: str = "") -> dict[str, Any]:
    """Keep the trainer's latest progress on the run; a queued run becomes running.

    A new phase (or a phase that starts over) notes when and where it began, so the selectors can
    derive the rate and the ETA; the phase it replaces is kept in `history` with its duration.
    """
    now = timezone.now()
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        prev = locked.progress or {}
        history = list(prev.get("history", []))
        same_phase = prev.get("phase") == phase and done >= int(prev.get("done", 0))
        if same_phase:
            began_at, began_done = prev["began_at"], int(prev.get("began_done", 0))
        else:
            if prev.get("phase") and prev.get("phase") != phase:
                seconds = (now - datetime.fromisoformat(prev["began_at"])).total_seconds()
                history = [h for h in history if h["phase"] != prev["phase"]]
                history.append({"phase": prev["phase"], "seconds": round(seconds, 1)})
            began_at, began_done = now.isoformat(), done
        locked.progress = {
            "phase": phase, "done": done, "total": total, "message": message[:500],
            "began_at": began_at, "began_done": began_done, "updated_at": now.isoformat(),
            "history": history[-len(PROGRESS_PHASES) * 2:],
        }
        fields = ["progress"]
        if locked.state == RunState.QUEUED:
            locked.state, locked.started_at = RunState.RUNNING, locked.started_at or now
            fields += ["state", "started_at"]
        locked.save(update_fields=fields)
    run.progress = locked.progress
    return locked.progress


def run_log_path(run: Run) -> Path:
    return artifact_folder(run) / "job.log"


def run_log_save(*, run: Run, text: str) -> str:
    """Keep the job's whole log (cleaned: no ANSI codes, tqdm collapsed) next to the run's
    artifacts, for download; returns its tail, which the run page shows."""
    clean = log_clean(text)
    path = run_log_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(clean, encoding="utf-8")
    tmp.replace(path)
    return log_tail(clean, chars=LOG_TAIL_CHARS)


def artifact_folder(run: Run) -> Path:
    return Path(settings.TLT_ARTIFACT_DIR) / str(run.team_id) / str(run.id)


def artifact_store(*, run: Run, kind: str, step: int, upload: Any, filename: str = "") -> Artifact:
    """Store an uploaded file under TLT_ARTIFACT_DIR with its size and SHA-256; idempotent per (run, kind, step).

    `upload` is either a HashedUpload (already streamed into the run's folder and hashed by
    HashingUploadHandler: it is only renamed) or any file-like object, copied in chunks while hashing.
    """
    folder = artifact_folder(run)
    folder.mkdir(parents=True, exist_ok=True)
    filename = Path(filename or getattr(upload, "name", "") or f"{kind}.bin").name or f"{kind}.bin"
    final = folder / f"{kind}-step{step:06d}-{filename}"
    if isinstance(upload, HashedUpload):
        tmp, size, sha256 = upload.path, upload.size, upload.sha256
    else:
        tmp = folder / f".upload-{uuid.uuid4().hex}.part"
        digest, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                chunks = upload.chunks() if hasattr(upload, "chunks") else iter(lambda: upload.read(1 << 20), b"")
                for chunk in chunks:
                    size += len(chunk)
                    if size > settings.TLT_MAX_ARTIFACT_BYTES:
                        raise ValidationError({"file": "artifact too large"})
                    digest.update(chunk)
                    out.write(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sha256 = digest.hexdigest()
    Path(tmp).replace(final)
    rel = final.relative_to(Path(settings.TLT_ARTIFACT_DIR))
    try:
        artifact, _ = Artifact.objects.update_or_create(
            run=run, kind=kind, step=step,
            defaults={"filename": filename, "path": str(rel), "size": size, "sha256": sha256},
        )
    except IntegrityError:  # a concurrent retry of the same upload won the race; same content
        artifact = Artifact.objects.get(run=run, kind=kind, step=step)
    return artifact


def artifact_path(artifact: Artifact) -> Path:
    path = (Path(settings.TLT_ARTIFACT_DIR) / artifact.path).resolve()
    if Path(settings.TLT_ARTIFACT_DIR).resolve() not in path.parents:
        raise PermissionDenied("artifact path escapes the artifact folder")
    return path


def run_files_delete(*, run: Run) -> None:
    shutil.rmtree(artifact_folder(run), ignore_errors=True)


def run_fail(*, run_id: uuid.UUID | str, error: str) -> None:
    Run.objects.filter(pk=run_id, state__in=ACTIVE_STATES).update(
        state=RunState.FAILED, error=error[:LOG_TAIL_CHARS], finished_at=timezone.now()
    )
