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
