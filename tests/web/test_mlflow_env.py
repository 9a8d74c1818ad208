"""The operator's MLflow setting reaches each run's Ray job (workers.tlt.train reads it there)."""

from __future__ import annotations

from tests.web.test_dispatch import FakeJobs
from tltweb.runs import services


def test_a_configured_mlflow_uri_goes_to_the_job_with_the_runs_name_and_team(run, settings):
    settings.TLT_MLFLOW_TRACKING_URI = "http://mlflow.internal:5000"
    settings.TLT_MLFLOW_EXPERIMENT = ""
    jobs = FakeJobs()
    services.run_submit(run_id=run.id, client=jobs)
    env = jobs.submitted[0]["runtime_env"]["env_vars"]
    assert env["TLT_MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000"
    assert env["TLT_MLFLOW_EXPERIMENT"] == "Alice's lab"  # the team's, unless one is configured
    assert env["TLT_RUN_NAME"] == "tiny run" and env["TLT_RUN_ID"] == str(run.id)


def test_no_mlflow_settings_reach_the_job_when_none_is_configured(run, settings):
    settings.TLT_MLFLOW_TRACKING_URI = ""
    jobs = FakeJobs()
    services.run_submit(run_id=run.id, client=jobs)
    assert not [k for k in jobs.submitted[0]["runtime_env"]["env_vars"] if "MLFLOW" in k]
