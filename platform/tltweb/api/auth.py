"""Who is calling: a person (personal API token, or the browser session with CSRF) or a training
job (the run's own ingestion token). Same rules as before django-ninja:

- `Authorization: Bearer tlt_...` that is wrong or revoked: 401, whatever the session says; after
  TLT_LOGIN_FAILURE_LIMIT of them from one address, 429 (django-axes) until the cool-off ends.
- no header and no session: 401; a session on an unsafe method without a valid CSRF token: 403.
- ingestion: no bearer token: 401; a token that is not this run's (or an unknown run): 403; the
  run's token after the run reached a final state (it is revoked then): 403, the run is immutable.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja.errors import AuthenticationError, HttpError
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from tltweb.accounts.services import api_token_authenticate
from tltweb.runs import selectors

SAFE_METHODS = ("GET", "HEAD", "OPTIONS", "TRACE")


def bearer(request: HttpRequest) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class ApiToken(HttpBearer):
    """A personal API token, created on /account/tokens/ (acts as its owner in every team)."""

    def __call__(self, request: HttpRequest) -> Any:
        if "Authorization" not in request.headers:
            return None  # maybe a session: the next auth decides
        return self.authenticate(request, bearer(request) or "")

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        user = api_token_authenticate(plain=token, request=request) if token else None  # LoginLockedOut: 429
        if user is None:
            raise AuthenticationError(401, "invalid or revoked API token")
        request.user = user
        return user


class Session(APIKeyCookie):
    """The browser's Django session (the pages' own JSON calls); unsafe methods need X-CSRFToken."""

    param_name = settings.SESSION_COOKIE_NAME

    def _get_key(self, request: HttpRequest) -> str | None:
        return request.COOKIES.get(self.param_name)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        if not request.user.is_authenticated:
            return None
        if request.method not in SAFE_METHODS and check_csrf(request) is not None:
            raise HttpError(403, "CSRF check failed (session auth needs the X-CSRFToken header)")
        return request.user


class RunToken(HttpBearer):
    """The run's ingestion token, handed to its Ray job; only ever valid for that one run."""

    def __call__(self, request: HttpRequest) -> Any:
        token = bearer(request)
        if token is None:
            raise AuthenticationError(401, "missing 'Authorization: Bearer <run token>'")
        return self.authenticate(request, token)

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        run_id = (request.resolver_match.kwargs if request.resolver_match else {}).get("run_id")
        if not run_id:
            raise HttpError(403, "wrong run token")
        return selectors.run_get_for_ingest(run_id=run_id, token=token)  # PermissionDenied, RunFinished: 403


USER_AUTH = [ApiToken(), Session()]
