"""Plumbing shared by the JSON endpoints: auth (token or session), errors as JSON, body parsing."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import pydantic
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, JsonResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt

from tltweb.accounts.lockout import lockout_response
from tltweb.accounts.services import LoginLockedOut, api_token_authenticate
from workers.tlt.config import ConfigError


def json_error(status: int, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def bearer(request: HttpRequest) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def parse_json(request: HttpRequest) -> Any:
    try:
        # NaN/Infinity become None: JSON columns in PostgreSQL cannot hold them.
        return json.loads(request.body or b"null", parse_constant=lambda _c: None)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None


class BadRequest(Exception):
    def __init__(self, message: str, **extra: Any):
        super().__init__(message)
        self.extra = extra


def pydantic_errors(exc: pydantic.ValidationError) -> dict[str, str]:
    return {".".join(str(p) for p in e["loc"]) or "body": e["msg"] for e in exc.errors()}


def _handle(view: Callable[..., JsonResponse], request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    try:
        return view(request, *args, **kwargs)
    except BadRequest as exc:
        return json_error(400, str(exc), **exc.extra)
    except pydantic.ValidationError as exc:
        return json_error(400, "invalid body", errors=pydantic_errors(exc))
    except ConfigError as exc:
        return json_error(400, "invalid config", errors=exc.errors)
    except ValidationError as exc:
        errors = exc.message_dict if hasattr(exc, "error_dict") else {"body": "; ".join(exc.messages)}
        return json_error(400, "invalid request", errors={k: "; ".join(v) if isinstance(v, list) else v for k, v in errors.items()})
    except Http404 as exc:
        return json_error(404, str(exc) or "not found")
    except PermissionDenied as exc:
        return json_error(403, str(exc) or "forbidden")


def api_endpoint(methods: tuple[str, ...]) -> Callable:
    """A user-facing JSON endpoint: personal token (Bearer) or session; CSRF checked for sessions."""

    def decorate(view: Callable[..., JsonResponse]) -> Callable[..., JsonResponse]:
        @csrf_exempt
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
            if request.method not in methods:
                return json_error(405, f"method {request.method} not allowed; use {', '.join(methods)}")
            token = bearer(request)
            if token is not None:
                try:
                    user = api_token_authenticate(plain=token, request=request)
                except LoginLockedOut:
                    return lockout_response(request)
                if user is None:
                    return json_error(401, "invalid or revoked API token")
                request.user = user
            elif not request.user.is_authenticated:
                request.user = AnonymousUser()
                return json_error(401, "authentication required: send 'Authorization: Bearer <API token>'")
            elif request.method not in ("GET", "HEAD", "OPTIONS"):
                reject = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
                if reject is not None:
                    return json_error(403, "CSRF check failed (session auth needs the X-CSRFToken header)")
            return _handle(view, request, *args, **kwargs)

        return wrapper

    return decorate


def ingest_endpoint(view: Callable[..., JsonResponse]) -> Callable[..., JsonResponse]:
    """A trainer-facing endpoint: POST only, auth by the run token (checked in the view)."""

    @csrf_exempt
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
        if request.method != "POST":
            return json_error(405, "use POST")
        return _handle(view, request, *args, **kwargs)

    return wrapper
