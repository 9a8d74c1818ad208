"""GET /healthz: is the database, the Celery broker and the Ray job API reachable? 503 if not.

Public and cheap; it says which dependency is down but never how it is configured.
"""

from __future__ import annotations

import time
from typing import Callable

import requests
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


def _broker() -> None:
    from workers.celery_app import app

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
        if settings.CELERY_BROKER_URL.startswith("filesystem://"):
            folder = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_out"]
            probe = f"{folder}/.healthz"
            with open(probe, "w") as fh:
                fh.write("ok")


def _ray() -> None:
    from tltweb.runs.dispatch import ray_auth_headers

    resp = requests.get(settings.RAY_ADDRESS.rstrip("/") + "/api/version", headers=ray_auth_headers(), timeout=2)
    resp.raise_for_status()  # 401: reachable, but our token is missing or wrong: still unusable


CHECKS: dict[str, Callable[[], None]] = {"database": _database, "broker": _broker, "ray": _ray}


@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    results = {}
    for name, check in CHECKS.items():
        start = time.monotonic()
        try:
            check()
            results[name] = {"ok": True}
        except Exception as exc:  # any failure means down; only the kind of error is shown
            results[name] = {"ok": False, "error": type(exc).__name__}
        results[name]["ms"] = round((time.monotonic() - start) * 1000, 1)
    ok = all(r["ok"] for r in results.values())
    return JsonResponse({"status": "ok" if ok else "down", "checks": results}, status=200 if ok else 503)
