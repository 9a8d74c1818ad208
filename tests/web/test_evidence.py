"""TLT's evidence (#14) on the real database: the A/B partner and its figures, the parity test,
alerts and the team webhook (a real local HTTP server), the drafter registry's dedup and model card,
and the long-tail prompt history. The real-run, in-browser flow is in test_integration_evidence.py."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from django.core.exceptions import PermissionDenied
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from tests.conftest import member_add, run_make
from tltweb.accounts.services import api_token_create
from tltweb.runs import evidence, selectors, services
from tltweb.runs.models import RunAlert


def _record(run, step, **scalars):
    services.metrics_record(run=run, step=step, scalars=scalars, series={})


def _baseline_of(run, **fields):
    cfg = dict(run.config, run={**run.config["run"], "tlt": False})
    return run_make(run.team, run.creator, name="control", config=cfg, ab_partner=run, **fields)


# ---- A/B ----

def test_the_control_is_the_same_config_and_seed_with_tlt_off_and_linked(alice, team, run, django_capture_on_commit_callbacks,
                                                                         monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    with django_capture_on_commit_callbacks(execute=True):
        control = services.run_launch_control(user=alice, run=run)
    assert control.ab_partner == run and sent == [str(control.id)]
    assert control.config["run"]["tlt"] is False and run.config["run"]["tlt"] is True
    assert control.config["run"]["seed"] == run.config["run"]["seed"]
    differ = {d["key"] for d in selectors.config_diff([run.config, control.config])}
    assert differ == {"run.tlt"}
    treatment = services.run_launch_control(user=alice, run=control)  # and back: a baseline's TLT treatment
    assert treatment.config["run"]["tlt"] is True and "TLT treatment" in treatment.name
    assert evidence.run_pair_get_for_user(user=alice, run_id=control.id)[:2] == (run, control)  # launched against
    assert evidence.run_pair_get_for_user(user=alice, run_id=treatment.id)[:2] == (treatment, control)


def test_a_viewer_sees_the_pair_but_cannot_launch_the_control(client, alice, team, run, bob):
    _baseline_of(run)
    with pytest.raises(PermissionDenied):
        services.run_launch_control(user=bob, run=run)
    client.force_login(bob)
    before = run.team.runs.count()
    assert client.post(reverse("run-ab-launch", args=[run.id])).status_code == 403
    _, token = api_token_create(user=bob, name="t")
    assert client.post(reverse("api-run-ab-launch", args=[run.id]), HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 403
    assert run.team.runs.count() == before
    page = client.get(reverse("run-pair", args=[run.id]))
    assert page.status_code == 200 and "id=\"ab-launch-button\"" not in client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert client.get(reverse("api-run-pair", args=[run.id]), HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200


def test_the_pair_figures_follow_from_the_measured_step_times(client, alice, run):
    base = _baseline_of(run)
    for step in range(1, 9):
        reward = 0.1 * step
        _record(run, step, **{"reward/mean": reward, "timing_s/step": 6.0, "timing_s/rollout": 4.0,
                              "idle/worker_s": 2.0, "idle/reclaimed_s": 1.5, "learner/grad_norm": 1.0,
                              "drafter/updates": 1.0})
        _record(base, step, **{"reward/mean": reward, "timing_s/step": 10.0, "timing_s/rollout": 8.0})
    s = evidence.ab_summary(tlt=run, base=base)
    assert s["steps_compared"] == 8
    assert s["e2e_speedup"] == pytest.approx(10 / 6)
    assert s["rollout_speedup"] == pytest.approx(2.0) and s["rollout_share"] == pytest.approx(0.8)
    assert s["amdahl_bound"] == pytest.approx(1 / (0.2 + 0.8 / 2))
    assert s["e2e_efficiency"] == pytest.approx((10 / 6) / (1 / 0.6))
    assert s["idle_worker_s"] == 16.0 and s["idle_reclaimed_s"] == 12.0
    assert s["tlt"]["wall_s"][-1] == 48.0 and s["baseline"]["wall_s"][-1] == 80.0
    assert s["reward_parity"]["verdict"] == "within noise" and s["reward_parity"]["p_value"] == 1.0
    client.force_login(alice)
    data = client.get(reverse("api-run-pair", args=[base.id])).json()  # from either side of the pair
    assert data["e2e_speedup"] == pytest.approx(10 / 6) and data["tlt"]["id"] == str(run.id)
    assert data["tlt"]["reward"][0] == pytest.approx(0.1) and data["reward_parity"]["within_noise"] is True


def test_the_run_list_shows_each_side_of_a_pair_its_tlt_speedup_and_a_lone_run_none(client, alice, team, run):
    lone = run_make(team, alice, name="lone")
    base = _baseline_of(run)
    for step in (1, 2, 3):
        _record(run, step, **{"timing_s/step": 5.0})
        _record(base, step, **{"timing_s/step": 8.0})
    _record(run, 4, **{"timing_s/step": 100.0})  # a step the baseline has not run yet: not compared
    client.force_login(alice)
    rows = {r["id"]: r for r in client.get(reverse("api-runs")).json()["runs"]}
    assert rows[str(run.id)]["tlt_speedup"] == pytest.approx(8 / 5) == rows[str(base.id)]["tlt_speedup"]
    assert rows[str(lone.id)]["tlt_speedup"] is None
    page = client.get(reverse("run-list")).content.decode()
    assert page.count(reverse("run-pair", args=[run.id])) == 1 and "1.60×" in page


def test_the_parity_test_rejects_a_consistent_gap_and_needs_enough_steps():
    same = evidence.reward_parity([0.5] * 8, [0.5] * 8)
    assert same["within_noise"] is True
    gap = evidence.reward_parity([0.6 + 0.01 * i for i in range(8)], [0.4 + 0.01 * i for i in range(8)])
    assert gap["verdict"] == "differs" and gap["p_value"] == pytest.approx(2 / 2 ** 8)
    noisy = evidence.reward_parity([0.5, 0.6, 0.4, 0.55, 0.45, 0.5, 0.52, 0.48], [0.52, 0.58, 0.42, 0.5, 0.5, 0.49, 0.5, 0.5])
    assert noisy["verdict"] == "within noise"
    few = evidence.reward_parity([0.9] * 5, [0.1] * 5)
    assert few["verdict"] == "too few steps" and few["within_noise"] is None
    long = evidence.reward_parity([0.6] * 30, [0.4] * 30)  # sampled sign patterns beyond 16 steps
    assert long["verdict"] == "differs"


def test_a_run_without_a_partner_has_no_pair(client, alice, run):
    client.force_login(alice)
    assert client.get(reverse("run-pair", args=[run.id])).status_code == 404
    assert client.get(reverse("api-run-pair", args=[run.id])).json()["error"] == "this run has no A/B partner yet"


# ---- alerts ----

def test_a_drafter_without_updates_while_the_policy_moves_raises_stale_once(settings, client, alice, run):
    settings.TLT_DRAFTER_STALE_STEPS = 3
    _record(run, 1, **{"learner/grad_norm": 0.5, "drafter/updates": 1.0, "drafter/loss": 0.3})
    for step in (2, 3):
        _record(run, step, **{"learner/grad_norm": 0.5, "drafter/updates": 0.0})
    assert not RunAlert.objects.filter(run=run).exists()  # step 1's update is still in the window
    for step in (4, 5):
        _record(run, step, **{"learner/grad_norm": 0.5, "drafter/updates": 0.0})
    alerts = list(RunAlert.objects.filter(run=run))
    assert [(a.kind, a.step) for a in alerts] == [("drafter_stale", 4)]
    client.force_login(alice)
    page = client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert 'id="alert-banner"' in page and "Drafter stale" in page
    listing = client.get(reverse("run-list")).content.decode()
    assert "alert-badge" in listing
    api = client.get(reverse("api-runs")).json()["runs"][0]
    assert api["alerts"] == 1
    assert client.get(reverse("api-run", args=[run.id])).json()["alert_list"][0]["kind"] == "drafter_stale"
    assert client.get(reverse("api-run-metrics", args=[run.id])).json()["alerts"][0]["step"] == 4  # the live banner


def test_a_baseline_or_a_policy_that_stands_still_raises_no_stale_alert(settings, alice, run):
    settings.TLT_DRAFTER_STALE_STEPS = 2
    base = _baseline_of(run)
    for step in range(1, 5):
        _record(base, step, **{"learner/grad_norm": 0.5})  # no drafter at all
        _record(run, step, **{"learner/grad_norm": 0.0})  # the policy did not move
    assert not RunAlert.objects.exists()


def test_a_greedy_mismatch_and_a_collapse_of_acceptance_raise_alerts(alice, run):
    for step, accept in enumerate([3.0, 3.2, 2.9, 3.1], start=1):
        _record(run, step, **{"spec/acceptance_length": accept, "audit/greedy_identical": 1.0})
    assert not RunAlert.objects.exists()
    _record(run, 5, **{"spec/acceptance_length": 1.2, "audit/greedy_identical": 0.5, "audit/greedy_prompts": 4.0})
    kinds = dict(RunAlert.objects.filter(run=run).values_list("kind", "step"))
    assert kinds == {"acceptance_collapse": 5, "greedy_mismatch": 5}
    assert "50% of 4 held-out prompts" in RunAlert.objects.get(kind="greedy_mismatch").message


def _alert(run, team, url):
    from tltweb.runs import health

    health.team_webhook_set(team=team, url=url)
    run.team.refresh_from_db()
    return health.alert_raise(run=run, kind="drafter_stale", step=3, message="stale")


def test_the_team_webhook_gets_the_alert_after_retrying_a_5xx(hook, team, run, monkeypatch):
    from workers import tasks

    monkeypatch.setattr(tasks.alert_webhook_post, "delay", lambda alert_id: None)
    hook.answers[:] = [503, 502]
    alert = _alert(run, team, hook.url("/hook"))
    assert alert.webhook_state == "pending"
    assert tasks.alert_webhook_post.apply(args=[alert.pk]).get() == "sent"  # eager: retries run at once
    alert.refresh_from_db()
    assert (alert.webhook_state, alert.webhook_attempts) == ("sent", 3)
    assert hook.bodies[-1]["alert"] == "drafter_stale" and hook.bodies[-1]["run"]["id"] == str(run.id)


def test_a_4xx_from_the_webhook_is_final_and_no_webhook_means_none_sent(hook, team, run, monkeypatch):
    from workers import tasks

    monkeypatch.setattr(tasks.alert_webhook_post, "delay", lambda alert_id: None)
    hook.answers[:] = [404]
    alert = _alert(run, team, hook.url("/gone"))
    assert tasks.alert_webhook_post.apply(args=[alert.pk]).get() == "failed"
    alert.refresh_from_db()
    assert alert.webhook_state == "failed" and alert.webhook_attempts == 1 and "404" in alert.webhook_error
    other = run_make(team, run.creator, name="no hook")
    team.alert_webhook_url = ""
    team.save()
    other.team.refresh_from_db()
    from tltweb.runs import health

    assert health.alert_raise(run=other, kind="drafter_stale", step=1, message="x").webhook_state == ""


def test_only_owners_set_the_webhook_and_it_must_be_http(client, team, bob):
    client.force_login(bob)
    member_add(team, bob, "editor")
    assert client.post(reverse("team-webhook", args=[team.pk]), {"alert_webhook_url": "https://x.example/h"}).status_code == 403
    member_add(team, bob, "owner")
    client.post(reverse("team-webhook", args=[team.pk]), {"alert_webhook_url": "file:///etc/passwd"})
    team.refresh_from_db()
    assert team.alert_webhook_url == ""
    client.post(reverse("team-webhook", args=[team.pk]), {"alert_webhook_url": "https://x.example/h"})
    team.refresh_from_db()
    assert team.alert_webhook_url == "https://x.example/h"


# ---- drafter registry ----

def _drafter_zip(weights: bytes, step: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("config.json", '{"num_hidden_layers": 1}')
        zf.writestr("model.safetensors", weights)
        zf.writestr("model_card.json", json.dumps({"format": "eagle", "target_model": "tiny", "rl_step": step,
                                                   "acceptance_length": 2.5,
                                                   "vllm_speculative_config": {"method": "eagle"}}))
    return buf.getvalue()


def test_checkpoints_of_an_unchanged_drafter_are_one_version_with_its_model_card(client, alice, team, run, charlie):
    for step, weights in ((1, b"w-one"), (2, b"w-one"), (3, b"w-two")):
        services.artifact_store(run=run, kind="drafter", step=step,
                                upload=SimpleUploadedFile("drafter.zip", _drafter_zip(weights, step)))
    versions = evidence.drafter_versions(run=run)
    assert [(v["version"], v["steps"]) for v in versions] == [(2, [3]), (1, [1, 2])]
    assert versions[1]["model_card"]["rl_step"] == 2  # the version's newest checkpoint's card
    client.force_login(alice)
    page = client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert page.count('data-kind="drafter-version"') == 2 and "vllm_speculative_config" in page
    latest = client.get(reverse("run-drafter-latest", args=[run.id]))
    assert zipfile.ZipFile(io.BytesIO(b"".join(latest.streaming_content))).read("model.safetensors") == b"w-two"
    api = client.get(reverse("api-run-drafters", args=[run.id])).json()
    assert [v["steps"] for v in api["versions"]] == [[3], [1, 2]] and api["versions"][0]["model_card"]["rl_step"] == 3
    assert client.get(api["latest_url"]).status_code == 200
    team_page = client.get(reverse("team-drafters", args=[team.pk])).content.decode()
    assert 'data-base-model="tiny"' in team_page
    groups = client.get(reverse("api-team-drafters", args=[team.pk])).json()["groups"]
    assert [g["base_model"] for g in groups] == ["tiny"] and len(groups[0]["versions"]) == 2
    client.force_login(charlie)
    assert client.get(reverse("team-drafters", args=[team.pk])).status_code == 404
    assert client.get(reverse("api-team-drafters", args=[team.pk])).status_code == 404


def test_a_file_the_run_already_holds_is_stored_once(run):
    from django.conf import settings

    data = _drafter_zip(b"same", 1)
    a = services.artifact_store(run=run, kind="drafter", step=1, upload=SimpleUploadedFile("d.zip", data))
    b = services.artifact_store(run=run, kind="drafter", step=2, upload=SimpleUploadedFile("d.zip", data))
    assert a.path == b.path and a.sha256 == b.sha256
    assert len(list((settings.TLT_ARTIFACT_DIR / str(run.team_id) / str(run.id)).glob("drafter-*"))) == 1
    c = services.artifact_store(run=run, kind="drafter", step=1, upload=SimpleUploadedFile("d.zip", _drafter_zip(b"new", 1)))
    assert (settings.TLT_ARTIFACT_DIR / b.path).is_file() and c.path != b.path  # still read by step 2's row


def test_the_ingest_endpoint_keeps_a_model_card_sent_as_meta(client, run, run_token):
    import hashlib

    body = b"not a zip"
    resp = client.post(reverse("ingest-artifacts", args=[run.id]), {
        "kind": "drafter", "step": "4", "size": str(len(body)), "sha256": hashlib.sha256(body).hexdigest(),
        "meta": json.dumps({"model_card": {"target_model": "hf:qwen", "rl_step": 4}}), "file": io.BytesIO(body)},
        HTTP_AUTHORIZATION=f"Bearer {run_token}")
    assert resp.status_code == 201, resp.content
    assert resp.json()["model_card"]["target_model"] == "hf:qwen"
    bad = client.post(reverse("ingest-artifacts", args=[run.id]), {
        "kind": "drafter", "step": "5", "size": str(len(body)), "sha256": hashlib.sha256(body).hexdigest(),
        "meta": "[1, 2]", "file": io.BytesIO(body)}, HTTP_AUTHORIZATION=f"Bearer {run_token}")
    assert bad.status_code == 400 and "meta" in bad.json()["errors"]


# ---- long tail ----

def test_the_prompts_that_run_longest_come_first(client, alice, run):
    for step in range(1, 4):
        series = {"rollout/prompt_lengths": [
            {"prompt": "aaa", "text": "short one", "lengths": [3, 4]},
            {"prompt": "bbb", "text": "runaway one", "lengths": [40 + step, 5]},
        ]}
        services.metrics_record(run=run, step=step, scalars={}, series=series)
    top = evidence.prompt_length_history(run=run)
    assert [p["prompt"] for p in top] == ["bbb", "aaa"]
    assert top[0]["longest_count"] == 3 and top[0]["max_length"] == [41, 42, 43]
    client.force_login(alice)
    assert "runaway one" in client.get(reverse("run-detail", args=[run.id])).content.decode()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/h", "http://localhost/h", "http://[::1]/h", "http://10.0.0.5/h",
                                 "http://169.254.169.254/latest/meta-data", "http://[::ffff:192.168.1.1]/h",
                                 "http://0.0.0.0/h"])
def test_a_webhook_into_the_servers_own_network_is_refused(client, team, alice, url):
    client.force_login(alice)  # the team's owner
    page = client.post(reverse("team-webhook", args=[team.pk]), {"alert_webhook_url": url}, follow=True)
    team.refresh_from_db()
    assert team.alert_webhook_url == ""
    assert "webhooks must be public addresses" in page.content.decode()


def test_delivery_checks_where_the_name_resolves_and_sends_nothing_inside(hook, team, run, settings, monkeypatch):
    import socket

    from tltweb.runs import health
    from workers import tasks

    monkeypatch.setattr(tasks.alert_webhook_post, "delay", lambda alert_id: None)
    alert = _alert(run, team, hook.url("/hook"))  # saved while private ones were allowed
    settings.TLT_WEBHOOK_ALLOW_PRIVATE = False
    assert tasks.alert_webhook_post.apply(args=[alert.pk]).get() == "failed"
    alert.refresh_from_db()
    assert "private or reserved address" in alert.webhook_error and hook.bodies == []

    # a public-looking name is judged by what it resolves to (no DNS here: the resolver answers for it)
    real = socket.getaddrinfo
    answers = {"hooks.example.com": "10.1.2.3", "public.example.com": "93.184.215.14"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], 0))] if host in answers else real(host, *a, **k))
    assert health.webhook_address_refusal("https://hooks.example.com/x", resolve=False) is None  # saving: no lookup
    assert "10.1.2.3" in health.webhook_address_refusal("https://hooks.example.com/x", resolve=True)
    assert health.webhook_address_refusal("https://public.example.com/x", resolve=True) is None
