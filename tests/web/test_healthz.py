"""/healthz: public, reports database, broker and Ray, 503 when any is down, no secrets."""

from __future__ import annotations

import pytest
import requests

from tltweb import health


@pytest.fixture
def ray_up(monkeypatch):
    monkeypatch.setattr(health, "CHECKS", {**health.CHECKS, "ray": lambda: None})


def test_it_is_ok_when_everything_answers(client, db, ray_up):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok" and set(body["checks"]) == {"database", "broker", "ray"}


def test_it_returns_503_naming_what_is_down(client, db, settings):
    settings.RAY_ADDRESS = "http://127.0.0.1:9"  # nothing listens on the discard port
    resp = client.get("/healthz")
    assert resp.status_code == 503
    body = resp.json()
    assert body["checks"]["ray"]["ok"] is False and body["checks"]["database"]["ok"] is True


def test_it_shows_no_addresses_or_credentials(client, db, settings, monkeypatch):
    settings.RAY_ADDRESS = "http://user:hunter2@127.0.0.1:9"

    def refuse():
        raise requests.ConnectionError(f"cannot reach {settings.RAY_ADDRESS} with hunter2")

    monkeypatch.setattr(health, "CHECKS", {**health.CHECKS, "ray": refuse})
    text = client.get("/healthz").content.decode()
    assert "hunter2" not in text and "127.0.0.1" not in text and settings.SECRET_KEY not in text


def test_it_needs_no_login(client, db, ray_up):
    assert client.get("/healthz").status_code == 200
