"""Writes for teams, members and API tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
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


def team_member_add(*, team: Team, actor: User, username: str, role: str) -> Member:
    _require_owner(team, actor)
    if role not in Role.values:
        raise ValidationError({"role": f"choose one of {', '.join(Role.values)}"})
    user = User.objects.filter(username=username).first()
    if user is None:
        raise ValidationError({"username": f"no user named {username!r}"})
    member, _ = Member.objects.update_or_create(team=team, user=user, defaults={"role": role})
    return member


@transaction.atomic
def team_member_remove(*, team: Team, actor: User, user_id: int) -> None:
    _require_owner(team, actor)
    member = Member.objects.select_for_update().filter(team=team, user_id=user_id).first()
    if member is None:
        return
    if member.role == Role.OWNER and Member.objects.filter(team=team, role=Role.OWNER).count() == 1:
        raise ValidationError({"user": "a team keeps at least one owner"})
    member.delete()


def api_token_create(*, user: User, name: str) -> tuple[ApiToken, str]:
    """Returns the token row and the plaintext token (shown to the user once)."""
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(user=user, name=name or "token", prefix=plain[:12], token_hash=token_hash(plain))
    return token, plain


def api_token_revoke(*, user: User, token_id: int) -> None:
    ApiToken.objects.filter(user=user, pk=token_id, revoked_at__isnull=True).update(revoked_at=timezone.now())


def api_token_authenticate(*, plain: str) -> User | None:
    """The active user owning this token, or None. Marks the token used."""
    if not plain.startswith(TOKEN_PREFIX):
        return None
    for token in ApiToken.objects.select_related("user").filter(prefix=plain[:12], revoked_at__isnull=True):
        if token_matches(plain, token.token_hash) and token.user.is_active:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
            return token.user
    return None
