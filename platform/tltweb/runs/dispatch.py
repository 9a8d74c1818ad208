"""The only module that talks to the Ray job submission API.

Services get a client from `ray_client()`; tests pass a fake with the same four methods
(get_job_info, submit_job, stop_job, get_job_logs).
"""

from __future__ import annotations

import shlex
from typing import Any

from django.conf import settings

# Ray JobStatus -> run state; PENDING keeps the run queued.
JOB_STATE = {"RUNNING": "running", "SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "cancelled"}


def ray_client() -> Any:
    from ray.job_submission import JobSubmissionClient  # heavy import; only workers need it

    return JobSubmissionClient(settings.RAY_ADDRESS)


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


def job_entrypoint(*, out_dir: str) -> str:
    """`cd <repo> && <python> -m workers.tlt.train --out <dir>`: the job's driver is the trainer."""
    workdir = shlex.quote(settings.TLT_JOB_WORKDIR)
    python = shlex.quote(settings.TLT_JOB_PYTHON)
    return f"cd {workdir} && exec {python} -m workers.tlt.train --out {shlex.quote(out_dir)}"
