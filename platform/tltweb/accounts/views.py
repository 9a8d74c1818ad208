"""Team management (owners) and personal API tokens."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tltweb.accounts import selectors, services
from tltweb.accounts.models import Role


def _errors(exc: ValidationError) -> str:
    if hasattr(exc, "error_dict"):
        return "; ".join(f"{k}: {', '.join(v)}" for k, v in exc.message_dict.items())
    return "; ".join(exc.messages)


@login_required
def team_list(request: HttpRequest) -> HttpResponse:
    members = selectors.member_list_for_user(user=request.user)
    return render(request, "accounts/teams.html", {"members": members})


@login_required
@require_POST
def team_create(request: HttpRequest) -> HttpResponse:
    """Any signed-in user may start a team; they become its owner and invite the others."""
    try:
        team = services.team_create(name=request.POST.get("name", ""), owner=request.user)
    except ValidationError as exc:
        messages.error(request, "Team not created: " + _errors(exc))
        return redirect("team-list")
    messages.success(request, f"Created {team.name}. Invite members by username below.")
    return redirect("team-detail", team_id=team.pk)


@login_required
def team_detail(request: HttpRequest, team_id: int) -> HttpResponse:
    team, member = selectors.team_get_for_user(user=request.user, team_id=team_id, need="view")
    ctx = {"team": team, "me": member, "is_owner": member.allows("own"), "members": selectors.team_members(team=team), "roles": Role.choices}
    return render(request, "accounts/team.html", ctx)


@login_required
@require_POST
def team_member_save(request: HttpRequest, team_id: int) -> HttpResponse:
    team, _ = selectors.team_get_for_user(user=request.user, team_id=team_id, need="own")
    try:
        services.team_member_add(
            team=team, actor=request.user, username=request.POST.get("username", "").strip(), role=request.POST.get("role", "")
        )
        messages.success(request, "Member saved.")
    except ValidationError as exc:
        messages.error(request, _errors(exc))
    return redirect("team-detail", team_id=team.pk)


@login_required
@require_POST
def team_member_remove(request: HttpRequest, team_id: int) -> HttpResponse:
    team, _ = selectors.team_get_for_user(user=request.user, team_id=team_id, need="own")
    try:
        services.team_member_remove(team=team, actor=request.user, user_id=int(request.POST.get("user", 0)))
        messages.success(request, "Member removed.")
    except (ValidationError, ValueError) as exc:
        messages.error(request, _errors(exc) if isinstance(exc, ValidationError) else "bad user id")
    return redirect("team-detail", team_id=team.pk)


@login_required
def tokens(request: HttpRequest) -> HttpResponse:
    new_token = None
    if request.method == "POST":
        if "revoke" in request.POST:
            try:
                services.api_token_revoke(user=request.user, token_id=int(request.POST["revoke"]))
            except ValueError:
                pass
            messages.info(request, "Token revoked.")
            return redirect("tokens")
        _, new_token = services.api_token_create(user=request.user, name=request.POST.get("name", "").strip()[:100])
    return render(request, "accounts/tokens.html", {"tokens": selectors.api_token_list(user=request.user), "new_token": new_token})
