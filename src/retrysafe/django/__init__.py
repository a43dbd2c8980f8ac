"""retrysafe for Django (``pip install 'retrysafe[django]'``): idempotency keys in
``MIDDLEWARE``, configured by settings, stored in the app's own database.

    INSTALLED_APPS = [..., "retrysafe.django"]          # the keys' tables (manage.py migrate)
    MIDDLEWARE = [..., "retrysafe.django.IdempotencyMiddleware"]
    RETRYSAFE = {"STORE": "django", "KEY_REQUIRED": [r"/api/payments/.*"], "LEASE": 10}

The middleware drives the same engine as :class:`retrysafe.server.IdempotencyMiddleware`
(SPEC §3, §4), sync or async. With ``"TRANSACTIONAL": True`` each claimed request's view runs
inside ``transaction.atomic()`` and the key completes in that same transaction: the view's
writes and the stored answer commit together or not at all. ``manage.py retrysafe_keys``
mirrors ``retrysafe keys``. See ``docs/django.md``.

Supported: Django 4.2 to 6.x (a version outside that range raises ``ConfigurationError`` naming it);
SQLite and PostgreSQL (psycopg 3) databases for ``STORE: "django"``; any retrysafe store URL.
"""

from retrysafe.django._version import check_django

check_django()

from retrysafe.django._middleware import IdempotencyMiddleware  # noqa: E402
from retrysafe.django._settings import DjangoSettings, load_settings  # noqa: E402
from retrysafe.django._store import DjangoStore  # noqa: E402
from retrysafe.server._outcome import mark_outcome_unknown  # noqa: E402

__all__ = [
    "DjangoSettings",
    "DjangoStore",
    "IdempotencyMiddleware",
    "load_settings",
    "mark_outcome_unknown",
]
