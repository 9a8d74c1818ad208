"""django-axes' lockout answer (AXES_LOCKOUT_CALLABLE): JSON under /api/, the lockout page elsewhere."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render


def lockout_response(request: HttpRequest, original_response: HttpResponse | None = None,
                     credentials: dict | None = None) -> HttpResponse:
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    if request.path.startswith("/api/"):
        return JsonResponse({"error": f"too many failed attempts from this address: locked out for {minutes} minutes"},
                            status=429)
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    ctx = {"failure_limit": settings.AXES_FAILURE_LIMIT, "username": username, "minutes": minutes}
    return render(request, "registration/locked_out.html", ctx, status=429)
