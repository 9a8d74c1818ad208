"""The trainer's ingestion endpoints: run-token auth, idempotent per step, streamed artifacts."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
from django.db import transaction
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


def test_it_does_not_revive_or_change_a_cancelled_run(client, run, run_token):
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    resp = _post_metrics(client, run, run_token, metrics_record_fake(5))
    assert resp.status_code == 403 and "immutable" in resp.json()["error"]
    run.refresh_from_db()
    assert run.state == "cancelled" and not MetricStep.objects.exists()


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_a_run_that_ended_rejects_metrics_and_artifacts_and_keeps_its_data(client, run, run_token, state):
    from tltweb.runs import services

    assert _post_metrics(client, run, run_token, metrics_record_fake(1)).status_code == 200
    assert _upload(client, run, run_token, content=b"the real drafter").status_code == 201
    with transaction.atomic():
        services._finish(Run.objects.select_for_update().get(pk=run.pk), state)  # what sync/cancel/fail do
    forged = metrics_record_fake(1)
    forged["scalars"]["reward/mean"] = 99.0
    for resp in (_post_metrics(client, run, run_token, forged), _post_metrics(client, run, run_token, metrics_record_fake(2)),
                 _upload(client, run, run_token, content=b"a forged drafter"), _upload(client, run, run_token, step="9")):
        assert resp.status_code == 403, resp.content
        assert "ended" in resp.json()["error"] and "immutable" in resp.json()["error"]
    assert MetricStep.objects.get(run=run).scalars["reward/mean"] == metrics_record_fake(1)["scalars"]["reward/mean"]
    assert list(Artifact.objects.filter(run=run).values_list("sha256", flat=True)) == [hashlib.sha256(b"the real drafter").hexdigest()]


def _upload(client, run, token, *, kind="drafter", step="2", content=b"PK\x03\x04 drafter", size=None, sha256=None):
    return client.post(
        reverse("ingest-artifacts", args=[run.id]),
        {"kind": kind, "step": step, "size": str(len(content) if size is None else size),
         "sha256": hashlib.sha256(content).hexdigest() if sha256 is None else sha256, "file": io.BytesIO(content)},
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


def django_capture_on_commit_callbacks_ctx():
    from django.test import TestCase

    return TestCase.captureOnCommitCallbacks(execute=True)


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


@pytest.mark.parametrize("size,sha", [(5, None), (None, "0" * 64), (10**9, None)])
def test_an_artifact_that_differs_from_what_the_sender_measured_is_refused_and_not_stored(client, run, run_token, settings, size, sha):
    resp = _upload(client, run, run_token, content=b"x" * 1000, size=size, sha256=sha)
    assert resp.status_code == 400 and "nothing stored" in resp.json()["errors"]["file"]
    assert not Artifact.objects.exists()
    assert not [p for p in settings.TLT_ARTIFACT_DIR.rglob("*") if p.is_file()]


@pytest.mark.parametrize("missing", ["size", "sha256"])
def test_an_artifact_without_its_size_or_sha256_is_refused(client, run, run_token, missing):
    data = {"kind": "drafter", "step": "1", "size": "3", "sha256": hashlib.sha256(b"abc").hexdigest(), "file": io.BytesIO(b"abc")}
    del data[missing]
    resp = client.post(reverse("ingest-artifacts", args=[run.id]), data, HTTP_AUTHORIZATION=f"Bearer {run_token}")
    assert resp.status_code == 400 and missing in resp.json()["errors"]


def test_a_replaced_artifact_gets_a_new_file_and_the_old_one_goes(client, run, run_token, settings):
    _upload(client, run, run_token, content=b"first")
    first = Artifact.objects.get(run=run).path
    with django_capture_on_commit_callbacks_ctx():
        _upload(client, run, run_token, content=b"second")
    second = Artifact.objects.get(run=run).path
    assert first != second and (settings.TLT_ARTIFACT_DIR / second).read_bytes() == b"second"
    assert not (settings.TLT_ARTIFACT_DIR / first).exists()


def test_the_trainers_http_sink_talks_to_the_endpoints(live_server, run, run_token, tmp_path):
    """The real contract class from workers/tlt/metrics.py against the real endpoints."""
    from workers.tlt.metrics import HttpSink

    sink = HttpSink(f"{live_server.url}/api/ingest/runs/{run.id}/", run_token, retry_s=1)
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
