"""The trainer's progress through setup and RL: the ingestion endpoint, the ETA from the rate, and
what the run page and the API show."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from tltweb.runs import selectors, services
from tltweb.runs.models import Run


def _post(client, run, token, body):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(reverse("ingest-progress", args=[run.id]), data=json.dumps(body),
                       content_type="application/json", **headers)


def _age(run, seconds):
    """Pretend the current phase began `seconds` ago."""
    run.refresh_from_db()
    p = dict(run.progress)
    p["began_at"] = (timezone.now() - timedelta(seconds=seconds)).isoformat()
    Run.objects.filter(pk=run.pk).update(progress=p)
    run.refresh_from_db()


def test_it_keeps_the_latest_progress_and_marks_a_queued_run_running(client, run, run_token):
    resp = _post(client, run, run_token, {"phase": "policy", "done": 30, "total": 300, "message": "SFT step 30/300"})
    assert resp.status_code == 200 and resp.json()["progress"]["label"] == "Policy preparation (SFT)"
    run.refresh_from_db()
    assert run.state == "running" and run.started_at
    assert run.progress["phase"] == "policy" and run.progress["done"] == 30 and run.progress["message"] == "SFT step 30/300"


def test_the_eta_comes_from_the_phases_rate_so_far(run):
    services.run_progress_record(run=run, phase="policy", done=0, total=300)
    _age(run, 10)
    services.run_progress_record(run=run, phase="policy", done=100, total=300)  # 10 steps/s
    p = selectors.run_progress(Run.objects.get(pk=run.pk))
    assert p["rate_per_s"] == pytest.approx(10, rel=0.05)
    assert p["eta_s"] == pytest.approx(20, rel=0.05)
    assert p["fraction"] == pytest.approx(1 / 3)


def test_a_new_phase_starts_its_own_clock_and_the_old_one_joins_the_history(run):
    services.run_progress_record(run=run, phase="policy", done=0, total=300)
    _age(run, 42)
    services.run_progress_record(run=run, phase="policy", done=300, total=300)
    services.run_progress_record(run=run, phase="drafter_warmup", done=0, total=200)
    p = selectors.run_progress(Run.objects.get(pk=run.pk))
    assert p["phase"] == "drafter_warmup" and p["eta_s"] is None  # no rate yet
    assert [h["phase"] for h in p["history"]] == ["policy"]
    assert p["history"][0]["seconds"] == pytest.approx(42, abs=1)
    assert p["history"][0]["label"] == "Policy preparation (SFT)"


def test_there_is_no_eta_once_the_run_has_ended(run):
    services.run_progress_record(run=run, phase="rl", done=0, total=10)
    _age(run, 5)
    services.run_progress_record(run=run, phase="rl", done=5, total=10)
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    assert selectors.run_progress(Run.objects.get(pk=run.pk))["eta_s"] is None


def test_progress_does_not_revive_a_cancelled_run(client, run, run_token):
    # state changed behind the token's back: the check under the row lock refuses it (#12: an ended run is immutable)
    Run.objects.filter(pk=run.pk).update(state="cancelled")
    resp = _post(client, run, run_token, {"phase": "rl", "done": 1, "total": 10})
    assert resp.status_code == 403 and "immutable" in resp.json()["error"]
    run.refresh_from_db()
    assert run.state == "cancelled" and run.progress == {}


@pytest.mark.parametrize("body,field", [
    ({"phase": "Policy!", "done": 1, "total": 2}, "phase"),
    ({"phase": "rl", "done": -1, "total": 2}, "done"),
    ({"phase": "rl", "done": 1}, "total"),
    ({"phase": "rl", "done": 1, "total": 2, "extra": 1}, "extra"),
])
def test_it_rejects_bad_progress_naming_the_field(client, run, run_token, body, field):
    resp = _post(client, run, run_token, body)
    assert resp.status_code == 400 and field in resp.json()["errors"]
    run.refresh_from_db()
    assert run.progress == {}


def test_progress_needs_the_runs_own_token(client, run, run_token):
    body = {"phase": "rl", "done": 1, "total": 2}
    assert _post(client, run, None, body).status_code == 401
    assert _post(client, run, run_token + "x", body).status_code == 403


def test_the_metrics_poll_and_the_run_api_carry_the_progress(client, alice, run):
    services.run_progress_record(run=run, phase="actors", done=1, total=2, message="starting 2 rollout workers")
    client.force_login(alice)
    polled = client.get(reverse("api-run-metrics", args=[run.id])).json()
    assert polled["progress"]["phase"] == "actors" and polled["progress"]["done"] == 1
    detail = client.get(reverse("api-run", args=[run.id])).json()
    assert detail["phase"] == "Starting actors" and detail["phase_fraction"] == 0.5


def test_the_run_page_shows_the_phase_and_its_progress(client, alice, run):
    services.run_progress_record(run=run, phase="drafter_warmup", done=50, total=200, message="training the drafter")
    client.force_login(alice)
    html = client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert 'id="progress"' in html and 'id="progress" hidden' not in html.replace("\n", "")
    assert "Drafter warm-up" in html and "50/200" in html and "training the drafter" in html


def test_the_trainers_http_sink_reports_progress_to_the_endpoint(live_server, run, run_token):
    from workers.tlt.metrics import HttpSink

    sink = HttpSink(f"{live_server.url}/api/ingest/runs/{run.id}/", run_token, retry_s=5)
    sink.progress("policy", 120, 300, "SFT step 120/300")
    sink.close()
    run.refresh_from_db()
    assert run.progress["done"] == 120 and run.progress["total"] == 300


def test_the_http_sinks_progress_never_kills_the_training(run, caplog):
    from workers.tlt.metrics import HttpSink

    sink = HttpSink("http://127.0.0.1:9/api/ingest/runs/x/", "token", retry_s=5)  # nothing listens on port 9
    sink.progress("rl", 1, 10)  # logged, not raised
    sink.close()
    assert "progress failed" in caplog.text
