"""The only module that talks to the Ray job submission API.

Services get a client from `ray_client()`; tests pass a fake with the same four methods
(get_job_info, submit_job, stop_job, get_job_logs).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from django.conf import settings

# Ray JobStatus -> run state; PENDING keeps the run queued.
JOB_STATE = {"RUNNING": "running", "SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "cancelled"}


def ray_auth_headers() -> dict[str, str]:
    """Ray >= 2.5x token auth: the cluster's token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token (where a local head keeps it), as an Authorization header; {} when none.

    Ray's own client only sends it when RAY_AUTH_MODE=token is set in this process, and a head
    started after any local `ray.init()` on the machine has token auth on, so send it explicitly.
    """
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        try:
            token = path.read_text().strip()
        except OSError:
            token = ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def ray_client() -> Any:
    from ray.job_submission import JobSubmissionClient  # heavy import; only workers need it

    return JobSubmissionClient(settings.RAY_ADDRESS, headers=ray_auth_headers())


def job_info_or_none(client: Any, submission_id: str) -> Any | None:
    """The job's JobDetails, or None when Ray has no job with this submission id."""
    try:
        return client.get_job_info(submission_id)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            return None
        raise


def job_status(info: Any) -> str:
    status = getattr(info, "status", "")
    return str(getattr(status, "value", status))


def job_entrypoint(*, out_dir: str, resume: bool = False) -> str:
    """`cd <repo> && exec <python> -m workers.tlt.train --out <dir> [--resume]`: the job's driver is the trainer."""
    workdir = shlex.quote(settings.TLT_JOB_WORKDIR)
    python = shlex.quote(settings.TLT_JOB_PYTHON)
    flags = " --resume" if resume else ""
    return f"cd {workdir} && exec {python} -m workers.tlt.train --out {shlex.quote(out_dir)}{flags}"


def cluster_resources(*, timeout_s: float = 5.0, ready_s: float = 10.0) -> dict[str, float]:
    """Total resources of the cluster's alive nodes ({"CPU": 4.0, "GPU": 1.0, ...}) from the dashboard's
    state API at RAY_ADDRESS. Raises ConnectionError when Ray does not answer, ValueError for a reply
    that is not the state API's."""
    import time

    import requests

    url = settings.RAY_ADDRESS.rstrip("/") + "/api/v0/nodes?limit=10000"
    deadline = time.monotonic() + ready_s
    while True:
        try:
            resp = requests.get(url, headers=ray_auth_headers(), timeout=timeout_s)
            resp.raise_for_status()
            nodes = resp.json()["data"]["result"]["result"]
        except requests.RequestException as exc:
            raise ConnectionError(str(exc)) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"unexpected reply from {url}: {exc}") from None
        total: dict[str, float] = {}
        for node in nodes:
            if node.get("state") != "ALIVE":
                continue
            for name, amount in (node.get("resources_total") or {}).items():
                total[name] = total.get(name, 0.0) + float(amount)
        if total or time.monotonic() > deadline:  # a head that just started lists its node a moment later
            return total
        time.sleep(0.5)
