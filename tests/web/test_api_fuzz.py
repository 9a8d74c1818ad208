"""Every JSON endpoint, fuzzed from the OpenAPI document the app serves at /api/openapi.json
(schemathesis, in process through the WSGI app): never a 500, and every error a JSON object with a
readable "error". Requests go out as the owner, a viewer, an outsider, anonymously and with wrong
tokens, at random or real ids, with data that fits the schema and data that does not.

The operations are read from the document, so endpoints added later (or the django-ninja API of
issue #15, which serves the same URL) are fuzzed without touching this file.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import member_add, metrics_record_fake

APP = get_wsgi_application()
SCHEMA = schemathesis.openapi.from_wsgi("/api/openapi.json", APP)
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
EXAMPLES = 40  # per operation and mode: ~15 operations x 2 modes in ~15 s; raise it locally to hunt


def _label(op) -> str:
    return f"{op.method.upper()} {op.path}"


@pytest.fixture
def in_process_requests():
    """As Django's test client does: a request must not close the test's connection (it sits in the
    test's transaction, which Django reads as an obsolete connection)."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def world(db, settings, in_process_requests, alice, bob, charlie, team, run):
    """Real objects to aim at, and the credentials to aim with."""
    from tltweb.accounts.services import api_token_create
    from tltweb.runs.services import artifact_store, metrics_record, run_token_rotate
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.AXES_FAILURE_LIMIT = 10**6  # wrong tokens are part of the fuzz; the lockout has its own tests
    member_add(team, bob, "viewer")
    rec = metrics_record_fake(0)
    metrics_record(run=run, step=0, scalars=rec["scalars"], series=rec["series"])
    artifact = artifact_store(run=run, kind="drafter", step=0, upload=SimpleUploadedFile("d.zip", b"PK-bytes"))
    tokens = {who: api_token_create(user=user, name="fuzz")[1] for who, user in
              (("alice", alice), ("bob", bob), ("charlie", charlie))}
    auth = [f"Bearer {tokens['alice']}"] * 3 + [f"Bearer {tokens['bob']}", f"Bearer {tokens['charlie']}", None,
                                                "Bearer tlt_wrong", "Bearer ", "Basic YWxpY2U6eA=="]
    return {"run": run, "artifact": artifact, "run_token": run_token_rotate(run=run), "auth": auth}


def _real_path_parameters(op, world) -> dict[str, object]:
    names = {p.name for p in op.path_parameters}
    real = {"run_id": str(world["run"].id), "artifact_id": world["artifact"].pk, "step": 0}
    return {k: v for k, v in real.items() if k in names}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("op", OPERATIONS, ids=_label)
def test_no_endpoint_answers_500_and_every_error_is_json(op, mode, world):
    strategies = [op.as_strategy(generation_mode=mode)]
    if op.path_parameters and mode == GenerationMode.POSITIVE:
        strategies.append(op.as_strategy(generation_mode=mode, path_parameters=_real_path_parameters(op, world)))
    ingest = "/ingest/" in op.path
    auths = [f"Bearer {world['run_token']}"] * 4 + world["auth"] if ingest else world["auth"]

    @hsettings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
               suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*strategies), auth=st.sampled_from(auths))
    def fuzz(case, auth):
        headers = {"Authorization": auth} if auth else {}
        response = case.call(app=APP, headers=headers)
        where = f"{_label(op)} -> {response.status_code}\n{case.as_curl_command(headers=headers)}"
        if op.path == "/healthz":  # 503 is its documented answer when a dependency is down
            assert response.status_code in (200, 503) and json.loads(response.text)["status"], where
            return
        assert response.status_code < 500, f"{where}\n{response.text[:2000]}"
        if response.status_code >= 400:
            ctype = (response.headers.get("content-type") or [""])[0]
            assert ctype.startswith("application/json"), f"{where}: not JSON ({ctype})\n{response.text[:500]}"
            body = json.loads(response.text)
            assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], f"{where}: {body}"

    try:
        fuzz()
    except Unsatisfiable:
        pytest.skip(f"{_label(op)} has no parameter or body that can be made invalid")


def test_the_fuzz_covers_every_operation_of_the_document():
    labels = {_label(op) for op in OPERATIONS}
    for must in ("GET /api/runs/{run_id}/metrics/{step}", "PATCH /api/runs/{run_id}", "POST /api/runs/{run_id}/resume",
                 "POST /api/ingest/runs/{run_id}/metrics", "POST /api/ingest/runs/{run_id}/artifacts",
                 "GET /api/runs/{run_id}/artifacts/{artifact_id}/file"):
        assert must in labels
