"""Teams, their members (with a role) and personal API tokens."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"  # sees runs, metrics, artifacts
    EDITOR = "editor", "Editor"  # also launches, cancels, clones, edits tags/notes
    OWNER = "owner", "Owner"  # also manages members


ROLE_RANK = {Role.VIEWER: 1, Role.EDITOR: 2, Role.OWNER: 3}
NEED_ROLE = {"view": Role.VIEWER, "edit": Role.EDITOR, "own": Role.OWNER}


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Drafter-health and audit alerts of the team's runs are POSTed here as JSON (optional; owners set it).
    alert_webhook_url = models.URLField(max_length=500, blank=True)

    def __str__(self) -> str:
        return self.name


class Member(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="members")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="member_unique_team_user")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"

    def allows(self, need: str) -> bool:
        return ROLE_RANK[Role(self.role)] >= ROLE_RANK[NEED_ROLE[need]]


class ApiToken(models.Model):
    """A personal token for the JSON API. Only a SHA-256 of it is stored; it is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, db_index=True)  # shown in lists, narrows the lookup
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
