"""Tiny typed readers for settings from the environment (healthchecks' envbool/envint, in small).

Each reader returns the default when the variable is unset or empty, and raises
ImproperlyConfigured naming the variable when the value cannot be parsed, so a typo in a
deployment fails at start-up instead of silently using a default.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value and value.strip() else None


def env_str(name: str, default: str) -> str:
    return _raw(name) or default


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {number}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def database_from_url(url: str, *, name: str = "DATABASE_URL") -> dict:
    """`postgres://user:pass@host:port/db` or `sqlite:///abs/path.sqlite3` -> a DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # dj-database-url convention: sqlite:////abs/path is absolute, sqlite:///rel/path relative.
        path = unquote(parts.path)[1:]
        if not path:
            raise ImproperlyConfigured(f"{name}: sqlite URL needs a file path, e.g. sqlite:////abs/db.sqlite3")
        # WAL and BEGIN IMMEDIATE: the web app, the Celery worker and beat share the file; readers then never
        # block the writer, and a writer waits for the lock instead of failing with "database is locked".
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20,
                        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL"},
        }
    if parts.scheme in {"postgres", "postgresql", "pgsql"}:
        db = unquote(parts.path.lstrip("/"))
        if not db:
            raise ImproperlyConfigured(f"{name}: postgres URL needs a database name, e.g. postgres://u@host:5432/tlt")
        try:
            port = parts.port
        except ValueError:
            raise ImproperlyConfigured(f"{name}: bad port in {url!r}") from None
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": db,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfigured(f"{name} must start with postgres:// or sqlite:///, got {parts.scheme or url!r}")
