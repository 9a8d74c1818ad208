"""Rollout samples: stored apart from the step's series, replaced on a retried post, validated at
the boundary, browsable by step and filterable by reward and length (API and page), team-checked."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from tests.conftest import metrics_record_fake, rollout_samples_fake
from tltweb.runs.models import MetricStep, RolloutSample
from tltweb.runs.services import metrics_record


def _ingest(client, run, token, record):
    return client.post(reverse("ingest-metrics", args=[run.id]), data=json.dumps(record),
                       content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def _record(run, step):
    rec = metrics_record_fake(step)
    metrics_record(run=run, step=step, scalars=rec["scalars"], series=rec["series"])


def test_samples_are_stored_in_their_own_table_not_in_the_steps_series(client, run, run_token):
    assert _ingest(client, run, run_token, metrics_record_fake(2)).status_code == 200
    row = MetricStep.objects.get(run=run, step=2)
    assert "rollout/samples" not in row.series and "rollout/lengths" in row.series
    samples = list(RolloutSample.objects.filter(run=run, step=2))
    assert [s.sample for s in samples] == [0, 1, 2, 3]
    first = samples[0]
    assert first.tokens == ["<think>", " 3", " +", " 4"] and first.from_draft == [0, 1, 0, 0] and first.drafted == 1
    assert first.reward == 1.0 and first.length == 4 and not first.truncated and samples[3].truncated


def test_the_charts_endpoint_never_carries_the_samples(client, alice, run):
    _record(run, 1)
    client.force_login(alice)
    assert "rollout/samples" not in client.get(reverse("api-run-metrics-step", args=[run.id, 1])).json()["series"]


def test_a_retried_post_replaces_the_steps_samples(client, run, run_token):
    _ingest(client, run, run_token, metrics_record_fake(1))
    rec = metrics_record_fake(1)
    rec["series"]["rollout/samples"] = rollout_samples_fake(1, n=2)
    _ingest(client, run, run_token, rec)
    assert RolloutSample.objects.filter(run=run, step=1).count() == 2


@pytest.mark.parametrize("mutate,needle", [
    (lambda s: s[0].update(from_draft=[1]), "from_draft"),
    (lambda s: s[0].update(from_draft=[2, 0, 0, 0]), "from_draft"),
    (lambda s: s[0].pop("prompt"), "prompt"),
    (lambda s: s[0].update(length=-1), "length"),
    (lambda s: s.extend(rollout_samples_fake(0, n=1) * 64), "at most"),
])
def test_malformed_samples_are_refused_naming_what_is_wrong(client, run, run_token, mutate, needle):
    rec = metrics_record_fake(1)
    mutate(rec["series"]["rollout/samples"])
    resp = _ingest(client, run, run_token, rec)
    assert resp.status_code == 400 and "series" in resp.json()["errors"]
    assert needle in resp.json()["errors"]["series"]
    assert not MetricStep.objects.exists() and not RolloutSample.objects.exists()


def test_a_step_without_samples_keeps_the_ones_it_had(run):
    _record(run, 1)
    metrics_record(run=run, step=1, scalars={"reward/mean": 1.0}, series={})
    assert RolloutSample.objects.filter(run=run, step=1).count() == 4


def test_the_api_shows_the_newest_step_by_default_and_filters(client, alice, run):
    for step in (1, 2, 3):
        _record(run, step)
    client.force_login(alice)
    url = reverse("api-run-samples", args=[run.id])
    data = client.get(url).json()
    assert data["step"] == 3 and data["steps"] == [1, 2, 3] and len(data["samples"]) == 4
    assert data["samples"][0]["prompt"].startswith("step 3")
    one = client.get(url, {"step": 1, "min_reward": 0.5, "max_length": 8}).json()
    assert [s["sample"] for s in one["samples"]] == [0]
    assert [s["sample"] for s in client.get(url, {"step": 2, "min_length": 10}).json()["samples"]] == [2, 3]
    assert [s["sample"] for s in client.get(url, {"step": 2, "max_reward": 0.5}).json()["samples"]] == [1, 3]


def test_the_api_answers_an_empty_list_for_a_run_without_samples(client, alice, run):
    client.force_login(alice)
    assert client.get(reverse("api-run-samples", args=[run.id])).json() == {"step": None, "steps": [], "samples": []}


def test_the_sample_page_marks_drafted_tokens_and_pages_through_steps(client, alice, run):
    for step in (1, 2):
        _record(run, step)
    client.force_login(alice)
    html = client.get(reverse("run-samples", args=[run.id]), {"step": 1}).content.decode()
    assert "step 1 problem 0" in html and html.count('class="tok from-draft"') == 1 + 4  # samples 0 and 2
    assert 'id="next-step"' in html and 'id="prev-step"' not in html
    filtered = client.get(reverse("run-samples", args=[run.id]), {"step": 1, "min_length": 12}).content.decode()
    assert "step 1 problem 2" in filtered and "step 1 problem 0" not in filtered


def test_the_sample_page_says_when_there_are_none(client, alice, run):
    client.force_login(alice)
    assert 'id="no-samples"' in client.get(reverse("run-samples", args=[run.id])).content.decode()


def test_the_sample_page_and_api_are_for_the_team_only(client, run, bob, charlie):
    _record(run, 1)
    client.force_login(charlie)
    assert client.get(reverse("run-samples", args=[run.id])).status_code == 404
    assert client.get(reverse("api-run-samples", args=[run.id])).status_code == 404
    client.force_login(bob)
    assert client.get(reverse("run-samples", args=[run.id])).status_code == 200
    client.logout()
    assert client.get(reverse("run-samples", args=[run.id])).status_code == 302


def test_the_run_page_links_to_the_samples_once_there_are_some(client, alice, run):
    client.force_login(alice)
    assert 'id="samples-link" hidden' in client.get(reverse("run-detail", args=[run.id])).content.decode()
    _record(run, 1)
    assert 'id="samples-link">' in client.get(reverse("run-detail", args=[run.id])).content.decode()
