"""The NinjaAPI object: JSON errors in one shape, the docs page from the vendored Swagger UI.

Every error is `{"error": "<for a person>", "errors": {"<field>": "<message>"}}` (`errors` only on
400s): 400 bad body/query (the field named), 401 no or bad credentials, 403 a role too low (or CSRF,
or ingestion for a run that ended), 404 unknown or not yours, 409 an action the run's state does not
allow, 429 too many invalid API tokens from one address.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied, ValidationError as DjangoValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.openapi.docs import DocsBase
from ninja.parser import Parser

from tltweb.accounts.lockout import lockout_response
from tltweb.accounts.services import LoginLockedOut
from tltweb.runs.errors import RunStateError
from workers.tlt.config import ConfigError

DESCRIPTION = """Runs, their metrics, samples, logs and artifacts, and teams.

Authenticate with a personal API token (`Authorization: Bearer tlt_...`, created on
[/account/tokens/](/account/tokens/)) or a browser session (unsafe methods then need the
`X-CSRFToken` header). The ingestion endpoints (`/api/ingest/...`) take the run's own token,
which only its training job holds.

Errors are JSON: `{"error": "...", "errors": {"field": "message"}}`; 400 names the bad field,
404 means unknown or not visible to you, 409 an action the run's state does not allow."""


class JsonParser(Parser):
    """JSON bodies with NaN/Infinity read as null: PostgreSQL's JSON columns cannot hold them."""

    def parse_body(self, request: HttpRequest) -> Any:
        return json.loads(request.body, parse_constant=lambda _c: None)


class VendoredSwagger(DocsBase):
    """Swagger UI from static/vendor/swagger-ui (no CDN), page script static/js/api_docs.js.

    The page is for signed-in people, like every page; the schema itself (/api/openapi.json)
    stays public, as before, for API clients and generators."""

    def render_page(self, request: HttpRequest, api: NinjaAPI, **kwargs: Any) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        return render(request, "api/docs.html", {"openapi_url": reverse("openapi-json")})


class Api(NinjaAPI):
    def get_root_path(self, path_params: dict[str, Any]) -> str:
        return reverse("api-root")  # included without a namespace: the URL names stay global


api = Api(
    title="TLT Platform API",
    version="1",
    description=DESCRIPTION,
    docs=VendoredSwagger(),
    docs_url="/docs",
    openapi_url="/openapi.json",
    parser=JsonParser(),
)


def error(request: HttpRequest, status: int, message: str, errors: dict[str, str] | None = None) -> HttpResponse:
    body: dict[str, Any] = {"error": message}
    if errors:
        body["errors"] = errors
    response = api.create_response(request, body, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="tlt"'
    return response


def _field(loc: tuple | list) -> str:
    """("body", "body", "name") -> "name": where the client put it, not how ninja wraps it."""
    parts = [str(p) for p in loc]
    while parts and parts[0] in {"body", "query", "path", "form", "header", "cookie", "file"}:
        parts.pop(0)
    return ".".join(parts) or "body"


def pydantic_errors(errors: list[dict[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in errors:
        msg = str(e.get("msg", "invalid"))
        out.setdefault(_field(e.get("loc", ())), msg.removeprefix("Value error, "))
    return out


@api.exception_handler(ValidationError)
def _validation(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    errors = pydantic_errors(exc.errors)
    return error(request, 400, "invalid request: " + "; ".join(f"{k}: {v}" for k, v in errors.items()), errors)


@api.exception_handler(ConfigError)
def _config(request: HttpRequest, exc: ConfigError) -> HttpResponse:
    return error(request, 400, "invalid config", {k: str(v) for k, v in exc.errors.items()})


@api.exception_handler(DjangoValidationError)
def _django_validation(request: HttpRequest, exc: DjangoValidationError) -> HttpResponse:
    if hasattr(exc, "error_dict"):
        errors = {k: "; ".join(v) for k, v in exc.message_dict.items()}
    else:
        errors = {"body": "; ".join(exc.messages)}
    return error(request, 400, "invalid request: " + "; ".join(f"{k}: {v}" for k, v in errors.items()), errors)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    message = exc.message if exc.message != "Unauthorized" else (
        "authentication required: send 'Authorization: Bearer <API token>'"
    )
    return error(request, 401, message)


@api.exception_handler(HttpError)
def _http(request: HttpRequest, exc: HttpError) -> HttpResponse:
    if exc.status_code == 400 and exc.message.startswith("Cannot parse request body"):
        cause = exc.__cause__
        return error(request, 400, f"body is not JSON: {cause}" if cause else "body is not JSON")
    return error(request, exc.status_code, exc.message)


@api.exception_handler(Http404)
def _not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return error(request, 404, str(exc) or "not found")


@api.exception_handler(PermissionDenied)
def _forbidden(request: HttpRequest, exc: PermissionDenied) -> HttpResponse:
    return error(request, 403, str(exc) or "forbidden")


@api.exception_handler(LoginLockedOut)
def _locked_out(request: HttpRequest, exc: LoginLockedOut) -> HttpResponse:
    return lockout_response(request)  # 429, as the login page's lockout (django-axes)


@api.exception_handler(RunStateError)
def _conflict(request: HttpRequest, exc: RunStateError) -> HttpResponse:
    return error(request, 409, str(exc))
