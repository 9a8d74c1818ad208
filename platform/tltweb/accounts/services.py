"""Writes for teams, members and API tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from axes.handlers.proxy import AxesProxyHandler
from django.contrib.auth.models import User
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.http import HttpRequest
from django.utils import timezone

from tltweb.accounts.models import ApiToken, Member, Role, Team

TOKEN_PREFIX = "tlt_"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, stored_hash: str) -> bool:
    return hmac.compare_digest(token_hash(token), stored_hash)


def team_create(*, name: str, owner: User) -> Team:
    """A new team with `owner` as its first owner; ValidationError when the name is blank or taken."""
    name = name.strip()
    if not name:
        raise ValidationError({"name": "a team needs a name"})
    if len(name) > 100:
        raise ValidationError({"name": "at most 100 characters"})
    try:
        with transaction.atomic():
            if Team.objects.filter(name__iexact=name).exists():
                raise IntegrityError
            team = Team.objects.create(name=name)
            Member.objects.create(team=team, user=owner, role=Role.OWNER)
    except IntegrityError:
        raise ValidationError({"name": f"a team named {name!r} already exists"}) from None
    return team


def _require_owner(team: Team, user: User) -> None:
    if not Member.objects.filter(team=team, user=user, role=Role.OWNER).exists():
        raise PermissionDenied("only team owners manage members")


def _lock_team(team: Team) -> None:
    """Serialize membership changes of one team: the team's row lock is held until the transaction ends,
    so two owners demoting or removing each other at once cannot leave the team without one."""
    Team.objects.select_for_update().filter(pk=team.pk).first()


def _is_last_owner(team: Team, member: Member) -> bool:
    return member.role == Role.OWNER and Member.objects.filter(team=team, role=Role.OWNER).count() == 1


@transaction.atomic
def team_member_add(*, team: Team, actor: User, username: str, role: str) -> Member:
    """Add a member or change a member's role (owners only); the last owner cannot be demoted."""
    _lock_team(team)  # first: the actor's own role is read under the lock too
    _require_owner(team, actor)
    if role not in Role.values:
        raise ValidationError({"role": f"choose one of {', '.join(Role.values)}"})
    if "\x00" in username:
        raise ValidationError({"username": "must not contain NUL characters"})
    user = User.objects.filter(username=username).first()
    if user is None:
        raise ValidationError({"username": f"no user named {username!r}"})
    member = Member.objects.select_for_update().filter(team=team, user=user).first()
    if member is not None and role != Role.OWNER and _is_last_owner(team, member):
        raise ValidationError({"role": "a team keeps at least one owner: make someone else owner first"})
    member, _ = Member.objects.update_or_create(team=team, user=user, defaults={"role": role})
    return member


@transaction.atomic
def team_member_remove(*, team: Team, actor: User, user_id: int) -> None:
    """Remove a member (owners only); the last owner cannot be removed."""
    _lock_team(team)
    _require_owner(team, actor)
    member = Member.objects.select_for_update().filter(team=team, user_id=user_id).first()
    if member is None:
        return
    if _is_last_owner(team, member):
        raise ValidationError({"user": "a team keeps at least one owner"})
    member.delete()


def api_token_create(*, user: User, name: str) -> tuple[ApiToken, str]:
    """Returns the token row and the plaintext token (shown to the user once)."""
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(user=user, name=name or "token", prefix=plain[:12], token_hash=token_hash(plain))
    return token, plain


def api_token_revoke(*, user: User, token_id: int) -> None:
    ApiToken.objects.filter(user=user, pk=token_id, revoked_at__isnull=True).update(revoked_at=timezone.now())


class LoginLockedOut(PermissionDenied):
    """Too many failed logins (or invalid API tokens) from this address: django-axes' lockout."""


API_TOKEN_CREDENTIALS = {"username": "(api token)"}  # what axes counts invalid personal tokens under


def api_token_authenticate(*, plain: str, request: HttpRequest | None = None) -> User | None:
    """The active user owning this token, or None. Marks the token used.

    With the request, invalid tokens count as failed logins of one pseudo-user per address
    (django-axes): after TLT_LOGIN_FAILURE_LIMIT of them LoginLockedOut is raised, valid tokens too,
    until the cool-off ends.
    """
    if request is not None and not AxesProxyHandler.is_allowed(request, API_TOKEN_CREDENTIALS):
        raise LoginLockedOut("too many invalid API tokens from this address")
    if plain.startswith(TOKEN_PREFIX) and "\x00" not in plain:
        for token in ApiToken.objects.select_related("user").filter(prefix=plain[:12], revoked_at__isnull=True):
            if token_matches(plain, token.token_hash) and token.user.is_active:
                ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
                return token.user
    if request is not None:
        user_login_failed.send(sender=__name__, credentials=API_TOKEN_CREDENTIALS, request=request)
    return None
