"""Reads for teams and members."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404

from tltweb.accounts.models import ApiToken, Member, Team


def team_list_for_user(*, user: User, need: str = "view") -> list[Team]:
    members = Member.objects.select_related("team").filter(user=user).order_by("team__name")
    return [m.team for m in members if m.allows(need)]


def member_list_for_user(*, user: User) -> QuerySet[Member]:
    """The user's memberships (team and role), by team name."""
    return Member.objects.select_related("team").filter(user=user).order_by("team__name")


def member_get(*, user: User, team_id: int) -> Member | None:
    if not user.is_authenticated or not 0 < team_id < 2**63:  # no such id (and SQLite cannot even look one up)
        return None
    return Member.objects.select_related("team").filter(user=user, team_id=team_id).first()


def team_get_for_user(*, user: User, team_id: int, need: str = "view") -> tuple[Team, Member]:
    """The team and the user's membership; 404 for outsiders, 403 when the role is too low."""
    member = member_get(user=user, team_id=team_id)
    if member is None:
        raise Http404("no such team")
    if not member.allows(need):
        raise PermissionDenied(f"needs {need} access")
    return member.team, member


def team_members(*, team: Team) -> QuerySet[Member]:
    return Member.objects.select_related("user").filter(team=team).order_by("user__username")


def api_token_list(*, user: User) -> QuerySet[ApiToken]:
    return ApiToken.objects.filter(user=user).order_by("-created_at")
