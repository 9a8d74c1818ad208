"""Error pages: JSON under /api/ (so an API client never gets an HTML page for a URL the API does
not have), Django's templates (403.html, 404.html) elsewhere. Wired in tltweb/urls.py, and the CSRF
failure view in settings (CSRF_FAILURE_VIEW)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import csrf, defaults


def _api(request: HttpRequest) -> bool:
    return request.path.startswith("/api/")


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _api(request):
        return JsonResponse({"error": "bad request"}, status=400)
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _api(request):
        return JsonResponse({"error": str(exception or "") or "forbidden"}, status=403)
    return defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _api(request):
        return JsonResponse({"error": f"no such API endpoint or object: {request.path}"}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if _api(request):
        return JsonResponse({"error": "internal error"}, status=500)
    return defaults.server_error(request)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """An unsafe request to a non-API view under /api/ (the JSON 404 catch-all, the root redirect)
    without a CSRF token: the API's 403 shape (its own routes check CSRF on session auth themselves)."""
    if _api(request):
        return JsonResponse({"error": f"CSRF check failed: {reason}" if reason else "CSRF check failed"}, status=403)
    return csrf.csrf_failure(request, reason=reason)
