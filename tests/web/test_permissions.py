"""Every page, API endpoint and download checks the team role: outsiders get 404, too-low roles 403."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from tests.conftest import member_add
from tltweb.accounts.services import api_token_create
from tltweb.runs.services import artifact_store


@pytest.fixture
def artifact(run):
    from tltweb.runs.services import metrics_record

    metrics_record(run=run, step=0, scalars={"reward/mean": 0.5}, series={})
    run.log_tail = "step 0: reward=0.5\n"  # the log downloads have something to send
    run.save(update_fields=["log_tail"])
    return artifact_store(run=run, kind="drafter", step=2, upload=SimpleUploadedFile("drafter.zip", b"PK-zip-bytes"))


# (name, method, needs) -- needs: the lowest role that may use it. Every run page and every user API
# endpoint is here; test_every_url_is_in_the_matrix fails when one is added without its row.
PAGES = [
    ("run-detail", "get", "viewer"),
    ("artifact-download", "get", "viewer"),
    ("run-cancel", "post", "editor"),
    ("run-clone", "post", "editor"),
    ("run-edit", "post", "editor"),
    ("run-resume", "post", "editor"),
    ("run-log", "get", "viewer"),
    ("run-samples", "get", "viewer"),
    ("run-ab-launch", "post", "editor"),
    ("run-pair", "get", "viewer"),
    ("run-drafter-latest", "get", "viewer"),
]
API = [
    ("api-run", "get", "viewer"),
    ("api-run-patch", "patch", "editor"),
    ("api-run-metrics", "get", "viewer"),
    ("api-run-metrics-step", "get", "viewer"),
    ("api-run-artifacts", "get", "viewer"),
    ("api-artifact-download", "get", "viewer"),
    ("api-run-cancel", "post", "editor"),
    ("api-run-clone", "post", "editor"),
    ("api-run-resume", "post", "editor"),
    ("api-run-log", "get", "viewer"),
    ("api-run-samples", "get", "viewer"),
    ("api-run-ab-launch", "post", "editor"),
    ("api-run-pair", "get", "viewer"),
    ("api-run-drafters", "get", "viewer"),
    ("api-run-drafter-latest", "get", "viewer"),
]
RANK = {"viewer": 1, "editor": 2, "owner": 3}


def _url(name, run, artifact):
    if "artifact-download" in name:
        return reverse(name, args=[run.id, artifact.pk])
    if name == "api-run-metrics-step":
        return reverse(name, args=[run.id, 0])
    return reverse(name, args=[run.id])


def _prepare(name, run) -> None:
    """Resume needs a run that ended, the pair page a partner; everything else works on the queued run."""
    from tltweb.runs.models import Run

    if name.endswith("run-resume"):
        Run.objects.filter(pk=run.pk).update(state="failed", failure="infra")
    if name.endswith("run-pair"):  # a pair to look at: the run's baseline control
        from tests.conftest import run_make

        cfg = dict(run.config, run={**run.config["run"], "tlt": False})
        run_make(run.team, run.creator, name="control", config=cfg, ab_partner=run)


def _call(client, method, url, **headers):
    if method == "patch":
        return client.patch(url, data=json.dumps({"notes": "changed"}), content_type="application/json", **headers)
    return getattr(client, method)(url, **headers)


def _expected(role: str | None, needs: str) -> int:
    if role is None:
        return 404
    return 403 if RANK[role] < RANK[needs] else None  # None: allowed (200 or a redirect)


@pytest.mark.parametrize("name,method,needs", PAGES)
@pytest.mark.parametrize("who,role", [("alice", "owner"), ("bob", "viewer"), ("bob", "editor"), ("charlie", None)])
def test_pages_check_the_team_role(client, request, run, artifact, bob, charlie, team, name, method, needs, who, role):
    user = request.getfixturevalue(who)
    if who == "bob":
        member_add(team, bob, role)
    client.force_login(user)
    _prepare(name, run)
    data = {"name": "renamed", "tags": "a", "notes": ""} if name == "run-edit" else {}
    resp = getattr(client, method)(_url(name, run, artifact), data)
    expected = _expected(role, needs)
    if expected is None:
        assert resp.status_code in (200, 302), resp.status_code
    else:
        assert resp.status_code == expected


@pytest.mark.parametrize("name,method,needs", API)
@pytest.mark.parametrize("who,role", [("alice", "owner"), ("bob", "viewer"), ("bob", "editor"), ("charlie", None)])
def test_api_checks_the_team_role_with_a_personal_token(client, request, run, artifact, bob, charlie, team, name, method, needs, who, role):
    user = request.getfixturevalue(who)
    if who == "bob":
        member_add(team, bob, role)
    _, token = api_token_create(user=user, name="t")
    _prepare(name, run)
    before = _snapshot(run)
    resp = _call(client, method, _url(name, run, artifact), HTTP_AUTHORIZATION=f"Bearer {token}")
    expected = _expected(role, needs)
    if expected is None:
        assert resp.status_code in (200, 201), resp.content
    else:
        assert resp.status_code == expected
        assert "error" in resp.json()
        assert _snapshot(run) == before  # a refused request changed nothing


def _snapshot(run):
    from tltweb.runs.models import Run

    r = Run.objects.get(pk=run.pk)
    return (r.state, r.notes, r.name, r.attempt, Run.objects.count())


@pytest.mark.parametrize("name,method,needs", API)
@pytest.mark.parametrize("who,role", [("alice", "owner"), ("bob", "viewer"), ("bob", "editor"), ("charlie", None)])
def test_api_checks_the_team_role_with_a_session(client, request, run, artifact, bob, charlie, team, name, method, needs, who, role):
    user = request.getfixturevalue(who)
    if who == "bob":
        member_add(team, bob, role)
    client.force_login(user)
    _prepare(name, run)
    resp = _call(client, method, _url(name, run, artifact))
    expected = _expected(role, needs)
    if expected is None:
        assert resp.status_code in (200, 201), resp.content
    else:
        assert resp.status_code == expected and "error" in resp.json()


@pytest.mark.parametrize("name", ["run-list", "run-launch", "run-compare", "team-list", "tokens"])
def test_pages_redirect_anonymous_users_to_login(client, name):
    resp = client.get(reverse(name))
    assert resp.status_code == 302 and resp.url.startswith(reverse("login"))


def test_run_pages_redirect_anonymous_users_to_login(client, run, artifact):
    for name, _, _ in PAGES[:2]:
        resp = client.get(_url(name, run, artifact))
        assert resp.status_code == 302


@pytest.mark.parametrize("name,method", [("api-runs", "get"), ("api-runs-launch", "post")] + [(n, m) for n, m, _ in API])
def test_api_rejects_anonymous_and_wrong_tokens_with_401(client, run, artifact, name, method):
    url = reverse(name) if name in ("api-runs", "api-runs-launch") else _url(name, run, artifact)
    before = _snapshot(run)
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer tlt_not-a-token"}, {"HTTP_AUTHORIZATION": "Basic YWxpY2U6eA=="}):
        resp = _call(client, method, url, **headers)
        assert resp.status_code == 401 and "error" in resp.json(), (headers, resp.content)
    assert _snapshot(run) == before


@pytest.mark.parametrize("name,method,_needs", PAGES)
def test_every_run_page_sends_anonymous_users_to_login(client, run, artifact, name, method, _needs):
    _prepare(name, run)
    before = _snapshot(run)
    resp = getattr(client, method)(_url(name, run, artifact))
    assert resp.status_code == 302 and resp.url.startswith(reverse("login"))
    assert _snapshot(run) == before


def test_every_url_is_in_the_matrix():
    """A new run page or API endpoint must get a row in PAGES/API (so its role check is tested)."""
    from django.urls import get_resolver

    names = {name for name in get_resolver().reverse_dict if isinstance(name, str)}
    run_scoped = {n for n in names if n.startswith(("run-", "api-run", "artifact-", "api-artifact"))}
    unscoped = {"run-list", "run-launch", "run-compare", "api-runs", "api-runs-launch"}
    assert run_scoped - unscoped == {n for n, _, _ in PAGES} | {n for n, _, _ in API}


# ---- ingestion: only the run's own token, and only while the run is active ----

def _ingest(client, name, run, **headers):
    import hashlib
    import io

    url = reverse(name, args=[run.id])
    if name == "ingest-metrics":
        return client.post(url, data=json.dumps({"step": 9, "scalars": {"reward/mean": 99.0}}),
                           content_type="application/json", **headers)
    body = b"forged"
    return client.post(url, {"kind": "drafter", "step": "9", "size": str(len(body)),
                             "sha256": hashlib.sha256(body).hexdigest(), "file": io.BytesIO(body)}, **headers)


@pytest.mark.parametrize("name", ["ingest-metrics", "ingest-artifacts"])
@pytest.mark.parametrize("who", ["anonymous", "alice-session", "alice-api-token", "charlie-api-token", "other-run-token"])
def test_ingestion_takes_only_the_runs_own_token(client, run, artifact, alice, charlie, team, name, who):
    from tests.conftest import run_make
    from tltweb.runs.services import run_token_rotate

    run_token_rotate(run=run)
    headers = {}
    if who == "alice-session":
        client.force_login(alice)
    elif who.endswith("api-token"):
        _, token = api_token_create(user=alice if who.startswith("alice") else charlie, name="t")
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    elif who == "other-run-token":
        headers["HTTP_AUTHORIZATION"] = f"Bearer {run_token_rotate(run=run_make(team, alice, name='other'))}"
    resp = _ingest(client, name, run, **headers)
    assert resp.status_code in (401, 403) and "error" in resp.json()
    assert not run.metric_steps.filter(step=9).exists() and not run.artifacts.filter(step=9).exists()


@pytest.mark.parametrize("name", ["ingest-metrics", "ingest-artifacts"])
@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_ingestion_after_a_run_ends_is_refused_even_with_its_token(client, run, artifact, name, state):
    from django.db import transaction

    from tltweb.runs import services
    from tltweb.runs.models import Run

    token = services.run_token_rotate(run=run)
    assert _ingest(client, "ingest-metrics", run, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200  # while active
    with transaction.atomic():
        services._finish(Run.objects.select_for_update().get(pk=run.pk), state)
    before = (list(run.metric_steps.values_list("step", "scalars")), list(run.artifacts.values_list("sha256", flat=True)))
    resp = _ingest(client, name, run, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 403 and "immutable" in resp.json()["error"]
    after = (list(run.metric_steps.values_list("step", "scalars")), list(run.artifacts.values_list("sha256", flat=True)))
    assert after == before


def test_an_artifact_of_another_run_is_not_found_through_this_runs_url(client, alice, team, run, artifact):
    from tests.conftest import run_make

    other = run_make(team, alice, name="other")
    client.force_login(alice)
    assert client.get(reverse("artifact-download", args=[other.id, artifact.pk])).status_code == 404
    _, token = api_token_create(user=alice, name="t")
    resp = client.get(reverse("api-artifact-download", args=[other.id, artifact.pk]), HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 404


def test_a_revoked_token_stops_working(client, alice, run):
    from tltweb.accounts.services import api_token_revoke

    row, token = api_token_create(user=alice, name="laptop")
    url = reverse("api-run", args=[run.id])
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    api_token_revoke(user=alice, token_id=row.pk)
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 401


def test_tokens_are_stored_hashed(alice):
    """The row holds the token's SHA-256 and nothing from which the token could be read back."""
    import hashlib

    from tltweb.accounts.models import ApiToken
    from tltweb.accounts.services import token_matches

    row, token = api_token_create(user=alice, name="laptop")
    stored = ApiToken.objects.get(pk=row.pk)
    assert stored.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token_matches(token, stored.token_hash) and not token_matches(token + "x", stored.token_hash)
    secret = token[len(stored.prefix):]
    columns = [str(v) for v in ApiToken.objects.filter(pk=row.pk).values().first().values()]
    assert secret and not any(secret in value for value in columns)


def test_run_list_shows_only_the_users_teams(client, run, charlie):
    client.force_login(charlie)
    assert run.name not in client.get(reverse("run-list")).content.decode()
    client.force_login(run.creator)
    assert run.name in client.get(reverse("run-list")).content.decode()


def test_api_run_list_shows_only_the_users_teams(client, run, bob, charlie):
    for user, count in ((bob, 1), (charlie, 0)):
        _, token = api_token_create(user=user, name="t")
        resp = client.get(reverse("api-runs"), HTTP_AUTHORIZATION=f"Bearer {token}")
        assert len(resp.json()["runs"]) == count


def test_compare_leaves_out_runs_of_other_teams(client, run, charlie):
    client.force_login(charlie)
    resp = client.get(reverse("run-compare"), {"run": [str(run.id)]})
    assert resp.status_code == 200 and run.name not in resp.content.decode()


def test_viewers_cannot_open_the_launch_form(client, bob):
    client.force_login(bob)
    assert client.get(reverse("run-launch")).status_code == 403


@pytest.mark.parametrize("who,status", [("alice", 200), ("bob", 200), ("charlie", 404)])
def test_team_page_is_for_members_only(client, request, team, bob, charlie, who, status):
    client.force_login(request.getfixturevalue(who))
    assert client.get(reverse("team-detail", args=[team.pk])).status_code == status


@pytest.mark.parametrize("role", ["viewer", "editor"])
def test_only_owners_manage_members(client, team, bob, charlie, role):
    member_add(team, bob, role)
    client.force_login(bob)
    resp = client.post(reverse("team-member-save", args=[team.pk]), {"username": "charlie", "role": "owner"})
    assert resp.status_code == 403
    assert not team.members.filter(user=charlie).exists()


def test_owners_add_change_and_remove_members(client, alice, team, bob, charlie):
    client.force_login(alice)
    client.post(reverse("team-member-save", args=[team.pk]), {"username": "charlie", "role": "editor"})
    assert team.members.get(user=charlie).role == "editor"
    client.post(reverse("team-member-remove", args=[team.pk]), {"user": charlie.pk})
    assert not team.members.filter(user=charlie).exists()


def test_the_last_owner_cannot_be_removed(client, alice, team):
    client.force_login(alice)
    client.post(reverse("team-member-remove", args=[team.pk]), {"user": alice.pk})
    assert team.members.filter(user=alice, role="owner").exists()


def test_an_outsider_cannot_download_by_guessing_ids(client, alice, team, run, artifact, charlie):
    """Charlie walks the artifact ids around a real one, through his own run's URL and through
    alice's: every guess is a 404 that reads the same as a made-up id, so nothing leaks."""
    from tests.conftest import run_make
    from tltweb.accounts.models import Team

    own = run_make(Team.objects.get(name="Charlie's lab"), charlie, name="charlie's")
    client.force_login(charlie)
    _, token = api_token_create(user=charlie, name="t")
    guesses = range(max(1, artifact.pk - 3), artifact.pk + 4)
    assert artifact.pk in guesses
    bodies = set()
    for run_id in (run.id, own.id):
        for guess in guesses:
            page = client.get(reverse("artifact-download", args=[run_id, guess]))
            api = client.get(reverse("api-artifact-download", args=[run_id, guess]), HTTP_AUTHORIZATION=f"Bearer {token}")
            assert page.status_code == 404 and api.status_code == 404, (run_id, guess)
            assert not getattr(page, "streaming", False) and b"PK-zip-bytes" not in page.content + api.content
            bodies.add(api.content.replace(str(guess).encode(), b"<id>"))
    assert len({b for b in bodies if b"no such run" in b}) == 1  # alice's run: one answer for every id
    client.force_login(alice)  # the same ids are real for alice: the test guessed the right one
    assert client.get(reverse("artifact-download", args=[run.id, artifact.pk])).status_code == 200


def test_the_metrics_step_endpoint_answers_only_members(client, alice, team, run, artifact, bob, charlie):
    """One step's record (its series) for members, a 404 that says nothing for outsiders, and never
    another run's step through this run's URL."""
    from tests.conftest import run_make
    from tltweb.runs.services import metrics_record

    metrics_record(run=run, step=1, scalars={"reward/mean": 0.7}, series={"rollout/lengths": [3, 5, 8]})
    other = run_make(team, alice, name="other")
    metrics_record(run=other, step=7, scalars={"reward/mean": 0.1}, series={"rollout/lengths": [99]})
    url = reverse("api-run-metrics-step", args=[run.id, 1])
    for user, status in ((alice, 200), (bob, 200), (charlie, 404)):
        _, token = api_token_create(user=user, name="t")
        resp = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")
        assert resp.status_code == status, user
        if status == 200:
            assert resp.json()["series"]["rollout/lengths"] == [3, 5, 8]
        else:
            assert "rollout/lengths" not in resp.content.decode() and resp.json()["error"] == "no such run"
        client.force_login(user)
        assert client.get(url).status_code == status
        client.logout()
    _, token = api_token_create(user=alice, name="t2")
    resp = client.get(reverse("api-run-metrics-step", args=[run.id, 7]), HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 404  # step 7 is the other run's


def test_the_admin_lists_teams_runs_and_tokens_for_staff(client, run, alice):
    alice.is_staff = alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    for model in ("accounts/team", "accounts/apitoken", "runs/run", "runs/metricstep", "runs/artifact"):
        assert client.get(f"/admin/{model}/").status_code == 200, model
    assert client.get(f"/admin/runs/run/{run.pk}/change/").status_code == 200


def test_the_admin_is_closed_to_non_staff(client, alice):
    client.force_login(alice)
    assert client.get("/admin/runs/run/").status_code == 302


def test_garbage_run_ids_and_nul_filters_are_answered_not_crashed(client, alice, run):
    client.force_login(alice)
    assert client.get(reverse("run-compare"), {"run": ["not-a-uuid", str(run.id)]}).status_code == 200
    assert client.get(reverse("run-list"), {"q": "a\x00b"}).status_code == 200
    _, token = api_token_create(user=alice, name="t")
    resp = client.get(reverse("api-runs"), {"q": "\x00", "tag": "\x00"}, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 200 and resp.json()["runs"] == []
    resp = client.get("/api/runs/not-a-uuid/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 404 and "error" in resp.json()
