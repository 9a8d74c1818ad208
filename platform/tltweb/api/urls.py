from django.urls import path

from tltweb.api import views

urlpatterns = [
    path("openapi.json", views.openapi, name="api-openapi"),
    path("runs", views.runs, name="api-runs"),
    path("runs/<uuid:run_id>", views.run_detail, name="api-run"),
    path("runs/<uuid:run_id>/cancel", views.run_cancel, name="api-run-cancel"),
    path("runs/<uuid:run_id>/clone", views.run_clone, name="api-run-clone"),
    path("runs/<uuid:run_id>/resume", views.run_resume, name="api-run-resume"),
    path("runs/<uuid:run_id>/metrics", views.run_metrics, name="api-run-metrics"),
    path("runs/<uuid:run_id>/metrics/<int:step>", views.run_metrics_step, name="api-run-metrics-step"),
    path("runs/<uuid:run_id>/artifacts", views.run_artifacts, name="api-run-artifacts"),
    path("runs/<uuid:run_id>/artifacts/<int:artifact_id>/file", views.artifact_download, name="api-artifact-download"),
    path("ingest/runs/<uuid:run_id>/metrics", views.ingest_metrics, name="ingest-metrics"),
    path("ingest/runs/<uuid:run_id>/artifacts", views.ingest_artifacts, name="ingest-artifacts"),
]
