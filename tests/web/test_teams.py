"""Teams from the UI and the API: anyone signed in creates one (and owns it), owners invite by
username with a role; names are unique; everything else stays with the team's own members."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from tltweb.accounts.models import Member, Team
from tltweb.accounts.services import api_token_create


def test_a_user_creates_a_team_and_becomes_its_owner(client, charlie):
    client.force_login(charlie)
    resp = client.post(reverse("team-create"), {"name": "  Charlie's second lab "})
    team = Team.objects.get(name="Charlie's second lab")
    assert resp.status_code == 302 and resp.url == reverse("team-detail", args=[team.pk])
    assert Member.objects.get(team=team, user=charlie).role == "owner"


@pytest.mark.parametrize("name", ["", "   ", "alice's LAB"])
def test_a_blank_or_taken_team_name_is_refused(client, alice, team, name):
    client.force_login(alice)
    before = Team.objects.count()
    resp = client.post(reverse("team-create"), {"name": name}, follow=True)
    assert Team.objects.count() == before and "Team not created" in resp.content.decode()


def test_the_teams_page_lists_each_team_with_the_users_role_and_a_create_form(client, bob, team):
    client.force_login(bob)
    html = client.get(reverse("team-list")).content.decode()
    assert "Alice&#x27;s lab" in html and "Viewer" in html and 'id="team-create-form"' in html


def test_team_creation_needs_a_login_and_a_post(client, alice):
    assert client.post(reverse("team-create"), {"name": "x"}).status_code == 302
    assert not Team.objects.filter(name="x").exists()
    client.force_login(alice)
    assert client.get(reverse("team-create")).status_code == 405


def test_an_owner_invites_by_username_and_the_invited_user_sees_the_teams_runs(client, alice, team, run, charlie):
    client.force_login(alice)
    client.post(reverse("team-member-save", args=[team.pk]), {"username": "charlie", "role": "viewer"})
    client.force_login(charlie)
    assert run.name in client.get(reverse("run-list")).content.decode()
    assert client.get(reverse("run-detail", args=[run.id])).status_code == 200


def test_inviting_an_unknown_username_says_so(client, alice, team):
    client.force_login(alice)
    resp = client.post(reverse("team-member-save", args=[team.pk]), {"username": "nobody", "role": "viewer"}, follow=True)
    assert "no user named" in resp.content.decode()


def test_only_owners_see_the_invite_form(client, alice, bob, team):
    client.force_login(bob)
    assert 'id="invite-form"' not in client.get(reverse("team-detail", args=[team.pk])).content.decode()
    client.force_login(alice)
    assert 'id="invite-form"' in client.get(reverse("team-detail", args=[team.pk])).content.decode()


def _api(client, user, method, url, body=None):
    kwargs = {"HTTP_AUTHORIZATION": f"Bearer {api_token_create(user=user, name='t')[1]}"}
    if body is not None:
        kwargs.update(data=json.dumps(body), content_type="application/json")
    return getattr(client, method)(url, **kwargs)


def test_the_api_lists_creates_and_invites(client, alice, team, charlie):
    assert _api(client, alice, "get", reverse("api-teams")).json()["teams"] == [
        {"id": team.pk, "name": "Alice's lab", "role": "owner"}
    ]
    created = _api(client, charlie, "post", reverse("api-teams"), {"name": "New lab"})
    assert created.status_code == 201 and created.json()["role"] == "owner"
    assert _api(client, charlie, "post", reverse("api-teams"), {"name": "new LAB"}).json()["errors"]["name"]
    resp = _api(client, alice, "put", reverse("api-team-members", args=[team.pk]), {"username": "charlie", "role": "editor"})
    assert resp.json() == {"username": "charlie", "role": "editor"}
    assert Member.objects.get(team=team, user=charlie).role == "editor"


def test_the_api_refuses_invites_from_non_owners_and_outsiders(client, bob, team, charlie):
    body = {"username": "charlie", "role": "owner"}
    assert _api(client, bob, "put", reverse("api-team-members", args=[team.pk]), body).status_code == 403
    assert _api(client, charlie, "put", reverse("api-team-members", args=[team.pk]), body).status_code == 404
    assert not Member.objects.filter(team=team, user=charlie).exists()


def test_the_api_cannot_demote_the_last_owner(client, alice, team, charlie):
    """PUT .../members goes through team_member_add, so the locked last-owner rule of the pages holds."""
    resp = _api(client, alice, "put", reverse("api-team-members", args=[team.pk]), {"username": "alice", "role": "editor"})
    assert resp.status_code == 400 and "owner" in resp.json()["errors"]["role"]
    assert Member.objects.get(team=team, user=alice).role == "owner"
    _api(client, alice, "put", reverse("api-team-members", args=[team.pk]), {"username": "charlie", "role": "owner"})
    resp = _api(client, alice, "put", reverse("api-team-members", args=[team.pk]), {"username": "alice", "role": "editor"})
    assert resp.status_code == 200 and resp.json() == {"username": "alice", "role": "editor"}
