from django.contrib import admin

from tltweb.runs.models import Artifact, MetricStep, Run, RunAlert


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "creator", "preset", "state", "created_at"]
    list_filter = ["state", "preset", "team"]
    search_fields = ["name", "notes", "id"]
    readonly_fields = ["id", "ingest_token_hash", "created_at", "submitted_at", "started_at", "finished_at"]


@admin.register(MetricStep)
class MetricStepAdmin(admin.ModelAdmin):
    list_display = ["run", "step", "received_at"]
    list_select_related = ["run"]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["run", "kind", "step", "size", "content_sha256", "sha256", "created_at"]
    list_filter = ["kind"]


@admin.register(RunAlert)
class RunAlertAdmin(admin.ModelAdmin):
    list_display = ["run", "kind", "step", "webhook_state", "webhook_attempts", "created_at"]
    list_filter = ["kind", "webhook_state"]
    list_select_related = ["run"]
