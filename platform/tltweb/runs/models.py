"""Runs, their per-step metrics and their artifacts. Everything belongs to a team."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from tltweb.accounts.models import Team


class RunState(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


ACTIVE_STATES = (RunState.QUEUED, RunState.RUNNING)
FINAL_STATES = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


class Failure(models.TextChoices):
    """Why a failed run failed: decides whether it is resumed automatically, on a click, or not at all."""

    INFRA = "infra", "Infrastructure"  # the job died (killed, node lost, cluster restarted): resumed automatically
    TRAINER = "trainer", "Trainer error"  # the trainer raised (exit 1): resumable on a click
    SUBMIT = "submit", "Not submitted"  # Ray never took the job: resumable on a click
    CONFIG = "config", "Bad config"  # exit 2: resuming would fail the same way


class Run(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="runs")
    creator = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="runs")
    name = models.CharField(max_length=200)
    preset = models.CharField(max_length=50, blank=True)
    config = models.JSONField()  # the validated TLTConfig, fully expanded
    config_yaml = models.TextField()  # the text as the user wrote it
    tags = models.JSONField(default=list, blank=True)
    notes = models.TextField(blank=True)
    cloned_from = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True)
    # A/B pair: the run this one was launched against in one click (a TLT run for its baseline
    # control, a baseline for its TLT treatment): same config and seed, run.tlt flipped.
    ab_partner = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="ab_launched")

    state = models.CharField(max_length=10, choices=RunState.choices, default=RunState.QUEUED, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    queued_at = models.DateTimeField(default=timezone.now)  # launch or last resume: when a submit is due
    error = models.TextField(blank=True)
    failure = models.CharField(max_length=10, choices=Failure.choices, blank=True)
    log_tail = models.TextField(blank=True)
    # The ingestion token is derived (HMAC with SECRET_KEY) from the run, its attempt and this salt, so a
    # retried submit hands the job the token whose hash was committed before the job existed.
    ingest_token_hash = models.CharField(max_length=64, blank=True)  # SHA-256 of the run's token
    ingest_token_salt = models.CharField(max_length=64, blank=True)
    ingest_token_revoked_at = models.DateTimeField(null=True, blank=True)  # set when the run reaches a final state
    # Resume: attempt 0 is the first Ray job; each resume (automatic or a click) submits a new job with
    # --resume on the same out_dir, which continues from the last complete checkpoint.
    attempt = models.PositiveSmallIntegerField(default=0)
    auto_resumes = models.PositiveSmallIntegerField(default=0)
    attempts_log = models.JSONField(default=list, blank=True)  # earlier attempts: [{attempt, submission_id, state, error, ...}]
    out_dir = models.CharField(max_length=500, blank=True)  # the trainer's --out, fixed at the first submit
    job_stopped_at = models.DateTimeField(null=True, blank=True)  # cancelled runs: when Ray confirmed the job stopped
    # The trainer's latest setup/training progress (services.run_progress_record): phase, done,
    # total, message, when the phase began and where it stood then (the ETA's rate), finished phases.
    progress = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    @property
    def submission_id(self) -> str:
        """The Ray job id of this attempt: derived from the run, so a retried submit finds the same job."""
        return f"tlt-run-{self.id}" if not self.attempt else f"tlt-run-{self.id}-r{self.attempt}"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def is_tlt(self) -> bool:
        """TLT on (SD in the tail, spot drafter training) rather than the plain baseline."""
        return bool(((self.config or {}).get("run") or {}).get("tlt", True))

    @property
    def is_resumable(self) -> bool:
        """A failed run (unless its config is bad) or a cancelled one whose job Ray has confirmed stopped."""
        if self.state == RunState.FAILED:
            return self.failure != Failure.CONFIG
        return self.state == RunState.CANCELLED and (self.job_stopped_at is not None or not self.submitted_at)


class MetricStep(models.Model):
    """One step's record from the trainer: {"step", "scalars", "series"}; upserted per (run, step)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_steps")
    step = models.PositiveIntegerField()
    scalars = models.JSONField(default=dict)
    series = models.JSONField(default=dict)
    received_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["step"]
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="metricstep_unique_run_step")]


class Artifact(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="artifacts")
    kind = models.CharField(max_length=30)  # drafter | policy | ...
    step = models.PositiveIntegerField()
    filename = models.CharField(max_length=255)
    path = models.CharField(max_length=500)  # relative to TLT_ARTIFACT_DIR
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    # The drafter version: SHA-256 over the archive's weight and config files (its model card left out,
    # since the card names the step), so checkpoints of an unchanged drafter are one version.
    content_sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    meta = models.JSONField(default=dict, blank=True)  # {"model_card": {...}} (export.model_card) when known
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["step", "kind"]
        constraints = [models.UniqueConstraint(fields=["run", "kind", "step"], name="artifact_unique_run_kind_step")]

    @property
    def team(self) -> Team:
        return self.run.team


class RolloutSample(models.Model):
    """A few of a step's responses as the policy generated them (series "rollout/samples").

    Kept out of MetricStep.series so the charts, which load every step's record, never read them.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="rollout_samples")
    step = models.PositiveIntegerField()
    sample = models.PositiveIntegerField()  # the sample's index in the step's rollout
    prompt = models.TextField()
    tokens = models.JSONField(default=list)  # [str]: the response, token by token
    from_draft = models.JSONField(default=list)  # [0|1] per token: 1 = proposed by the drafter and accepted
    drafted = models.PositiveIntegerField(default=0)  # sum(from_draft)
    reward = models.FloatField(null=True)
    length = models.PositiveIntegerField()
    truncated = models.BooleanField(default=False)

    class Meta:
        ordering = ["step", "sample"]
        constraints = [
            models.UniqueConstraint(fields=["run", "step", "sample"], name="rolloutsample_unique_run_step_sample")
        ]
        indexes = [models.Index(fields=["run", "step"], name="rolloutsample_run_step")]


class AlertKind(models.TextChoices):
    GREEDY_MISMATCH = "greedy_mismatch", "Losslessness check failed"  # audit/greedy_identical < 1
    ACCEPTANCE_COLLAPSE = "acceptance_collapse", "Acceptance collapsed"  # below half its running median
    DRAFTER_STALE = "drafter_stale", "Drafter stale"  # no applied update for N steps while the policy moves


class RunAlert(models.Model):
    """Something about a run that a person should look at; one row per (run, kind), raised once."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alerts")
    kind = models.CharField(max_length=30, choices=AlertKind.choices)
    step = models.PositiveIntegerField()  # the step at which it was raised
    message = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    # the team's webhook: "" (none set), pending, sent, failed (gave up after the task's retries)
    webhook_state = models.CharField(max_length=10, blank=True)
    webhook_attempts = models.PositiveSmallIntegerField(default=0)
    webhook_error = models.TextField(blank=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [models.UniqueConstraint(fields=["run", "kind"], name="runalert_unique_run_kind")]
