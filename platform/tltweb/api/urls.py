"""/api/...: the django-ninja routes under their global URL names (api-run, ingest-metrics, ...),
then a JSON 404 for every other path below /api/ and JSON for 405s."""

import functools

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, path, re_path
from django.views.generic import RedirectView

from ninja.openapi.views import openapi_json

from tltweb.api import views  # noqa: F401  (registers the routers on the api object)
from tltweb.api.api import api


def _json_405(view):
    """ninja answers a wrong method with plain text; say it in JSON like every other error."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        response = view(request, *args, **kwargs)
        if response.status_code == 405 and not response.get("Content-Type", "").startswith("application/json"):
            allowed = response.get("Allow", "")
            response = JsonResponse({"error": f"method {request.method} not allowed; use {allowed}"}, status=405)
            response["Allow"] = allowed
        return response

    return wrapper


def not_found(request: HttpRequest, rest: str = "") -> JsonResponse:
    if rest.startswith("runs/") and rest.count("/") <= 2:  # /api/runs/<not a uuid>[/...]
        return JsonResponse({"error": "no such run"}, status=404)
    return JsonResponse({"error": f"no such API endpoint: {request.path}"}, status=404)


def _patterns() -> list:
    out = []
    for pattern in api.urls[0]:
        if isinstance(pattern, URLPattern) and pattern.name == "api-root":
            continue  # replaced below: ninja's root answers an HTML 404
        if isinstance(pattern, URLPattern):
            pattern.callback = _json_405(pattern.callback)
        out.append(pattern)
    return out


urlpatterns = [
    *_patterns(),
    path("", RedirectView.as_view(pattern_name="openapi-view"), name="api-root"),
    path("openapi.json", functools.partial(openapi_json, api=api), name="api-openapi"),  # the old name, for reverse()
    re_path(r"^(?P<rest>.*)$", not_found, name="api-not-found"),
]
