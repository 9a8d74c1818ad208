"""The API's errors are JSON in one shape: 400 names the field, 404 for unknown or unseen ids and
paths, 405 says which methods, 409 for actions the run's state does not allow."""

from __future__ import annotations

import json
import uuid

import pytest
from django.urls import reverse

from tltweb.accounts.services import api_token_create
from tltweb.runs.models import Run


@pytest.fixture
def auth(alice):
    return {"HTTP_AUTHORIZATION": f"Bearer {api_token_create(user=alice, name='t')[1]}"}


def _patch(client, run, body, auth):
    return client.patch(reverse("api-run", args=[run.id]), data=json.dumps(body), content_type="application/json", **auth)


@pytest.mark.parametrize("name", ["", "   "])
def test_it_rejects_a_blank_name_naming_the_field_and_keeps_the_old_one(client, run, auth, name):
    resp = _patch(client, run, {"name": name}, auth)
    assert resp.status_code == 400
    assert "name" in resp.json()["errors"] and "blank" in resp.json()["errors"]["name"]
    run.refresh_from_db()
    assert run.name == "tiny run"


def test_it_renames_a_run(client, run, auth):
    resp = _patch(client, run, {"name": "  better name "}, auth)
    assert resp.status_code == 200 and resp.json()["name"] == "better name"


def test_it_names_an_unknown_field(client, run, auth):
    resp = _patch(client, run, {"colour": "red"}, auth)
    assert resp.status_code == 400 and "colour" in resp.json()["errors"]


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_cancelling_an_ended_run_is_a_conflict_and_changes_nothing(client, run, auth, state):
    Run.objects.filter(pk=run.pk).update(state=state)
    resp = client.post(reverse("api-run-cancel", args=[run.id]), **auth)
    assert resp.status_code == 409
    assert state in resp.json()["error"]
    run.refresh_from_db()
    assert run.state == state and run.finished_at is None


def test_cancelling_a_queued_run_answers_the_cancelled_run(client, run, auth):
    resp = client.post(reverse("api-run-cancel", args=[run.id]), **auth)
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"


def test_the_cancel_button_on_an_ended_run_says_why_nothing_happened(client, run, alice):
    Run.objects.filter(pk=run.pk).update(state="succeeded")
    client.force_login(alice)
    resp = client.post(reverse("run-cancel", args=[run.id]), follow=True)
    assert resp.status_code == 200 and "Not cancelled" in resp.content.decode()


def test_resuming_a_failed_run_queues_its_next_attempt(client, run, auth):
    Run.objects.filter(pk=run.pk).update(state="failed", failure="trainer", error="boom")
    resp = client.post(reverse("api-run-resume", args=[run.id]), **auth)
    assert resp.status_code == 200
    body = resp.json()
    assert (body["state"], body["attempt"], body["resumable"]) == ("queued", 1, False)
    assert [(a["attempt"], a["state"], a["failure"], a["resumed_by"]) for a in body["attempts"]] == [
        (0, "failed", "trainer", "alice")]


@pytest.mark.parametrize("state,failure", [("running", ""), ("queued", ""), ("failed", "config")])
def test_resuming_a_run_that_cannot_be_resumed_is_a_conflict_and_changes_nothing(client, run, auth, state, failure):
    Run.objects.filter(pk=run.pk).update(state=state, failure=failure)
    resp = client.post(reverse("api-run-resume", args=[run.id]), **auth)
    assert resp.status_code == 409 and "cannot be resumed" in resp.json()["error"]
    run.refresh_from_db()
    assert run.state == state and run.attempt == 0


def test_the_resume_button_on_a_running_run_says_why_nothing_happened(client, run, alice):
    Run.objects.filter(pk=run.pk).update(state="running")
    client.force_login(alice)
    resp = client.post(reverse("run-resume", args=[run.id]), follow=True)
    assert resp.status_code == 200 and "cannot be resumed" in resp.content.decode()


@pytest.mark.parametrize("path", ["/api/runs/not-a-uuid", "/api/runs/not-a-uuid/metrics", f"/api/runs/{uuid.uuid4()}"])
def test_a_bad_or_unknown_run_id_is_a_json_404(client, auth, path):
    resp = client.get(path, **auth)
    assert resp.status_code == 404 and resp["Content-Type"].startswith("application/json")
    assert resp.json()["error"] == "no such run"


def test_an_unknown_api_path_is_a_json_404(client, auth):
    resp = client.get("/api/nothing/here", **auth)
    assert resp.status_code == 404 and "no such API endpoint" in resp.json()["error"]


def test_a_wrong_method_is_a_json_405_with_allow(client, run, auth):
    resp = client.delete(reverse("api-run", args=[run.id]), **auth)
    assert resp.status_code == 405 and "GET" in resp["Allow"] and "PATCH" in resp["Allow"]
    assert "not allowed" in resp.json()["error"]


@pytest.mark.parametrize("query,field", [({"since": "abc"}, "since"), ({"since": "-5"}, "since")])
def test_a_bad_query_parameter_is_named(client, run, auth, query, field):
    resp = client.get(reverse("api-run-metrics", args=[run.id]), query, **auth)
    assert resp.status_code == 400 and field in resp.json()["errors"]


def test_an_unknown_sort_is_named(client, run, auth):
    resp = client.get(reverse("api-runs"), {"sort": "colour"}, **auth)
    assert resp.status_code == 400 and "sort" in resp.json()["errors"]


def test_a_bad_token_is_a_401_that_says_how_to_authenticate(client, run):
    resp = client.get(reverse("api-run", args=[run.id]), HTTP_AUTHORIZATION="Bearer tlt_nope")
    assert resp.status_code == 401 and resp["WWW-Authenticate"].startswith("Bearer")
    assert "token" in resp.json()["error"]


def test_a_bad_token_wins_over_a_valid_session(client, run, alice):
    client.force_login(alice)
    assert client.get(reverse("api-run", args=[run.id]), HTTP_AUTHORIZATION="Bearer tlt_nope").status_code == 401


def test_the_root_of_the_api_leads_to_its_docs(client):  # which ask for a login
    resp = client.get("/api/")
    assert resp.status_code == 302 and resp.url == "/api/docs"


def test_viewers_get_a_403_launching_through_the_api(client, bob):
    resp = client.post(reverse("api-runs"), data=json.dumps({"preset": "tiny-cpu"}), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {api_token_create(user=bob, name='t')[1]}")
    assert resp.status_code == 403 and "editor" in resp.json()["error"]
