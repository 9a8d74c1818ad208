from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "tltweb.runs"
    label = "runs"
