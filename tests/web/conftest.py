"""Fixtures shared by the web tests (users and teams are in tests/conftest.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest


@pytest.fixture
def hook(settings):
    """A real local webhook receiver: `hook.url(path)`, the status codes it answers in turn
    (`hook.answers`, then 200) and the JSON bodies it got (`hook.bodies`)."""
    settings.TLT_WEBHOOK_ALLOW_PRIVATE = True  # it listens on loopback
    answers: list[int] = []
    bodies: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(answers.pop(0) if answers else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(answers=answers, bodies=bodies, url=lambda path: f"http://127.0.0.1:{server.server_port}{path}")
    server.shutdown()
