"""Thin Celery tasks: each receives an id and calls one service (tltweb.runs.services).

The services import this module to enqueue (`tasks.run_submit.delay(...)` on commit); each task
imports the services when it runs, so neither module needs the other at import time, and a
worker sets Django up through Celery's own Django fix-up (workers/celery_app.py), not here.
"""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(bind=True, max_retries=5, default_retry_delay=10, acks_late=True)
def run_submit(self, run_id: str) -> str:
    """Submit the run's Ray job (idempotent); retried while the Ray head is unreachable."""
    from tltweb.runs import services

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
    from tltweb.runs import services

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
    from tltweb.runs import services

    return services.runs_sync()


@shared_task(bind=True, max_retries=6, acks_late=True)
def alert_webhook_post(self, alert_id: int) -> str:
    """POST a run's alert to its team's webhook. Retried on network errors, 429 and 5xx with
    exponential back-off and jitter (about 10 s, 20 s, ... capped at 10 min, 6 retries); a 4xx
    answer is final (a retry would get the same). Gives up by marking the alert's webhook failed."""
    import random

    from tltweb.runs import health

    try:
        return health.alert_webhook_deliver(alert_id=alert_id)
    except health.WebhookRetry as exc:
        if self.request.retries >= self.max_retries:
            health.alert_webhook_give_up(alert_id=alert_id, error=str(exc))
            return "failed"
        delay = min(600, 10 * 2 ** self.request.retries)
        raise self.retry(countdown=delay * random.uniform(0.5, 1.0))
