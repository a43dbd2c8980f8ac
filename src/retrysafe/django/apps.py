"""The ``retrysafe.django`` app: its migration creates retrysafe's tables in the app's
database, and the ``RETRYSAFE`` setting is checked when Django starts."""

from __future__ import annotations

from django.apps import AppConfig
from django.conf import settings


class RetrysafeConfig(AppConfig):
    name = "retrysafe.django"
    label = "retrysafe"
    verbose_name = "retrysafe"
    default = True

    def ready(self) -> None:
        from retrysafe.django._settings import SETTING, load_settings

        load_settings(getattr(settings, SETTING, None))  # ImproperlyConfigured at startup
