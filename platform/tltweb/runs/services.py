"""Writes for runs, metrics and artifacts (HackSoftware styleguide: `<entity>_<action>`).

Views, the API, Celery tasks and management commands only call these and the selectors.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
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
from tltweb.runs import dispatch, health
from tltweb.runs.errors import RunFinished, RunStateError  # noqa: F401  (RunStateError: services.RunStateError)
from tltweb.runs.logtext import log_clean, log_tail
from tltweb.runs.models import ACTIVE_STATES, Artifact, Failure, MetricStep, RolloutSample, Run, RunState
from tltweb.runs.uploads import HashedUpload
from workers.tlt.config import PRESETS, ConfigError, TLTConfig, load_config, preset as preset_config
from workers.tlt.metrics import SAMPLES_KEY  # the series of a step's sample responses (stored in RolloutSample)
from workers.tlt.paths import PathRoots, config_paths_resolve
from workers import tasks  # its tasks import these services lazily, inside each task: no import circle
from workers.tlt.train import EXIT_BAD_CONFIG  # light: torch and ray are imported only when training starts

log = logging.getLogger(__name__)

LOG_TAIL_CHARS = 8000
MAX_TAGS = 20
EXIT_TRAINER_ERROR = 1  # an exception of the trainer's own (the trainer's other exit codes: workers.tlt.train)
PROGRESS_PHASES = ("policy", "drafter_warmup", "actors", "rl")  # the trainer's, in order


def text_clean(value: str, *, field: str) -> str:
    """User text without NUL characters (PostgreSQL cannot store them): a 400 naming the field."""
    if "\x00" in value:
        raise ValidationError({field: "must not contain NUL characters"})
    return value


def tags_clean(tags: list[str] | str) -> list[str]:
    if isinstance(tags, str):
        tags = tags.split(",")
    out: list[str] = []
    for tag in tags:
        tag = text_clean(str(tag), field="tags").strip()[:40]
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
    ab_partner: Run | None = None,
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
    config_paths_resolve(cfg, run_path_roots(team=team))  # task.path / model.path inside the allowed roots
    if settings.TLT_LAUNCH_CHECK_CLUSTER:
        run_capacity_check(cfg=cfg)
    name = text_clean(name, field="name").strip()[:200] or f"{preset or 'run'} {timezone.now():%Y-%m-%d %H:%M}"
    notes = text_clean(notes, field="notes")
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
            ab_partner=ab_partner,
        )
        transaction.on_commit(lambda: tasks.run_submit.delay(str(run.id)))
    return run


def run_path_roots(*, team: Team) -> PathRoots:
    """Folders a run of this team may read: task.path in the team's data folder, model.path in the
    shared models folder or the team's data folder (workers/tlt/paths.py applies them)."""
    data = Path(settings.TLT_DATA_DIR) / str(team.pk)
    return PathRoots(data=(data,), models=(Path(settings.TLT_MODELS_DIR), data))


def run_capacity_check(*, cfg: TLTConfig) -> None:
    """ConfigError naming the field when the Ray cluster cannot ever hold the run's rollout workers.

    Asks the cluster (its total CPUs/GPUs over alive nodes) through the dashboard API; when Ray does
    not answer, says so instead of accepting a run that could not be checked.
    """
    try:
        total = dispatch.cluster_resources()
    except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
        raise ConfigError({"cluster": f"the Ray cluster at {settings.RAY_ADDRESS} did not answer ({exc}); "
                                      "the run's rollout workers cannot be checked, try again when it is up"}) from None
    workers = cfg.rollout.num_workers
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    gpu = cfg.run.device == "cuda" or cfg.rollout.engine == "vllm"
    if gpu and workers > gpus:
        raise ConfigError({"rollout.num_workers": f"{workers} rollout workers need {workers} GPUs (one each); "
                                                  f"the Ray cluster has {gpus:g} GPUs in all"})
    if workers > cpus:
        raise ConfigError({"rollout.num_workers": f"{workers} rollout workers need {workers} CPUs (one each); "
                                                  f"the Ray cluster has {cpus:g} CPUs in all"})


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


def run_launch_control(*, user: User, run: Run) -> Run:
    """The run's A/B partner in one click: the same config and seed with TLT flipped (a TLT run gets
    its baseline control, a baseline its TLT treatment), linked to it (ab_partner).

    Raises PermissionDenied for non-editors, ConfigError when the config no longer validates.
    """
    _require_role(user, run.team, "edit")
    cfg = load_config(run.config_yaml)
    cfg.run.tlt = not cfg.run.tlt
    role = "TLT treatment" if cfg.run.tlt else "baseline control"
    return run_launch(
        user=user,
        team=run.team,
        name=f"{run.name} ({role})"[:200],
        preset=run.preset,
        config_yaml=cfg.to_yaml(),
        tags=[*run.tags, "ab"][:MAX_TAGS],
        notes=f"A/B {role} of {run.name} ({run.id}): same config and seed, run.tlt: {str(cfg.run.tlt).lower()}.",
        ab_partner=run,
    )


def run_update(*, run: Run, tags: list[str] | str | None = None, notes: str | None = None, name: str | None = None) -> Run:
    fields = []
    if tags is not None:
        run.tags = tags_clean(tags)
        fields.append("tags")
    if notes is not None:
        run.notes = text_clean(notes, field="notes")[:20_000]
        fields.append("notes")
    if name is not None and name.strip():
        run.name = text_clean(name, field="name").strip()[:200]
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
        _finish(run, RunState.CANCELLED)
        run.job_stopped_at = None if run.submitted_at else timezone.now()  # nothing to stop when never submitted
        run.save(update_fields=["job_stopped_at"])
        transaction.on_commit(lambda: tasks.run_cancel.delay(str(run.id)))
    return run


def _finish(run: Run, state: str, *, error: str = "", failure: str = "", log_tail: str | None = None) -> None:
    """Move a locked, active run to a final state and revoke its ingestion token (caller holds the row lock)."""
    now = timezone.now()
    run.state = state
    run.finished_at = now
    run.error = error[:LOG_TAIL_CHARS]
    run.failure = failure if state == RunState.FAILED else ""
    if log_tail is not None:
        run.log_tail = log_tail
    run.ingest_token_revoked_at = now  # a finished run's metrics and artifacts are immutable
    run.save(update_fields=["state", "finished_at", "error", "failure", "log_tail", "ingest_token_revoked_at"])


def run_resume(*, run: Run, user: User | None = None) -> Run:
    """Queue a failed or cancelled run again: its next Ray job runs `--resume` in the same out_dir and
    continues from the last complete checkpoint. `user` None is the automatic resume (runs_sync).

    Raises PermissionDenied for non-editors and RunStateError when the run cannot be resumed.
    """
    if user is not None:
        _require_role(user, run.team, "edit")
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if not run.is_resumable:
            why = "its Ray job has not confirmed it stopped yet" if run.state == RunState.CANCELLED else (
                "its config is invalid; launch a corrected copy" if run.state == RunState.FAILED else f"it is {run.state}")
            raise RunStateError(f"this run cannot be resumed: {why}")
        _resume(run, by=user.username if user is not None else "auto")
    return run


def _resume(run: Run, *, by: str) -> None:
    """Archive the attempt that ended and queue the next one (caller holds the row lock)."""
    run.attempts_log = [*run.attempts_log, {
        "attempt": run.attempt, "submission_id": run.submission_id, "state": run.state, "failure": run.failure,
        "error": run.error[:2000], "log_tail": run.log_tail[-2000:],
        "finished_at": run.finished_at.isoformat() if run.finished_at else None, "resumed_by": by,
    }]
    run.attempt += 1
    if by == "auto":
        run.auto_resumes += 1
    run.state = RunState.QUEUED
    run.queued_at = timezone.now()
    run.submitted_at = run.finished_at = run.job_stopped_at = None
    run.error = run.failure = run.log_tail = ""
    run.progress = {}  # the next attempt reports its own phases (an ETA across the gap would be wrong)
    run.ingest_token_salt = ""  # the next attempt gets a token of its own at submit
    run.save()
    run_id = run.id
    transaction.on_commit(lambda: tasks.run_submit.delay(str(run_id)))
    log.info("run %s queued for attempt %d (resumed by %s)", run.id, run.attempt, by)


def run_token(run: Run) -> str:
    """The run's current ingestion token, derived from its id, attempt and salt with SECRET_KEY.

    Derived, not stored: a submit that is retried after a crash hands the job exactly the token
    whose hash was committed before the job existed, so no job is ever left unable to report.
    """
    msg = f"tlt-ingest:{run.id}:{run.attempt}:{run.ingest_token_salt}".encode()
    digest = hmac.new(settings.SECRET_KEY.encode(), msg, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def run_token_rotate(*, run: Run) -> str:
    """A fresh ingestion token for the run (new salt); only its hash is kept. Returns the plaintext."""
    run.ingest_token_salt = secrets.token_hex(16)
    token = run_token(run)
    run.ingest_token_hash = token_hash(token)
    run.ingest_token_revoked_at = None
    Run.objects.filter(pk=run.pk).update(ingest_token_salt=run.ingest_token_salt, ingest_token_hash=run.ingest_token_hash,
                                         ingest_token_revoked_at=None)
    return token


def run_ingest_url(run: Run) -> str:
    return f"{settings.TLT_PUBLIC_URL}/api/ingest/runs/{run.id}/"


def run_out_dir(run: Run) -> Path:
    """The trainer's --out folder: fixed at the first submit (resumes reuse it), one folder per team."""
    return Path(run.out_dir) if run.out_dir else Path(settings.TLT_RUNS_DIR) / str(run.team_id) / str(run.id)


def run_job_env(run: Run, token: str) -> dict[str, str]:
    """The Ray job's environment: config, ingestion URL and token, allowed path roots, delivery bounds."""
    return {
        "TLT_CONFIG": run.config_yaml,
        "TLT_INGEST_URL": run_ingest_url(run),
        "TLT_RUN_TOKEN": token,
        "PYTHONPATH": settings.TLT_JOB_WORKDIR,
        **run_path_roots(team=run.team).to_env(),
        "TLT_INGEST_RETRY_S": str(settings.TLT_INGEST_RETRY_S),
        "TLT_INGEST_MAX_WAIT_S": str(settings.TLT_INGEST_MAX_WAIT_S),
        "TLT_INGEST_DRAIN_S": str(settings.TLT_INGEST_DRAIN_S),
        "TLT_INGEST_PAUSE_S": str(settings.TLT_INGEST_PAUSE_S),
        **run_mlflow_env(run),
    }


def run_submit(*, run_id: uuid.UUID | str, client: Any = None) -> str:
    """Submit the run's Ray job for its current attempt; idempotent (a job with the attempt's submission
    id is never submitted twice, and a retried submit gives the job the same token).

    1. Under the row lock, the attempt's token salt (so its hash) is committed, before any job exists.
    2. The job is submitted outside any transaction; a concurrent or retried submit that finds the job
       (or loses the race) reports "exists", and the job holds the same derived token either way.
    3. submitted_at is recorded; a run cancelled meanwhile has its job stopped.

    Returns "submitted", "exists" or "skipped" (run gone or no longer queued).
    """
    with transaction.atomic():
        run = Run.objects.select_for_update().select_related("team").filter(pk=run_id).first()
        if run is None or run.state != RunState.QUEUED:
            return "skipped"
        if run.submitted_at:
            return "exists"
        fields = []
        if not run.ingest_token_salt:
            run_token_rotate(run=run)
        if not run.out_dir:
            run.out_dir = str(run_out_dir(run))
            fields.append("out_dir")
        if fields:
            run.save(update_fields=fields)
    attempt = run.attempt
    client = client or dispatch.ray_client()
    outcome = "exists"
    if dispatch.job_info_or_none(client, run.submission_id) is None:
        out_dir = run_out_dir(run)
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            client.submit_job(
                entrypoint=dispatch.job_entrypoint(out_dir=str(out_dir), resume=attempt > 0),
                submission_id=run.submission_id,
                runtime_env={"env_vars": run_job_env(run, run_token(run))},
                metadata={"run": str(run.id), "team": str(run.team_id), "attempt": str(attempt)},
            )
            outcome = "submitted"
        except RuntimeError:
            if dispatch.job_info_or_none(client, run.submission_id) is None:
                raise
            # a concurrent submit of the same attempt won: same token, nothing lost
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if run.attempt != attempt:
            return "skipped"
        if run.submitted_at is None:
            run.submitted_at = timezone.now()
            run.job_stopped_at = None
            run.save(update_fields=["submitted_at", "job_stopped_at"])
        cancelled = run.state == RunState.CANCELLED
    if cancelled:  # cancelled while we submitted: the job must not run on
        run_stop_job(run_id=run.id, client=client)
    log.info("run %s attempt %d: Ray job %s %s", run.id, attempt, run.submission_id, outcome)
    return outcome


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


def run_stop_job(*, run_id: uuid.UUID | str, client: Any = None) -> bool:
    """Stop the run's Ray job if it runs (the trainer's --out folder and checkpoints stay).

    Returns True once Ray confirms the job is not running (then job_stopped_at is set), False while
    a stop was asked for but not yet confirmed; the Celery task retries, and runs_sync keeps asking
    for every cancelled run not yet confirmed, so a cancel never leaves a job running.
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return True
    client = client or dispatch.ray_client()
    info = dispatch.job_info_or_none(client, run.submission_id)
    if info is not None and dispatch.job_status(info) in {"PENDING", "RUNNING"}:
        client.stop_job(run.submission_id)
        log.info("asked Ray to stop job %s", run.submission_id)
        info = dispatch.job_info_or_none(client, run.submission_id)
        if info is not None and dispatch.job_status(info) in {"PENDING", "RUNNING"}:
            return False
    Run.objects.filter(pk=run.pk, job_stopped_at__isnull=True).update(job_stopped_at=timezone.now())
    return True


def _failure_kind(info: Any) -> str:
    """infra (resumed automatically), trainer or config, from the Ray job's exit code and error type."""
    if info is None:
        return Failure.INFRA  # the job vanished: the cluster restarted
    code = getattr(info, "driver_exit_code", None)
    if code is None:  # older Ray: read it from the message
        match = re.search(r"exit code (-?\d+)", getattr(info, "message", "") or "")
        code = int(match.group(1)) if match else None
    if code == EXIT_BAD_CONFIG:
        return Failure.CONFIG
    if code == EXIT_TRAINER_ERROR:
        return Failure.TRAINER
    return Failure.INFRA  # killed (-9, 137), a Ray worker died (69), spool undelivered (75), supervisor/node lost


def run_sync_status(*, run: Run, client: Any) -> Run:
    """Map the Ray job's status onto an active run (and keep the log tail when it ends).

    A job that died of its infrastructure (killed, node or cluster lost) is resumed automatically,
    at most TLT_AUTO_RESUME_MAX times per run, from its last checkpoint; the attempt is archived.
    """
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
    attempt = run.attempt
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        if run.state not in ACTIVE_STATES or run.attempt != attempt:  # cancelled or resumed meanwhile
            return run
        if state == RunState.RUNNING:
            run.state = state
            run.started_at = run.started_at or now
            run.save(update_fields=["state", "started_at"])
            return run
        failure = _failure_kind(info) if state == RunState.FAILED else ""
        _finish(run, state, error=error, failure=failure, log_tail=logs)
        if failure == Failure.INFRA and run.auto_resumes < settings.TLT_AUTO_RESUME_MAX:
            _resume(run, by="auto")
    return run


def runs_sync(*, client: Any = None, resubmit_after_s: int | None = None) -> int:
    """Sync every active run; re-enqueue submits that never happened (a lost task); keep stopping the
    jobs of cancelled runs until Ray confirms. Returns the active runs checked."""
    resubmit_after_s = settings.TLT_RESUBMIT_AFTER_S if resubmit_after_s is None else resubmit_after_s
    active = list(Run.objects.filter(state__in=ACTIVE_STATES))
    stopping = list(Run.objects.filter(state=RunState.CANCELLED, job_stopped_at__isnull=True).values_list("pk", flat=True))
    if not active and not stopping:
        return 0
    if client is None and (stopping or any(run.submitted_at for run in active)):
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
        elif not run.submitted_at and (timezone.now() - run.queued_at).total_seconds() > resubmit_after_s:
            tasks.run_submit.delay(str(run.id))
    for run_id in stopping if client is not None else ():
        try:
            run_stop_job(run_id=run_id, client=client)
        except Exception:
            log.exception("stopping the job of cancelled run %s failed", run_id)
    return len(active)


def _json_clean(value: Any) -> Any:
    """NUL characters replaced (PostgreSQL's JSON cannot hold U+0000): a decoded sample may contain one."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_json_clean(str(k)): _json_clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_clean(v) for v in value]
    return value


def _require_active(run: Run) -> None:
    if run.state not in ACTIVE_STATES:
        raise RunFinished(f"this run has ended ({run.state}): its metrics and artifacts are immutable")


def metrics_record(*, run: Run, step: int, scalars: dict[str, float], series: dict[str, Any]) -> MetricStep:
    """Upsert one step's record (a retried post replaces it); a queued run becomes running.

    The step's sample responses (series "rollout/samples") go to their own table (RolloutSample).
    Raises RunFinished when the run has reached a final state (checked under the row lock that
    state changes take too, so no record lands after the run ended).
    """
    series = _json_clean(series)
    samples = series.pop(SAMPLES_KEY, None)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        _require_active(locked)
        row, _ = MetricStep.objects.update_or_create(
            run=locked, step=step, defaults={"scalars": _json_clean(scalars), "series": series}
        )
        if samples is not None:
            rollout_samples_store(run=locked, step=step, samples=samples)
        if locked.state == RunState.QUEUED:
            locked.state, locked.started_at = RunState.RUNNING, locked.started_at or timezone.now()
            locked.save(update_fields=["state", "started_at"])
    try:
        health.run_health_check(run=locked, step=step)
    except Exception:  # an alert must never cost the trainer its metrics
        log.exception("health check of run %s at step %d failed", run.id, step)
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
    Raises RunFinished for a run that has reached a final state.

    A new phase (or a phase that starts over) notes when and where it began, so the selectors can
    derive the rate and the ETA; the phase it replaces is kept in `history` with its duration.
    """
    now = timezone.now()
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        _require_active(locked)  # RunFinished: an ended run's page keeps what it showed
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


def artifact_store(
    *,
    run: Run,
    kind: str,
    step: int,
    upload: Any,
    filename: str = "",
    expected_size: int | None = None,
    expected_sha256: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Artifact:
    """Store an uploaded file under TLT_ARTIFACT_DIR with its size and SHA-256; idempotent per (run, kind, step).

    `upload` is either a HashedUpload (already streamed into the run's folder and hashed by
    HashingUploadHandler: it is only renamed) or any file-like object, copied in chunks while hashing.
    With `expected_size`/`expected_sha256` (what the sender measured), a file that differs is refused
    with a ValidationError and nothing is stored: a cut-short upload is retried, never kept half.
    The file gets a name of its own (kind, step, hash), so replacing an artifact never overwrites a
    file that another row or a download in progress still reads. Raises RunFinished for a run that ended.
    """
    folder = artifact_folder(run)
    folder.mkdir(parents=True, exist_ok=True)
    filename = Path(filename or getattr(upload, "name", "") or f"{kind}.bin").name or f"{kind}.bin"
    filename = re.sub(r"[^A-Za-z0-9._-]", "_", filename)[:200]
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
    try:
        if (expected_size is not None and size != expected_size) or (
            expected_sha256 is not None and sha256 != expected_sha256.lower()
        ):
            raise ValidationError({"file": f"received {size} bytes with sha256 {sha256}, but the sender sent "
                                           f"{expected_size} bytes with sha256 {expected_sha256}: nothing stored"})
        content_sha256, card = artifact_content(Path(tmp), sha256=sha256)
        meta = artifact_meta_clean(meta, card=card)
        final = folder / f"{kind}-step{step:06d}-{sha256[:12]}-{filename}"
        rel = str(final.relative_to(Path(settings.TLT_ARTIFACT_DIR)))
        with transaction.atomic():
            locked = Run.objects.select_for_update().get(pk=run.pk)
            _require_active(locked)
            # Deduplicated by content hash: a file the run already holds byte for byte is not stored again.
            same = Artifact.objects.filter(run=locked, sha256=sha256).exclude(kind=kind, step=step).first()
            if same is not None and (Path(settings.TLT_ARTIFACT_DIR) / same.path).is_file():
                rel = same.path
            else:
                Path(tmp).replace(final)
            old = Artifact.objects.filter(run=locked, kind=kind, step=step).first()
            fields = {"filename": filename, "path": rel, "size": size, "sha256": sha256,
                      "content_sha256": content_sha256, "meta": meta}
            try:
                with transaction.atomic():
                    artifact, _ = Artifact.objects.update_or_create(run=locked, kind=kind, step=step, defaults=fields)
            except IntegrityError:  # a concurrent retry of the same upload won the race; same content
                artifact = Artifact.objects.get(run=locked, kind=kind, step=step)
            if old is not None and old.path != artifact.path and not Artifact.objects.filter(path=old.path).exists():
                stale = Path(settings.TLT_ARTIFACT_DIR) / old.path
                transaction.on_commit(lambda: stale.unlink(missing_ok=True))
    finally:
        Path(tmp).unlink(missing_ok=True)  # renamed on success; removed on any refusal
    return artifact


MODEL_CARD_NAME = "model_card.json"  # workers/tlt/models/export.py writes it into the drafter's folder
MAX_META_BYTES = 64 * 1024


def artifact_content(path: Path, *, sha256: str) -> tuple[str, dict[str, Any] | None]:
    """(content hash, model card) of a stored file. For a zip (the drafter's EAGLE folder): SHA-256
    over its members' names and bytes in name order, the model card left out (it names the RL step,
    so it differs between checkpoints of an unchanged drafter), and the card it holds, if any.
    Anything else (or a zip that does not open): the file's own SHA-256 and no card."""
    import json
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            digest, card = hashlib.sha256(), None
            for name in sorted(zf.namelist()):
                if name.rsplit("/", 1)[-1] == MODEL_CARD_NAME:
                    if zf.getinfo(name).file_size <= MAX_META_BYTES:
                        try:
                            card = json.loads(zf.read(name))
                        except ValueError:
                            card = None
                    continue
                digest.update(name.encode() + b"\0")
                with zf.open(name) as member:
                    for chunk in iter(lambda: member.read(1 << 20), b""):
                        digest.update(chunk)
            return digest.hexdigest(), card if isinstance(card, dict) else None
    except (zipfile.BadZipFile, OSError, RuntimeError):
        return sha256, None


def artifact_meta_clean(meta: dict[str, Any] | None, *, card: dict[str, Any] | None) -> dict[str, Any]:
    """{"model_card": ...}: the card the trainer sent with the upload (as meta["model_card"] or as the
    meta itself), else the one inside the archive; bounded and JSON-safe."""
    import json

    out: dict[str, Any] = {}
    if isinstance(meta, dict):
        sent = meta.get("model_card", meta)
        if isinstance(sent, dict) and sent:
            out["model_card"] = sent
    if "model_card" not in out and card:
        out["model_card"] = card
    out = _json_clean(out)
    if len(json.dumps(out, default=str)) > MAX_META_BYTES:
        raise ValidationError({"meta": f"at most {MAX_META_BYTES} bytes of metadata"})
    return out


def artifact_path(artifact: Artifact) -> Path:
    path = (Path(settings.TLT_ARTIFACT_DIR) / artifact.path).resolve()
    if Path(settings.TLT_ARTIFACT_DIR).resolve() not in path.parents:
        raise PermissionDenied("artifact path escapes the artifact folder")
    return path


def run_fail(*, run_id: uuid.UUID | str, error: str) -> None:
    """Mark an active run failed before it ran (its job was never taken by Ray); resumable on a click."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id, state__in=ACTIVE_STATES).first()
        if run is not None:
            _finish(run, RunState.FAILED, error=error, failure=Failure.SUBMIT)
