"""The trainer's ingestion endpoints: run-token auth, idempotent per step, streamed artifacts."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
from django.urls import reverse

from tests.conftest import metrics_record_fake
from tltweb.runs.models import Artifact, MetricStep, Run


def _post_metrics(client, run, token, record, **extra):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token is not None else {}
    return client.post(
        reverse("ingest-metrics", args=[run.id]), data=json.dumps(record), content_type="application/json", **headers, **extra
    )


def test_it_stores_a_step_and_marks_a_queued_run_running(client, run, run_token):
    resp = _post_metrics(client, run, run_token, metrics_record_fake(0))
    assert resp.status_code == 200
    row = MetricStep.objects.get(run=run, step=0)
    assert row.series["rollout/lengths"][-1] == 190
    run.refresh_from_db()
    assert run.state == "running" and run.started_at is not None


def test_it_is_idempotent_per_step(client, run, run_token):
    for value in (0.1, 0.7):
        record = metrics_record_fake(3)
        record["scalars"]["reward/mean"] = value
        assert _post_metrics(client, run, run_token, record).status_code == 200
    rows = MetricStep.objects.filter(run=run)
    assert rows.count() == 1 and rows.get().scalars["reward/mean"] == 0.7


def test_it_rejects_a_missing_token_with_401(client, run, run_token):
    assert _post_metrics(client, run, None, metrics_record_fake(0)).status_code == 401
    assert not MetricStep.objects.exists()


def test_it_rejects_a_wrong_token_with_403(client, run, run_token):
    assert _post_metrics(client, run, run_token + "x", metrics_record_fake(0)).status_code == 403
    assert not MetricStep.objects.exists()


def test_it_rejects_another_runs_token(client, run, run_token, team, alice):
    from tests.conftest import run_make

    other = run_make(team, alice, name="other")
    assert _post_metrics(client, other, run_token, metrics_record_fake(0)).status_code == 403


def test_it_rejects_everything_before_the_run_has_a_token(client, run):
    assert _post_metrics(client, run, "", metrics_record_fake(0)).status_code == 401
    assert _post_metrics(client, run, "anything", metrics_record_fake(0)).status_code == 403


def test_it_rejects_personal_sessions(client, run, run_token, alice):
    client.force_login(alice)
    assert _post_metrics(client, run, None, metrics_record_fake(0)).status_code == 401


@pytest.mark.parametrize(
    "body",
    [
        {"scalars": {}},  # no step
        {"step": -1, "scalars": {}},
        {"step": 1, "scalars": {"reward/mean": "high"}},
        {"step": 1, "scalars": {}, "surprise": 1},
        [1, 2, 3],
    ],
)
def test_it_rejects_bad_bodies_with_400_and_stores_nothing(client, run, run_token, body):
    resp = _post_metrics(client, run, run_token, body)
    assert resp.status_code == 400 and resp.json()["error"]
    assert not MetricStep.objects.exists()
    run.refresh_from_db()
    assert run.state == "queued"


def test_it_rejects_non_json_with_400(client, run, run_token):
    resp = client.post(
        reverse("ingest-metrics", args=[run.id]), data=b"{not json", content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {run_token}",
    )
    assert resp.status_code == 400


def test_it_stores_nan_as_null(client, run, run_token):
    resp = client.post(
        reverse("ingest-metrics", args=[run.id]), data=b'{"step": 0, "scalars": {"drafter/loss": NaN}, "series": {}}',
        content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {run_token}",
    )
    assert resp.status_code == 200
    assert MetricStep.objects.get(run=run).scalars["drafter/loss"] is None


def test_it_does_not_revive_a_cancelled_run(client, run, run_token):
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    assert _post_metrics(client, run, run_token, metrics_record_fake(5)).status_code == 200
    run.refresh_from_db()
    assert run.state == "cancelled"


def _upload(client, run, token, *, kind="drafter", step="2", content=b"PK\x03\x04 drafter"):
    return client.post(
        reverse("ingest-artifacts", args=[run.id]),
        {"kind": kind, "step": step, "file": io.BytesIO(content)},
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


def test_it_stores_an_artifact_with_size_and_sha256(client, run, run_token, settings):
    content = b"PK\x03\x04" + b"x" * 100_000
    resp = _upload(client, run, run_token, content=content)
    assert resp.status_code == 201
    artifact = Artifact.objects.get(run=run)
    assert artifact.size == len(content)
    assert artifact.sha256 == hashlib.sha256(content).hexdigest()
    assert (settings.TLT_ARTIFACT_DIR / artifact.path).read_bytes() == content


def test_a_retried_artifact_upload_replaces_the_first(client, run, run_token):
    _upload(client, run, run_token, content=b"first")
    _upload(client, run, run_token, content=b"second")
    artifact = Artifact.objects.get(run=run)
    assert artifact.sha256 == hashlib.sha256(b"second").hexdigest()


@pytest.mark.parametrize("kind,step", [("", "1"), ("../etc", "1"), ("drafter", "x"), ("drafter", "-3")])
def test_it_rejects_bad_artifact_fields(client, run, run_token, kind, step):
    assert _upload(client, run, run_token, kind=kind, step=step).status_code == 400
    assert not Artifact.objects.exists()


def test_it_rejects_an_artifact_with_a_wrong_token(client, run, run_token):
    assert _upload(client, run, "nope").status_code == 403
    assert not Artifact.objects.exists()


def test_the_trainers_http_sink_talks_to_the_endpoints(live_server, run, run_token, tmp_path):
    """The real contract class from workers/tlt/metrics.py against the real endpoints."""
    from workers.tlt.metrics import HttpSink

    sink = HttpSink(f"{live_server.url}/api/ingest/runs/{run.id}/", run_token, retries=1)
    rec = metrics_record_fake(1)
    sink.log(rec["step"], rec["scalars"], rec["series"])
    zip_path = tmp_path / "drafter.zip"
    zip_path.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    sink.artifact("drafter", 1, zip_path)
    sink.close()
    assert MetricStep.objects.filter(run=run, step=1).exists()
    assert Artifact.objects.filter(run=run, kind="drafter", step=1).exists()


def test_a_rejected_upload_leaves_no_partial_files(client, run, run_token, settings):
    _upload(client, run, run_token, kind="../bad", content=b"x" * 5000)
    leftovers = [p for p in settings.TLT_ARTIFACT_DIR.rglob("*") if p.is_file()] if settings.TLT_ARTIFACT_DIR.exists() else []
    assert leftovers == []


def test_an_upload_over_the_size_limit_is_refused_and_removed(client, run, run_token, settings):
    settings.TLT_MAX_ARTIFACT_BYTES = 1000
    resp = _upload(client, run, run_token, content=b"x" * 200_000)
    assert resp.status_code == 400
    assert not Artifact.objects.exists()
    assert not [p for p in settings.TLT_ARTIFACT_DIR.rglob("*") if p.is_file()]
