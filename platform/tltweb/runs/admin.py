from django.contrib import admin

from tltweb.runs.models import Artifact, MetricStep, Run


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
    list_display = ["run", "kind", "step", "size", "sha256", "created_at"]
    list_filter = ["kind"]
