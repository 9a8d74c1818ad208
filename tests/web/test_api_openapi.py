"""Tests generated from /api/openapi.json: every documented operation, called by alice (owner),
bob (viewer, then editor), charlie (an outsider with a team of his own) and anonymously, answers
with a status the document lists for it, in the content type it lists, with a body that matches
its schema; and the status is the one the operation's `x-tlt-access` promises for that caller.

Path parameters come from fixtures (a run with a metrics step, an artifact, a log, samples),
request bodies from the examples in the document itself (its schemas' `examples`). An operation
that needs the run in another state (resume: a run that failed) gets it from PREPARE.
"""

from __future__ import annotations

import hashlib
import json
import re

import jsonschema
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from tests.conftest import member_add, metrics_record_fake
from tltweb.accounts.services import api_token_create


def _spec() -> dict:
    import tltweb.api.urls  # noqa: F401  (registers the routes)
    from tltweb.api.api import api

    return json.loads(json.dumps(api.get_openapi_schema(), default=str))  # as served: string status codes


SPEC = _spec()
OPERATIONS = [
    (method.upper(), path, op)
    for path, ops in SPEC["paths"].items()
    for method, op in ops.items()
]
CALLERS = [("alice", "owner"), ("bob", "viewer"), ("bob", "editor"), ("charlie", None), ("anonymous", None)]
RANK = {"viewer": 1, "editor": 2, "owner": 3}
NEED = {"view": "viewer", "edit": "editor", "own": "owner"}


def test_the_document_is_openapi_3_and_every_operation_says_who_may_call_it():
    assert SPEC["openapi"].startswith("3.")
    assert len(OPERATIONS) >= 15
    for method, path, op in OPERATIONS:
        assert op.get("x-tlt-access") in {"view", "edit", "own", "signed-in", "editor-somewhere", "run-token"}, (method, path)
        assert op["summary"], (method, path)
        assert "security" in op, (method, path)


def expected_status(access: str, role: str | None, who: str, ok: int) -> int:
    """What the operation must answer this caller (ok: the operation's success status)."""
    if who == "anonymous":
        return 401
    if access == "run-token":
        return 403  # a personal token is never a run's token
    if access == "signed-in":
        return ok
    if access == "editor-somewhere":  # charlie owns his own team; bob only has alice's
        return ok if who != "bob" or RANK[role] >= RANK["editor"] else 403
    if role is None:
        return 404  # an outsider learns nothing about the object, not even that it exists
    return ok if RANK[role] >= RANK[NEED[access]] else 403


def _example(schema: dict) -> dict:
    if "$ref" in schema:
        schema = SPEC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    examples = schema.get("examples")
    assert examples, f"the body schema {schema.get('title')} has no example"
    return examples[0]


@pytest.fixture
def world(run, team, alice, bob, charlie, settings):
    """alice's run with one metrics step (samples included), an artifact and a log."""
    from tltweb.runs.services import artifact_store, metrics_record

    rec = metrics_record_fake(1)
    metrics_record(run=run, step=1, scalars=rec["scalars"], series=rec["series"])
    artifact = artifact_store(run=run, kind="drafter", step=1, upload=SimpleUploadedFile("drafter.zip", b"PK\x05\x06zip"))
    run.log_tail = "step 1: reward=0.1\n"
    run.save(update_fields=["log_tail"])
    return {"run_id": run.id, "artifact_id": artifact.pk, "step": 1, "team_id": team.pk}


def _run_failed(world: dict) -> None:
    from tltweb.runs.models import Run

    Run.objects.filter(pk=world["run_id"]).update(state="failed", failure="trainer")


def _run_paired(world: dict) -> None:
    from tests.conftest import run_make
    from tltweb.runs.models import Run

    run = Run.objects.get(pk=world["run_id"])
    run_make(run.team, run.creator, name="control", config=dict(run.config, run={**run.config["run"], "tlt": False}),
             ab_partner=run)


# operations whose success needs the run in another state than the world's running one (or a partner)
PREPARE = {("POST", "/api/runs/{run_id}/resume"): _run_failed, ("GET", "/api/runs/{run_id}/pair"): _run_paired}


def _call(client, method: str, path: str, op: dict, world: dict, token: str | None):
    PREPARE.get((method, path), lambda _world: None)(world)
    url = re.sub(r"\{(\w+)\}", lambda m: str(world[m.group(1)]), path)
    kwargs: dict = {}
    if token:
        kwargs["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    content = (op.get("requestBody") or {}).get("content", {})
    if "application/json" in content:
        kwargs.update(data=json.dumps(_example(content["application/json"]["schema"])), content_type="application/json")
    elif "multipart/form-data" in content:
        body = b"PK"
        kwargs.update(data={"kind": "drafter", "step": "3", "size": str(len(body)),
                            "sha256": hashlib.sha256(body).hexdigest(), "file": SimpleUploadedFile("d.zip", body)})
    return getattr(client, method.lower())(url, **kwargs)


def _check_documented(resp, op: dict) -> None:
    documented = op["responses"]
    assert str(resp.status_code) in documented, (resp.status_code, resp.content[:300])
    content = documented[str(resp.status_code)].get("content", {})
    ctype = resp["Content-Type"].split(";")[0]
    assert ctype in content, f"{resp.status_code} answered {ctype}, documented {list(content)}"
    if ctype == "application/json":
        schema = {**content[ctype]["schema"], "components": SPEC["components"]}
        jsonschema.validate(resp.json(), schema)


@pytest.mark.parametrize("method,path,op", OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
@pytest.mark.parametrize("who,role", CALLERS, ids=[f"{w}-{r or 'none'}" for w, r in CALLERS])
def test_every_operation_answers_each_caller_as_documented(client, request, world, bob, team, method, path, op, who, role):
    if who == "bob":
        member_add(team, bob, role)
    token = None if who == "anonymous" else api_token_create(user=request.getfixturevalue(who), name="t")[1]
    ok = min(int(code) for code in op["responses"] if code.startswith("2"))
    resp = _call(client, method, path, op, world, token)
    _check_documented(resp, op)
    assert resp.status_code == expected_status(op["x-tlt-access"], role, who, ok), resp.content[:300]


@pytest.mark.parametrize("method,path,op", [o for o in OPERATIONS if o[2]["x-tlt-access"] == "run-token"],
                         ids=[f"{m} {p}" for m, p, o in OPERATIONS if o["x-tlt-access"] == "run-token"])
def test_every_ingestion_operation_takes_the_runs_own_token(client, world, run_token, method, path, op):
    resp = _call(client, method, path, op, world, run_token)
    _check_documented(resp, op)
    assert resp.status_code in (200, 201), resp.content[:300]


def test_the_docs_page_is_for_signed_in_users(client):
    resp = client.get("/api/docs")
    assert resp.status_code == 302 and resp.url.startswith("/login/")


def test_the_docs_page_serves_the_vendored_swagger_ui_and_no_cdn(client, alice):
    client.force_login(alice)
    resp = client.get("/api/docs")
    html = resp.content.decode()
    assert resp.status_code == 200 and "vendor/swagger-ui/swagger-ui-bundle.js" in html
    assert not re.search(r"""(src|href)=["']https?://""", html), "the docs page loads something from the network"
    assert 'data-openapi-url="/api/openapi.json"' in html


def test_the_document_is_served_at_its_old_url(client):
    assert client.get("/api/openapi.json").json()["info"]["title"] == "TLT Platform API"
