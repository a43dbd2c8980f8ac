"""A real Django project for the retrysafe.django tests, configured from the environment:

- ``RS_PG_SCHEMA``: use PostgreSQL (``RETRYSAFE_TEST_POSTGRES``) with this search_path;
  otherwise SQLite at ``RS_SQLITE``;
- ``RS_RETRYSAFE``: the ``RETRYSAFE`` setting as JSON (default: Django's database).
"""

from __future__ import annotations

import json
import os
from typing import Any

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "djangoapp.urls"
INSTALLED_APPS = ["retrysafe.django", "djangoapp.shop"]
MIDDLEWARE = ["retrysafe.django.IdempotencyMiddleware"]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
LOGGING_CONFIG = None

_schema = os.environ.get("RS_PG_SCHEMA")
DATABASES: dict[str, Any]
if _schema:
    from psycopg.conninfo import conninfo_to_dict

    _pg = conninfo_to_dict(
        os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    )
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _pg.get("dbname", "test"),
            "USER": _pg.get("user", "postgres"),
            "PASSWORD": _pg.get("password", ""),
            "HOST": _pg.get("host", "127.0.0.1"),
            "PORT": str(_pg.get("port", "5432")),
            "OPTIONS": {
                "options": f"-c search_path={_schema}",
                "application_name": os.environ.get("RS_PG_APP", "djangoapp"),
            },
            "CONN_MAX_AGE": int(os.environ.get("RS_CONN_MAX_AGE", "0")),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("RS_SQLITE", "/tmp/retrysafe-django-tests.sqlite3"),
            "OPTIONS": {"timeout": float(os.environ.get("RS_SQLITE_TIMEOUT", "10"))},
        }
    }

RETRYSAFE: dict[str, Any] = json.loads(os.environ.get("RS_RETRYSAFE", '{"STORE": "django"}'))
