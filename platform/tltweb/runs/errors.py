"""Errors of the runs services and selectors, mapped to HTTP by the views and the API."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied, ValidationError


class RunFinished(PermissionDenied):
    """Ingestion for a run that has reached a final state: its metrics and artifacts are immutable (403)."""


class RunStateError(ValidationError):
    """An action the run's state does not allow, e.g. resuming a running run (400; 409 where the API has it)."""
