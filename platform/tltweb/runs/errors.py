"""Errors of the runs services and selectors, mapped to HTTP by the views and the API (tltweb.api.api)."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied


class RunFinished(PermissionDenied):
    """Ingestion for a run that has reached a final state: its metrics and artifacts are immutable (403)."""


class RunStateError(Exception):
    """An action the run's state does not allow (cancelling a finished run, resuming a running one): HTTP 409
    in the API, a message on the run page."""
