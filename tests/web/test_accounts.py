"""Nobody in by guessing, and no team without an owner: login throttling (django-axes) on the browser,
admin and API paths; the last owner can be neither removed nor demoted, under the team's row lock."""

from __future__ import annotations

import threading

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse

from tests.conftest import PASSWORD, member_add
from tltweb.accounts.models import Member, Team
from tltweb.accounts.services import api_token_create, team_member_add, team_member_remove


def _login(client, username, password, path=None):
    return client.post(path or reverse("login"), {"username": username, "password": password})


def test_fifteen_wrong_passwords_then_the_right_one_does_not_log_in(client, alice, settings):
    for _ in range(15):
        resp = _login(client, "alice", "wrong")
    assert resp.status_code == 429 and "Too many failed logins" in resp.content.decode()
    resp = _login(client, "alice", PASSWORD)
    assert resp.status_code == 429 and "_auth_user_id" not in client.session


def test_a_few_wrong_passwords_are_forgiven_by_the_right_one(client, alice, settings):
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert _login(client, "alice", "wrong").status_code == 200  # the form again, with its error
    resp = _login(client, "alice", PASSWORD)
    assert resp.status_code == 302 and client.session["_auth_user_id"] == str(alice.pk)


def test_the_lockout_is_per_user_and_address_and_ends_with_a_reset(client, alice, bob, settings):
    from axes.utils import reset

    for _ in range(settings.AXES_FAILURE_LIMIT):
        _login(client, "alice", "wrong")
    assert _login(Client(), "bob", PASSWORD).status_code == 302  # bob, same address: not locked
    assert _login(client, "alice", PASSWORD).status_code == 429
    reset(username="alice")  # what `manage.py axes_reset_username alice` does
    assert _login(client, "alice", PASSWORD).status_code == 302


def test_the_admin_login_is_throttled_too(client, alice, settings):
    alice.is_staff = True
    alice.save()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        _login(client, "alice", "wrong", path="/admin/login/")
    assert _login(client, "alice", PASSWORD, path="/admin/login/").status_code == 429


def test_invalid_api_tokens_lock_the_address_out_of_the_api_with_a_json_error(client, alice, run, settings):
    _, token = api_token_create(user=alice, name="laptop")
    url = reverse("api-run", args=[run.id])
    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 200
    for i in range(settings.AXES_FAILURE_LIMIT - 1):
        assert client.get(url, HTTP_AUTHORIZATION=f"Bearer tlt_guess{i}").status_code == 401
    resp = client.get(url, HTTP_AUTHORIZATION="Bearer tlt_last-guess")
    assert resp.status_code == 429 and "locked out" in resp.json()["error"]
    resp = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")  # during the cool-off, valid tokens too
    assert resp.status_code == 429 and resp["Content-Type"] == "application/json"


# ---- the last owner ----

def test_the_last_owner_cannot_be_demoted(alice, team):
    with pytest.raises(ValidationError) as err:
        team_member_add(team=team, actor=alice, username="alice", role="editor")
    assert "at least one owner" in str(err.value)
    assert Member.objects.get(team=team, user=alice).role == "owner"


def test_an_owner_can_be_demoted_while_another_remains(alice, bob, team):
    member_add(team, bob, "owner")
    team_member_add(team=team, actor=bob, username="alice", role="viewer")
    assert Member.objects.get(team=team, user=alice).role == "viewer"
    with pytest.raises(ValidationError):
        team_member_add(team=team, actor=bob, username="bob", role="editor")


def test_the_team_page_refuses_to_demote_the_last_owner(client, alice, team):
    client.force_login(alice)
    resp = client.post(reverse("team-member-save", args=[team.pk]), {"username": "alice", "role": "viewer"}, follow=True)
    assert "at least one owner" in resp.content.decode()
    assert Member.objects.get(team=team, user=alice).role == "owner"


def test_the_last_owner_cannot_be_removed_by_the_service(alice, team):
    with pytest.raises(ValidationError):
        team_member_remove(team=team, actor=alice, user_id=alice.pk)


@pytest.mark.django_db(transaction=True)
def test_two_owners_demoting_each_other_at_once_leave_one_owner():
    """Two owners, each demoting the other in their own transaction at the same moment: the team's
    row lock makes the second wait and then see that it would remove the last owner."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serializes every write transaction; the row lock matters on PostgreSQL (CI)")
    from django.contrib.auth.models import User
    from tltweb.accounts.services import team_create

    alice = User.objects.create_user("alice", password=PASSWORD)
    bob = User.objects.create_user("bob", password=PASSWORD)
    team = team_create(name="lab", owner=alice)
    member_add(team, bob, "owner")
    holding, release = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def alice_demotes_bob():
        try:
            with transaction.atomic():
                Team.objects.select_for_update().get(pk=team.pk)  # alice's change is under way...
                holding.set()
                release.wait(10)
                team_member_add(team=team, actor=alice, username="bob", role="editor")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()  # this thread's own connection

    def bob_demotes_alice():
        try:
            holding.wait(10)
            team_member_add(team=team, actor=bob, username="alice", role="editor")
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()  # this thread's own connection

    threads = [threading.Thread(target=alice_demotes_bob), threading.Thread(target=bob_demotes_alice)]
    for t in threads:
        t.start()
    holding.wait(10)
    threading.Timer(1.0, release.set).start()  # bob's demotion is blocked on the lock meanwhile
    for t in threads:
        t.join(30)
    assert Member.objects.filter(team=team, role="owner").count() == 1
    # bob's change ran after alice's: he is no longer an owner (or would remove the last one)
    assert len(errors) == 1 and isinstance(errors[0], (PermissionDenied, ValidationError)), errors
