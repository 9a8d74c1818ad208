"""The OpenAPI description served at /api/openapi.json (hand-written; the API is small)."""

from tltweb.api.schemas import LaunchBody, MetricsBody, RunPatchBody

_err = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_run_id = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}


def _ok(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": {"type": "object"}}}}


def _body(ref: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


_user_errors = {"400": _err, "401": _err, "403": _err, "404": _err}

OPENAPI = {
    "openapi": "3.1.0",
    "info": {
        "title": "TLT Platform API",
        "version": "1",
        "description": "Runs, metrics and artifacts. Authenticate with a personal API token "
        "(`Authorization: Bearer tlt_...`, created on /account/tokens/) or a browser session "
        "(unsafe methods then need X-CSRFToken). Ingestion endpoints take the run's own token.",
    },
    "components": {
        "securitySchemes": {
            "apiToken": {"type": "http", "scheme": "bearer", "description": "personal API token"},
            "runToken": {"type": "http", "scheme": "bearer", "description": "per-run ingestion token"},
        },
        "schemas": {
            "Error": {
                "type": "object",
                "properties": {"error": {"type": "string"}, "errors": {"type": "object", "additionalProperties": {"type": "string"}}},
                "required": ["error"],
            },
            "LaunchBody": LaunchBody.model_json_schema(),
            "RunPatchBody": RunPatchBody.model_json_schema(),
            "MetricsBody": MetricsBody.model_json_schema(),
        },
    },
    "security": [{"apiToken": []}],
    "paths": {
        "/api/runs": {
            "get": {
                "summary": "Runs of your teams",
                "parameters": [
                    {"name": n, "in": "query", "schema": {"type": "string"}} for n in ("state", "tag", "creator", "preset", "q")
                ],
                "responses": {"200": _ok("{runs: [...]}"), "401": _err},
            },
            "post": {
                "summary": "Launch a run (editor or owner)",
                "requestBody": _body("LaunchBody"),
                "responses": {"201": _ok("the run"), **_user_errors},
            },
        },
        "/api/runs/{run_id}": {
            "parameters": [_run_id],
            "get": {"summary": "A run with config, error and log tail", "responses": {"200": _ok("the run"), **_user_errors}},
            "patch": {"summary": "Edit name, tags, notes", "requestBody": _body("RunPatchBody"), "responses": {"200": _ok("the run"), **_user_errors}},
        },
        "/api/runs/{run_id}/cancel": {"parameters": [_run_id], "post": {"summary": "Cancel (checkpoints kept)", "responses": {"200": _ok("the run"), **_user_errors}}},
        "/api/runs/{run_id}/clone": {"parameters": [_run_id], "post": {"summary": "Launch a copy", "responses": {"201": _ok("the new run"), **_user_errors}}},
        "/api/runs/{run_id}/resume": {"parameters": [_run_id], "post": {"summary": "Resume a failed or cancelled run from its last checkpoint (editor or owner)", "responses": {"200": _ok("the run, queued again"), **_user_errors}}},
        "/api/runs/{run_id}/metrics": {
            "parameters": [_run_id, {"name": "since", "in": "query", "schema": {"type": "integer", "default": -1}}],
            "get": {"summary": "Scalars of the steps after `since`", "responses": {"200": _ok("{state, steps: [{step, scalars}], last_step}"), **_user_errors}},
        },
        "/api/runs/{run_id}/metrics/{step}": {
            "parameters": [_run_id, {"name": "step", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "get": {"summary": "One step's record with series", "responses": {"200": _ok("{step, scalars, series}"), **_user_errors}},
        },
        "/api/runs/{run_id}/artifacts": {"parameters": [_run_id], "get": {"summary": "Artifacts", "responses": {"200": _ok("{artifacts: [...]}"), **_user_errors}}},
        "/api/runs/{run_id}/artifacts/{artifact_id}/file": {
            "parameters": [_run_id, {"name": "artifact_id", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "get": {"summary": "Download (streamed)", "responses": {"200": {"description": "the file"}, **_user_errors}},
        },
        "/api/ingest/runs/{run_id}/metrics": {
            "parameters": [_run_id],
            "post": {
                "summary": "Trainer: upsert one step's record (idempotent per step)",
                "security": [{"runToken": []}],
                "requestBody": _body("MetricsBody"),
                "responses": {"200": _ok("{ok, step}"), "400": _err, "401": _err, "403": _err},
            },
        },
        "/api/ingest/runs/{run_id}/artifacts": {
            "parameters": [_run_id],
            "post": {
                "summary": "Trainer: upload an artifact (multipart: kind, step, size, sha256, file); stored only if size and sha256 match",
                "security": [{"runToken": []}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "kind": {"type": "string"}, "step": {"type": "integer"},
                                    "size": {"type": "integer", "description": "bytes the sender measured"},
                                    "sha256": {"type": "string", "description": "SHA-256 (hex) the sender measured"},
                                    "file": {"type": "string", "format": "binary"},
                                },
                                "required": ["kind", "step", "size", "sha256", "file"],
                            }
                        }
                    },
                },
                "responses": {"201": _ok("the artifact"), "400": _err, "401": _err, "403": _err},
            },
        },
        "/healthz": {"get": {"summary": "Database, broker, Ray", "security": [], "responses": {"200": _ok("all up"), "503": _ok("something down")}}},
    },
}
