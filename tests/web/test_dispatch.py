"""Submitting, syncing and stopping Ray jobs, against a fake job client with Ray's interface."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.utils import timezone

from tltweb.accounts.services import token_matches
from tltweb.runs import selectors, services
from tltweb.runs.models import Run


class FakeJobs:
    """JobSubmissionClient's get_job_info / submit_job / stop_job / get_job_logs, in memory."""

    def __init__(self):
        self.jobs: dict[str, SimpleNamespace] = {}
        self.submitted: list[dict] = []
        self.stopped: list[str] = []
        self.stop_takes_effect = True  # False: Ray accepts the stop but the job keeps running for now

    def get_job_info(self, job_id):
        if job_id not in self.jobs:
            raise RuntimeError("Request failed with status code 404: Job does not exist.")
        return self.jobs[job_id]

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata=None):
        if submission_id in self.jobs:
            raise RuntimeError("already exists")
        self.jobs[submission_id] = SimpleNamespace(status="PENDING", message="", driver_exit_code=None)
        self.submitted.append(dict(entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env))
        return submission_id

    def stop_job(self, job_id):
        self.stopped.append(job_id)
        if self.stop_takes_effect:
            self.jobs[job_id].status = "STOPPED"
        return True

    def fail(self, job_id, exit_code, message=""):
        self.jobs[job_id].status = "FAILED"
        self.jobs[job_id].driver_exit_code = exit_code
        self.jobs[job_id].message = message or f"Job entrypoint command failed with exit code {exit_code}"

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
    if status == "FAILED":  # the trainer raised: a failure for a person to look at, not resumed on its own
        jobs.fail(run.submission_id, 1, "Job entrypoint command failed with exit code 1")
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == state
    if state in ("succeeded", "failed", "cancelled"):
        assert run.finished_at and run.log_tail.endswith("Traceback: boom")
        assert len(run.log_tail) <= services.LOG_TAIL_CHARS
    if state == "failed":
        assert "exit code 1" in run.error


def test_sync_leaves_finished_runs_alone(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    jobs.jobs[run.submission_id].status = "SUCCEEDED"
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "cancelled"


def test_sync_resumes_a_run_whose_job_vanished(run, jobs, settings, django_capture_on_commit_callbacks, monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    Run.objects.filter(pk=run.pk).update(submitted_at=timezone.now(), state="running")
    with django_capture_on_commit_callbacks(execute=True):
        services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "queued" and run.attempt == 1 and run.auto_resumes == 1 and sent == [str(run.id)]
    assert "disappeared" in run.attempts_log[-1]["error"] and run.attempts_log[-1]["resumed_by"] == "auto"
    assert run.submission_id == f"tlt-run-{run.id}-r1"


def test_a_vanished_job_fails_the_run_once_the_automatic_resumes_are_used_up(run, jobs, settings):
    settings.TLT_AUTO_RESUME_MAX = 0
    Run.objects.filter(pk=run.pk).update(submitted_at=timezone.now(), state="running")
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "failed" and "disappeared" in run.error and run.failure == "infra"
    assert run.is_resumable and run.ingest_token_revoked_at is not None


def test_sync_resubmits_runs_whose_submit_task_was_lost(run, jobs, monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    Run.objects.filter(pk=run.pk).update(queued_at=timezone.now() - timezone.timedelta(minutes=10))
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
    monkeypatch.setattr(services, "run_stop_job", lambda *, run_id: calls.append(("stop", run_id)) or True)
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


# ---- submit: the token is committed before the job exists ----

def test_a_submit_retried_after_the_job_was_created_hands_the_job_a_token_that_works(run, jobs, monkeypatch):
    """Ray created the job but the worker died before recording it: the retry finds the job, and the
    job's token is the one whose hash the platform has."""
    real_submit = jobs.submit_job

    def submit_then_crash(**kwargs):
        real_submit(**kwargs)
        raise ConnectionError("worker killed right after Ray took the job")

    monkeypatch.setattr(jobs, "submit_job", submit_then_crash)
    with pytest.raises(ConnectionError):
        services.run_submit(run_id=run.id, client=jobs)
    monkeypatch.setattr(jobs, "submit_job", real_submit)
    assert services.run_submit(run_id=run.id, client=jobs) == "exists"
    run.refresh_from_db()
    assert run.submitted_at and len(jobs.submitted) == 1
    assert token_matches(jobs.submitted[0]["runtime_env"]["env_vars"]["TLT_RUN_TOKEN"], run.ingest_token_hash)


def test_two_submits_racing_give_the_job_the_same_token(run, jobs, monkeypatch):
    """A duplicate task submits while the first is between its token commit and Ray: one job, one token."""
    real_submit = jobs.submit_job
    inner: list[str] = []

    def racing_submit(**kwargs):
        if not inner:
            inner.append("racing")
            inner[0] = services.run_submit(run_id=run.id, client=jobs)  # the duplicate wins the race
        return real_submit(**kwargs)

    monkeypatch.setattr(jobs, "submit_job", racing_submit)
    assert services.run_submit(run_id=run.id, client=jobs) == "exists"
    assert inner == ["submitted"] and len(jobs.submitted) == 1
    run.refresh_from_db()
    assert token_matches(jobs.submitted[0]["runtime_env"]["env_vars"]["TLT_RUN_TOKEN"], run.ingest_token_hash)


def test_a_run_cancelled_while_its_job_was_submitted_gets_the_job_stopped(run, jobs, monkeypatch):
    real_submit = jobs.submit_job

    def submit_and_cancel(**kwargs):
        out = real_submit(**kwargs)
        services.run_cancel(run=Run.objects.get(pk=run.pk))
        return out

    monkeypatch.setattr(jobs, "submit_job", submit_and_cancel)
    services.run_submit(run_id=run.id, client=jobs)
    run.refresh_from_db()
    assert run.state == "cancelled" and jobs.stopped == [run.submission_id] and run.job_stopped_at


def test_submit_gives_the_job_the_teams_folders_and_the_delivery_bounds(run, jobs, settings):
    services.run_submit(run_id=run.id, client=jobs)
    env = jobs.submitted[0]["runtime_env"]["env_vars"]
    assert env["TLT_DATA_ROOTS"] == str(settings.TLT_DATA_DIR / str(run.team_id))
    assert str(settings.TLT_MODELS_DIR) in env["TLT_MODEL_ROOTS"].split(":")
    assert env["TLT_INGEST_RETRY_S"] == str(settings.TLT_INGEST_RETRY_S)
    run.refresh_from_db()
    assert run.out_dir == str(settings.TLT_RUNS_DIR / str(run.team_id) / str(run.id))
    assert f"--out {run.out_dir}" in jobs.submitted[0]["entrypoint"] and "--resume" not in jobs.submitted[0]["entrypoint"]


# ---- resume ----

@pytest.mark.parametrize("exit_code,auto", [(-9, True), (137, True), (69, True), (75, True), (1, False), (2, False)])
def test_a_job_that_died_is_resumed_automatically_and_a_trainer_error_is_not(run, jobs, exit_code, auto):
    services.run_submit(run_id=run.id, client=jobs)
    jobs.fail(run.submission_id, exit_code)
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    if auto:
        assert run.state == "queued" and run.attempt == 1 and run.attempts_log[0]["state"] == "failed"
        assert run.attempts_log[0]["log_tail"].endswith("Traceback: boom")
    else:
        assert run.state == "failed" and run.attempt == 0
        assert run.failure == ("config" if exit_code == 2 else "trainer")
        assert run.is_resumable == (exit_code != 2)


def test_automatic_resumes_are_bounded(run, jobs, settings):
    settings.TLT_AUTO_RESUME_MAX = 2
    for attempt in range(3):
        services.run_submit(run_id=run.id, client=jobs)
        run.refresh_from_db()
        assert run.attempt == attempt
        jobs.fail(run.submission_id, -9)
        services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "failed" and run.auto_resumes == 2 and run.attempt == 2
    assert [j["submission_id"] for j in jobs.submitted] == [f"tlt-run-{run.id}", f"tlt-run-{run.id}-r1", f"tlt-run-{run.id}-r2"]


def test_a_resumed_job_runs_the_trainer_with_resume_in_the_same_folder_and_a_new_token(run, jobs, alice):
    services.run_submit(run_id=run.id, client=jobs)
    first = jobs.submitted[0]
    jobs.fail(run.submission_id, 1)
    services.runs_sync(client=jobs)
    services.run_resume(run=Run.objects.get(pk=run.pk), user=alice)
    services.run_submit(run_id=run.id, client=jobs)
    second = jobs.submitted[1]
    assert second["entrypoint"].endswith("--resume") and first["entrypoint"] + " --resume" == second["entrypoint"]
    old, new = (j["runtime_env"]["env_vars"]["TLT_RUN_TOKEN"] for j in (first, second))
    run.refresh_from_db()
    assert old != new and token_matches(new, run.ingest_token_hash) and run.ingest_token_revoked_at is None
    assert run.attempts_log[0]["resumed_by"] == "alice"


def test_a_resumed_run_starts_its_setup_progress_over(run, jobs, alice):
    """The old attempt's phase would otherwise carry on, with an ETA whose rate spans the gap."""
    services.run_progress_record(run=run, phase="rl", done=12, total=24)
    Run.objects.filter(pk=run.pk).update(state="failed", failure="trainer")
    services.run_resume(run=Run.objects.get(pk=run.pk), user=alice)
    run.refresh_from_db()
    assert run.progress == {} and selectors.run_progress(run) is None


def test_only_editors_resume_and_only_runs_that_ended(run, jobs, bob):
    from django.core.exceptions import PermissionDenied

    from tests.conftest import member_add
    from tltweb.runs.errors import RunStateError

    with pytest.raises(RunStateError):
        services.run_resume(run=run, user=run.creator)  # queued: nothing to resume
    Run.objects.filter(pk=run.pk).update(state="failed", failure="trainer")
    with pytest.raises(PermissionDenied):
        services.run_resume(run=run, user=bob)
    member_add(run.team, bob, "editor")
    assert services.run_resume(run=run, user=bob).state == "queued"


def test_a_cancelled_run_resumes_only_once_ray_confirmed_its_job_stopped(run, jobs, alice):
    from tltweb.runs.errors import RunStateError

    services.run_submit(run_id=run.id, client=jobs)
    jobs.jobs[run.submission_id].status = "RUNNING"
    services.run_cancel(run=Run.objects.get(pk=run.pk))
    with pytest.raises(RunStateError):
        services.run_resume(run=Run.objects.get(pk=run.pk), user=alice)
    assert services.run_stop_job(run_id=run.id, client=jobs) is True
    assert services.run_resume(run=Run.objects.get(pk=run.pk), user=alice).state == "queued"


# ---- cancel: the job is stopped until Ray confirms ----

def test_a_stop_ray_has_not_confirmed_is_retried_by_the_sync(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    jobs.jobs[run.submission_id].status = "RUNNING"
    services.run_cancel(run=Run.objects.get(pk=run.pk))
    jobs.stop_takes_effect = False
    assert services.run_stop_job(run_id=run.id, client=jobs) is False
    assert Run.objects.get(pk=run.pk).job_stopped_at is None
    services.runs_sync(client=jobs)  # the cancel task gave up: the sync keeps stopping it
    assert jobs.stopped == [run.submission_id] * 2
    jobs.stop_takes_effect = True
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert jobs.jobs[run.submission_id].status == "STOPPED" and run.job_stopped_at is not None
    services.runs_sync(client=jobs)
    assert len(jobs.stopped) == 3  # confirmed: never asked again


def test_the_cancel_task_retries_until_ray_confirms(run, monkeypatch):
    from celery.exceptions import Retry

    from workers import tasks

    answers = iter([False, True])
    monkeypatch.setattr(services, "run_stop_job", lambda *, run_id: next(answers))
    with pytest.raises(Retry):
        tasks.run_cancel.apply(args=[str(run.id)], throw=True)
    assert tasks.run_cancel.apply(args=[str(run.id)], throw=True).get() is True


def test_the_token_is_revoked_when_the_run_ends(run, jobs):
    services.run_submit(run_id=run.id, client=jobs)
    jobs.jobs[run.submission_id].status = "SUCCEEDED"
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    assert run.state == "succeeded" and run.ingest_token_revoked_at is not None
