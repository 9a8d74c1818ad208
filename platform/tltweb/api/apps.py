from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "tltweb.api"
    label = "api"
