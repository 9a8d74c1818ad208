from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "tltweb.accounts"
    label = "accounts"
