"""File answers shared by the pages and the API: an artifact (streamed, with its SHA-256) and a
run's whole job log. Callers check the team role first (selectors.*_get_for_user)."""

from __future__ import annotations

from django.http import FileResponse, Http404, HttpResponse

from tltweb.runs import selectors, services
from tltweb.runs.models import Artifact, Run


def artifact_response(artifact: Artifact) -> FileResponse:
    path = services.artifact_path(artifact)
    if not path.exists():
        raise Http404("artifact file is missing")
    response = FileResponse(path.open("rb"), as_attachment=True, filename=artifact.filename,
                            content_type="application/octet-stream")
    response["X-Checksum-SHA256"] = artifact.sha256
    return response


def log_response(run: Run) -> HttpResponse:
    text = selectors.run_log_text(run=run)
    if text is None:
        raise Http404("no log yet: the job's log is kept when the run ends")
    response = HttpResponse(text, content_type="text/plain; charset=utf-8")
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in run.name)[:80] or "run"
    response["Content-Disposition"] = f'attachment; filename="{safe}-{str(run.id)[:8]}.log"'
    return response
