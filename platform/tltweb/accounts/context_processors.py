"""What every page's header needs to know about the user: which links they may follow."""

from __future__ import annotations

from django.http import HttpRequest

from tltweb.accounts.selectors import team_list_for_user


def permissions(request: HttpRequest) -> dict[str, bool]:
    """`can_launch`: editor or owner somewhere (viewers get no Launch link that would 403)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"can_launch": False}
    return {"can_launch": bool(team_list_for_user(user=user, need="edit"))}
