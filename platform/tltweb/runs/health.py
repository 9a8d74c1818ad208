"""Writes for a run's alerts: the losslessness audit and the drafter's health, checked on every
ingested step (services.metrics_record), raised once per (run, kind), and POSTed to the team's
webhook by a Celery task (workers.tasks.alert_webhook_post) when the team has one.

What raises an alert (scalars of workers/tlt/metrics.py and audit.py):
- greedy_mismatch: `audit/greedy_identical` < 1 at a checkpoint (SD changed a greedy output).
- acceptance_collapse: `spec/acceptance_length` below half the running median of the run's
  earlier values (the last ACCEPTANCE_WINDOW steps; at least ACCEPTANCE_MIN_HISTORY values).
- drafter_stale: a TLT run whose drafter got no applied spot-training update (`drafter/updates`
  > 0, or a `drafter/loss`, which the trainer sends only then) for TLT_DRAFTER_STALE_STEPS steps
  in a row while the policy moved (`learner/grad_norm` > 0). `drafter: {spot_training: false}`
  freezes the drafter, so such a run raises it by design (the stale-drafter control).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import statistics
from typing import Any
from urllib.parse import urlsplit

import requests
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.urls import reverse

from tltweb.runs.models import AlertKind, MetricStep, Run, RunAlert
from workers import tasks

log = logging.getLogger(__name__)

ACCEPTANCE_MIN_HISTORY = 3  # earlier measured steps needed before a collapse can be called
ACCEPTANCE_WINDOW = 50  # the running median is over the run's last 50 steps before this one


class WebhookRetry(Exception):
    """The webhook did not take the alert but may later (network error, 429, 5xx): retry."""


def _applied_update(scalars: dict[str, Any]) -> bool:
    return (scalars.get("drafter/updates") or 0) > 0 or scalars.get("drafter/loss") is not None


def run_health_check(*, run: Run, step: int) -> list[RunAlert]:
    """Check the run's alerts after `step` was recorded; returns the alerts raised now (new ones only)."""
    window = max(settings.TLT_DRAFTER_STALE_STEPS, ACCEPTANCE_WINDOW) + 1  # the newest steps up to this one
    rows = list(MetricStep.objects.filter(run=run, step__lte=step).order_by("-step").values_list("step", "scalars")[:window])
    rows.reverse()
    if not rows or rows[-1][0] != step:
        return []
    scalars = rows[-1][1]
    raised = []
    identical = scalars.get("audit/greedy_identical")
    if identical is not None and identical < 1:
        prompts = scalars.get("audit/greedy_prompts")
        raised.append(alert_raise(run=run, kind=AlertKind.GREEDY_MISMATCH, step=step, message=(
            f"step {step}: greedy decoding with SD matched plain decoding on {identical:.0%} of "
            f"{int(prompts) if prompts else 'the'} held-out prompts; SD must never change an output")))
    accept = scalars.get("spec/acceptance_length")
    earlier = [s.get("spec/acceptance_length") for _, s in rows[:-1]]
    earlier = [a for a in earlier if a is not None]
    if accept is not None and len(earlier) >= ACCEPTANCE_MIN_HISTORY:
        median = statistics.median(earlier)
        if accept < 0.5 * median:
            raised.append(alert_raise(run=run, kind=AlertKind.ACCEPTANCE_COLLAPSE, step=step, message=(
                f"step {step}: acceptance length {accept:.2f} is below half its running median {median:.2f}")))
    n = settings.TLT_DRAFTER_STALE_STEPS
    if run.is_tlt and len(rows) >= n:
        window = [s for _, s in rows[-n:]]
        if not any(_applied_update(s) for s in window) and all((s.get("learner/grad_norm") or 0) > 0 for s in window):
            frozen = not ((run.config or {}).get("drafter") or {}).get("spot_training", True)
            why = " (spot training is off in this run's config)" if frozen else ""
            raised.append(alert_raise(run=run, kind=AlertKind.DRAFTER_STALE, step=step, message=(
                f"step {step}: no drafter update applied for {n} steps while the policy moved{why}; "
                "acceptance will decay as the policy drifts from the drafter")))
    return [a for a in raised if a is not None]


def alert_raise(*, run: Run, kind: str, step: int, message: str) -> RunAlert | None:
    """Create the run's alert of this kind unless it exists; the team's webhook gets it on commit.
    Returns the new alert, None when the run already had one of this kind."""
    url = run.team.alert_webhook_url
    try:
        with transaction.atomic():
            alert = RunAlert.objects.create(run=run, kind=kind, step=step, message=message[:2000],
                                            webhook_state="pending" if url else "")
    except IntegrityError:  # raised before (or by a concurrent retry of the same step)
        return None
    log.warning("run %s: alert %s: %s", run.id, kind, message)
    if url:
        transaction.on_commit(lambda: tasks.alert_webhook_post.delay(alert.pk))
    return alert


def alert_payload(alert: RunAlert) -> dict[str, Any]:
    run = alert.run
    return {
        "alert": alert.kind, "title": alert.get_kind_display(), "message": alert.message, "step": alert.step,
        "run": {"id": str(run.id), "name": run.name, "team": run.team.name,
                "url": settings.TLT_PUBLIC_URL + reverse("run-detail", args=[run.id])},
        "raised_at": alert.created_at.isoformat(),
    }


def alert_webhook_deliver(*, alert_id: int) -> str:
    """POST the alert to its team's webhook once. "sent", or "failed" for an answer that a retry
    cannot change (4xx but 429, no webhook any more); raises WebhookRetry for one that it may."""
    alert = RunAlert.objects.select_related("run__team").filter(pk=alert_id).first()
    if alert is None or alert.webhook_state == "sent":
        return "sent" if alert else "gone"
    url = alert.run.team.alert_webhook_url
    RunAlert.objects.filter(pk=alert.pk).update(webhook_attempts=F("webhook_attempts") + 1)
    if not url:
        return _webhook_done(alert, "failed", "the team no longer has a webhook URL")
    refused = webhook_address_refusal(url, resolve=True)
    if refused:
        return _webhook_done(alert, "failed", f"not sent: {refused}")
    try:
        resp = requests.post(url, json=alert_payload(alert), timeout=settings.TLT_WEBHOOK_TIMEOUT_S,
                             headers={"User-Agent": "tlt-platform-alerts/1"}, allow_redirects=False)
    except requests.RequestException as exc:
        raise WebhookRetry(f"{type(exc).__name__}: {exc}") from None
    if resp.status_code == 429 or resp.status_code >= 500:
        raise WebhookRetry(f"HTTP {resp.status_code}")
    if resp.status_code >= 300:
        return _webhook_done(alert, "failed", f"HTTP {resp.status_code}: {resp.text[:500]}")
    return _webhook_done(alert, "sent", "")


def alert_webhook_give_up(*, alert_id: int, error: str) -> None:
    alert = RunAlert.objects.filter(pk=alert_id).first()
    if alert is not None:
        _webhook_done(alert, "failed", f"gave up after {alert.webhook_attempts} attempts: {error}")


def _webhook_done(alert: RunAlert, state: str, error: str) -> str:
    RunAlert.objects.filter(pk=alert.pk).update(webhook_state=state, webhook_error=error[:2000])
    if state == "failed":
        log.warning("alert %s of run %s: webhook %s (%s)", alert.kind, alert.run_id, state, error)
    return state


def team_webhook_set(*, team, url: str) -> None:
    """Set (or clear, with "") the team's alert webhook; the caller has checked the owner role."""
    from django.core.exceptions import ValidationError
    from django.core.validators import URLValidator

    url = url.strip()
    if url:
        URLValidator(schemes=["http", "https"])(url)
        if len(url) > 500:
            raise ValidationError({"alert_webhook_url": "at most 500 characters"})
        refused = webhook_address_refusal(url, resolve=False)
        if refused:
            raise ValidationError({"alert_webhook_url": refused})
    team.alert_webhook_url = url
    team.save(update_fields=["alert_webhook_url"])


def webhook_address_refusal(url: str, *, resolve: bool) -> str | None:
    """Why the server must not POST to `url`, or None. Alerts go to public addresses only (unless
    TLT_WEBHOOK_ALLOW_PRIVATE): a team owner must not make the server reach into its own network
    (the cloud's metadata service, the database, the Ray dashboard).

    resolve=False (saving the URL) judges IP literals and localhost names only, so a URL whose name
    resolves only where the server runs can still be saved; delivery (resolve=True) checks every
    address the name resolves to, just before the POST (a name that does not resolve is left to the
    POST, which fails and is retried). A DNS answer that changes between this check and the POST's
    own lookup is not caught.
    """
    if settings.TLT_WEBHOOK_ALLOW_PRIVATE:
        return None
    host = (urlsplit(url).hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is this server; webhooks must be public addresses"
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        if not resolve:
            return None
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.1 is 10.0.0.1
        if not (mapped or address).is_global:
            return f"{host} is a private or reserved address ({address}); webhooks must be public addresses"
    return None
