"""Thin Celery tasks: each receives a run id and calls one service (tltweb.runs.services)."""

from __future__ import annotations

import logging

import django
from celery import shared_task
from django.apps import apps

if not apps.ready:  # a worker may import this module before Django is set up
    django.setup()

from tltweb.runs import services  # noqa: E402

log = logging.getLogger(__name__)


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


@shared_task(bind=True, max_retries=12, acks_late=True)
def run_cancel(self, run_id: str) -> bool:
    """Stop the run's Ray job (the run is already marked cancelled), retried with back-off (5 s .. 5 min)
    until Ray confirms it stopped. Should it give up, runs_sync goes on stopping the job: the run's
    job_stopped_at stays empty until Ray confirms, so a cancel never leaves a job running."""
    try:
        if services.run_stop_job(run_id=run_id):
            return True
        reason = "Ray has not confirmed the stop yet"
    except (ConnectionError, OSError, RuntimeError) as exc:
        reason = str(exc)
    if self.request.retries >= self.max_retries:
        log.warning("run %s: giving the job stop over to runs_sync (%s)", run_id, reason)
        return False
    raise self.retry(countdown=min(300, 5 * 2 ** self.request.retries))


@shared_task
def runs_sync() -> int:
    """Periodic (beat): map Ray job statuses onto active runs, resume runs whose job died, stop the
    jobs of cancelled runs."""
    return services.runs_sync()
