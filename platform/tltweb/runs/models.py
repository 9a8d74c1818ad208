"""Runs, their per-step metrics and their artifacts. Everything belongs to a team."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from tltweb.accounts.models import Team


class RunState(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


ACTIVE_STATES = (RunState.QUEUED, RunState.RUNNING)


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

    state = models.CharField(max_length=10, choices=RunState.choices, default=RunState.QUEUED, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    log_tail = models.TextField(blank=True)
    ingest_token_hash = models.CharField(max_length=64, blank=True)  # SHA-256 of the run's token
    # The trainer's latest setup/training progress (services.run_progress_record): phase, done,
    # total, message, when the phase began and where it stood then (the ETA's rate), finished phases.
    progress = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"

    @property
    def submission_id(self) -> str:
        """The Ray job id: derived from the run, so a retried submit finds the same job."""
        return f"tlt-run-{self.id}"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES


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
