"""Settings come from the environment; bad values stop the start-up with the variable's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from tltweb.env import database_from_url, env_bool, env_int, env_list, env_str

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("On", True), ("0", False), ("false", False), ("", True)])
def test_env_bool_reads_common_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("X_FLAG", value)
    assert env_bool("X_FLAG", True) is expected


def test_env_bool_refuses_other_values_naming_the_variable(monkeypatch):
    monkeypatch.setenv("X_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="X_FLAG"):
        env_bool("X_FLAG", False)


def test_env_int_refuses_non_numbers_and_too_small_values(monkeypatch):
    monkeypatch.setenv("X_NUM", "ten")
    with pytest.raises(ImproperlyConfigured, match="X_NUM"):
        env_int("X_NUM", 1)
    monkeypatch.setenv("X_NUM", "-5")
    with pytest.raises(ImproperlyConfigured, match="X_NUM must be >= 0"):
        env_int("X_NUM", 1, minimum=0)
    monkeypatch.setenv("X_NUM", "42")
    assert env_int("X_NUM", 1) == 42


def test_env_list_and_str_use_defaults_when_unset(monkeypatch):
    monkeypatch.delenv("X_LIST", raising=False)
    assert env_list("X_LIST", ["a"]) == ["a"] and env_str("X_LIST", "d") == "d"
    monkeypatch.setenv("X_LIST", " a, b ,,c ")
    assert env_list("X_LIST", []) == ["a", "b", "c"]


def test_database_url_parses_postgres():
    db = database_from_url("postgres://tlt:s%40cret@db.local:5433/tlt")
    assert (db["ENGINE"], db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "django.db.backends.postgresql", "tlt", "tlt", "s@cret", "db.local", "5433")
    assert database_from_url("postgres://postgres@127.0.0.1/tlt")["PORT"] == ""


def test_database_url_parses_sqlite():
    assert database_from_url("sqlite:////tmp/x.sqlite3")["NAME"] == "/tmp/x.sqlite3"


@pytest.mark.parametrize("url", ["mysql://u@h/db", "postgres://u@h:5432/", "sqlite://", "postgres://u@h:port/db"])
def test_database_url_refuses_what_it_cannot_use(url):
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        database_from_url(url)


def _django(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY", "DATABASE_URL", "DJANGO_ALLOW_ASYNC_UNSAFE"}}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def test_it_refuses_to_start_without_a_secret_key_when_debug_is_off():
    result = _django({"DEBUG": "0"}, "check")
    assert result.returncode != 0 and "SECRET_KEY must be set" in result.stderr


def test_it_refuses_a_bad_boolean_at_start_up():
    result = _django({"DEBUG": "sometimes"}, "check")
    assert result.returncode != 0 and "DEBUG must be a boolean" in result.stderr


def test_check_deploy_passes_with_production_settings(tmp_path):
    env = {
        "DEBUG": "0",
        "SECRET_KEY": "x" * 20 + "-production-secret-key-with-enough-entropy-0123456789",
        "ALLOWED_HOSTS": "tlt.example.org",
        "TLT_VAR_DIR": str(tmp_path),
    }
    result = _django(env, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stderr + result.stdout
