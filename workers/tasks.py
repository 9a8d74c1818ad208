"""Thin Celery tasks: each receives a run id and calls one service (tltweb.runs.services)."""

from __future__ import annotations

import django
from celery import shared_task
from django.apps import apps

if not apps.ready:  # a worker may import this module before Django is set up
    django.setup()

from tltweb.runs import services  # noqa: E402


@shared_task(bind=True, max_retries=5, default_retry_delay=10, acks_late=True)
def run_submit(self, run_id: str) -> str:
    """Submit the run's Ray job (idempotent); retried while the Ray head is unreachable."""
    try:
        return services.run_submit(run_id=run_id)
    except (ConnectionError, OSError, RuntimeError) as exc:
        if self.request.retries >= self.max_retries:
            services.run_fail(run_id=run_id, error=f"could not submit to Ray: {exc}")
            return "failed"
        raise self.retry(exc=exc)


@shared_task(bind=True, max_retries=5, default_retry_delay=10, acks_late=True)
def run_cancel(self, run_id: str) -> None:
    """Stop the run's Ray job (the run is already marked cancelled)."""
    try:
        services.run_stop_job(run_id=run_id)
    except (ConnectionError, OSError, RuntimeError) as exc:
        raise self.retry(exc=exc)


@shared_task
def runs_sync() -> int:
    """Periodic (beat): map Ray job statuses onto active runs."""
    return services.runs_sync()
