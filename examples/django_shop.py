"""A one-file Django shop behind a chaos proxy that loses answers after the view committed:
without retrysafe a retried charge is charged twice; with ``retrysafe.django`` it is charged
once (``pip install 'retrysafe[django]'``).

The project is real Django (settings, a model, migrations, the ``retrysafe.django`` app and
middleware), served by uvicorn over Django's ASGI handler; the keys live in the project's own
SQLite database.

    python examples/django_shop.py          # exits 0 when every order was charged once
"""

from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import django
import httpx
from django.conf import settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from retrysafe._serving import ServerThread
from retrysafe.chaos import ChaosProxy, Fault, FaultRates

ORDERS = 20


def configure(db: Path, protected: bool) -> None:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",  # noqa: S106
        ALLOWED_HOSTS=["127.0.0.1"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["retrysafe.django", "django.contrib.contenttypes"],
        MIDDLEWARE=["retrysafe.django.IdempotencyMiddleware"] if protected else [],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(db)}},
        RETRYSAFE={"STORE": "django", "KEY_REQUIRED": [r"/charge"], "TRANSACTIONAL": True},
        USE_TZ=True,
        TIME_ZONE="UTC",
    )
    django.setup()


def charge(request: Any) -> Any:
    """The effect: one row in ``charges`` per run of the view."""
    from django.db import connection
    from django.http import JsonResponse

    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, body TEXT)")
        cursor.execute("INSERT INTO charges (body) VALUES (%s)", [request.body.decode()])
        charge_id = cursor.lastrowid
    return JsonResponse({"charge": charge_id}, status=201)


def count_charges() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM charges")
        return int(cursor.fetchone()[0])


urlpatterns = [path("charge", csrf_exempt(charge))]  # ROOT_URLCONF is this module


def place_orders(url: str) -> None:
    """Each order is POSTed until it gets an answer, always with its own key (a timeout or a
    dropped connection means "I don't know", so the retry carries the same key)."""
    with httpx.Client(base_url=url, timeout=5) as client:
        for n in range(ORDERS):
            key = str(uuid.uuid4())
            for _attempt in range(50):
                try:
                    r = client.post("/charge", json={"order": n}, headers={"Idempotency-Key": key})
                except httpx.TransportError:
                    continue
                if r.status_code == 201:
                    break


def main(protected: bool = True) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        configure(Path(tmp) / "shop.sqlite3", protected)
        from django.core.asgi import get_asgi_application
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        with (
            ServerThread(get_asgi_application()) as server,
            ChaosProxy(server.url, rates=FaultRates(lose_after_commit=0.3), seed=3) as proxy,
        ):
            place_orders(proxy.url)
            lost = proxy.stats().by_fault.get(Fault.LOSE_AFTER_COMMIT, 0)
        charged = count_charges()
    print(f"{ORDERS} orders, {lost} answers lost after commit, {charged} charges")
    return 0 if charged == ORDERS else 1


if __name__ == "__main__":
    sys.exit(main(protected="--naive" not in sys.argv))
