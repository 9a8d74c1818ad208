"""TLT Platform's Django project: the web control plane.

    tltweb.settings   everything from the environment (tltweb.env: typed readers)
    tltweb.accounts   teams, member roles (owner/editor/viewer), personal API tokens
    tltweb.runs       runs, per-step metrics, artifacts; services.py writes, selectors.py reads,
                      dispatch.py is the only code that talks to Ray's job API
    tltweb.api        JSON API (token or session), trainer ingestion (per-run token), OpenAPI
    tltweb.health     /healthz

Lives under platform/, a source root that must never become a package (it would shadow the
standard library's `platform`).
"""

# Load the Celery app with Django so that `task.delay()` from web code goes to the configured
# broker; without this, shared tasks bind to Celery's unconfigured default app (cookiecutter-django).
from workers.celery_app import app as celery_app  # noqa: E402

__all__ = ["celery_app"]
