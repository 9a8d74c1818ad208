"""Submitting, syncing and stopping Ray jobs, against a fake job client with Ray's interface."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.utils import timezone

from tltweb.accounts.services import token_matches
from tltweb.runs import services
from tltweb.runs.models import Run


class FakeJobs:
    """JobSubmissionClient's get_job_info / submit_job / stop_job / get_job_logs, in memory."""

    def __init__(self):
        self.jobs: dict[str, SimpleNamespace] = {}
        self.submitted: list[dict] = []
        self.stopped: list[str] = []

    def get_job_info(self, job_id):
        if job_id not in self.jobs:
            raise RuntimeError("Request failed with status code 404: Job does not exist.")
        return self.jobs[job_id]

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata=None):
        if submission_id in self.jobs:
            raise RuntimeError("already exists")
        self.jobs[submission_id] = SimpleNamespace(status="PENDING", message="")
        self.submitted.append(dict(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env))
        return submission_id

    def stop_job(self, job_id):
        self.stopped.append(job_id)
        self.jobs[job_id].status = "STOPPED"
        return True

    def get_job_logs(self, job_id):
        return "line\n" * 5000 + "Traceback: boom"


@pytest.fixture
def jobs():
    return FakeJobs()


def test_submit_starts_the_trainer_with_the_config_ingest_url_and_token(run, jobs, settings):
    assert services.run_submit(run_id=run.id, client=jobs) == "submitted"
    job = jobs.submitted[0]
    assert job["submission_id"] == f"tlt-run-{run.id}"
    assert "-m workers.tlt.train --out" in job["entrypoint"] and str(run.id) in job["entrypoint"]
    env = job["runtime_env"]["env_vars"]
    assert env["TLT_CONFIG"] == run.config_yaml
    assert env["TLT_INGEST_URL"] == f"{settings.TLT_PUBLIC_URL}/api/ingest/runs/{run.id}/"
    run.refresh_from_db()
    assert token_matches(env["TLT_RUN_TOKEN"], run.ingest_token_hash)
    assert env["TLT_RUN_TOKEN"] not in run.ingest_token_hash and run.submitted_at


def test_submit_is_idempotent(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    token_hash = Run.objects.get(pk=run.pk).ingest_token_hash
    assert services.run_submit(run_id=run.id, client=jobs) == "exists"
    assert len(jobs.submitted) == 1
    assert Run.objects.get(pk=run.pk).ingest_token_hash == token_hash  # the job's token still works


def test_submit_finds_a_job_submitted_before_a_crash(run, jobs):
    jobs.jobs[run.submission_id] = SimpleNamespace(status="RUNNING", message="")
    assert services.run_submit(run_id=run.id, client=jobs) == "exists"
    assert not jobs.submitted


def test_submit_skips_cancelled_and_unknown_runs(run, jobs):
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    assert services.run_submit(run_id=run.id, client=jobs) == "skipped"
    assert services.run_submit(run_id="00000000-0000-0000-0000-000000000000", client=jobs) == "skipped"
    assert not jobs.submitted


@pytest.mark.parametrize(
    "status,state", [("PENDING", "queued"), ("RUNNING", "running"), ("SUCCEEDED", "succeeded"), ("FAILED", "failed"), ("STOPPED", "cancelled")]
)
def test_sync_maps_ray_job_status_to_run_state(run, jobs, status, state):
    services.run_submit(run_id=run.id, client=jobs)
    jobs.jobs[run.submission_id].status = status
    jobs.jobs[run.submission_id].message = "Job failed: exit 1" if status == "FAILED" else ""
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == state
    if state in ("succeeded", "failed", "cancelled"):
        assert run.finished_at and run.log_tail.endswith("Traceback: boom")
        assert len(run.log_tail) <= services.LOG_TAIL_CHARS
    if state == "failed":
        assert "exit 1" in run.error


def test_sync_leaves_finished_runs_alone(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    jobs.jobs[run.submission_id].status = "SUCCEEDED"
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "cancelled"


def test_sync_fails_a_run_whose_job_vanished(run, jobs):
    Run.objects.filter(pk=run.pk).update(submitted_at=timezone.now())
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "failed" and "disappeared" in run.error


def test_sync_resubmits_runs_whose_submit_task_was_lost(run, jobs, monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    Run.objects.filter(pk=run.pk).update(created_at=timezone.now() - timezone.timedelta(minutes=10))
    services.runs_sync(client=jobs)
    assert sent == [str(run.id)]


def test_stop_job_stops_a_running_job_and_keeps_the_run_cancelled(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    services.run_cancel(run=run)
    services.run_stop_job(run_id=run.id, client=jobs)
    assert jobs.stopped == [run.submission_id]
    run.refresh_from_db()
    assert run.state == "cancelled"


def test_stop_job_without_a_job_does_nothing(run, jobs):
    services.run_stop_job(run_id=run.id, client=jobs)
    assert not jobs.stopped


def test_the_celery_tasks_are_thin_and_call_services(run, monkeypatch):
    from workers import tasks

    calls = []
    monkeypatch.setattr(services, "run_submit", lambda *, run_id: calls.append(("submit", run_id)) or "submitted")
    monkeypatch.setattr(services, "run_stop_job", lambda *, run_id: calls.append(("stop", run_id)))
    monkeypatch.setattr(services, "runs_sync", lambda: calls.append(("sync",)) or 0)
    tasks.run_submit.apply(args=[str(run.id)]).get()
    tasks.run_cancel.apply(args=[str(run.id)]).get()
    tasks.runs_sync.apply().get()
    assert calls == [("submit", str(run.id)), ("stop", str(run.id)), ("sync",)]


def test_a_submit_that_keeps_failing_marks_the_run_failed(run, monkeypatch):
    from workers import tasks

    def boom(*, run_id):
        raise ConnectionError("Ray is down")

    monkeypatch.setattr(services, "run_submit", boom)
    monkeypatch.setattr(tasks.run_submit, "max_retries", 0)
    tasks.run_submit.apply(args=[str(run.id)])
    run.refresh_from_db()
    assert run.state == "failed" and "Ray is down" in run.error


def test_the_celery_app_reads_django_settings():
    from workers.celery_app import app

    assert app.conf.worker_redirect_stdouts is False
    assert "runs-sync" in app.conf.beat_schedule
    assert app.conf.beat_schedule["runs-sync"]["task"] == "workers.tasks.runs_sync"


def test_the_ray_client_sends_the_clusters_auth_token(monkeypatch, tmp_path):
    from tltweb.runs.dispatch import ray_auth_headers

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    assert ray_auth_headers() == {}
    (tmp_path / "auth_token").write_text("abc123\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    assert ray_auth_headers() == {"Authorization": "Bearer abc123"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert ray_auth_headers() == {"Authorization": "Bearer from-env"}


def test_sync_keeps_run_states_while_ray_is_unreachable(run, monkeypatch):
    from tltweb.runs import dispatch

    def down():
        raise ConnectionError("Failed to connect to Ray")

    monkeypatch.setattr(dispatch, "ray_client", down)
    Run.objects.filter(pk=run.pk).update(submitted_at=timezone.now(), state="running")
    assert services.runs_sync() == 1
    run.refresh_from_db()
    assert run.state == "running"
