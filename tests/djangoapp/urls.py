"""The test project's views: ``POST /charge`` writes one Charge row per run (the effect)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from djangoapp.shop.models import Charge
from retrysafe.django import mark_outcome_unknown


def _charge(request: HttpRequest) -> Charge:
    data = json.loads(request.body or b"{}")
    return Charge.objects.create(
        key=request.headers.get("Idempotency-Key", ""), amount=int(data.get("amount", 0))
    )


@csrf_exempt
def charge(request: HttpRequest) -> HttpResponse:
    started = request.headers.get("X-Started")
    if started:  # a file that tells the test the view is running (its sleep begins now)
        Path(started).write_text("started")
    time.sleep(float(request.headers.get("X-Sleep", "0")))
    made = _charge(request)
    crash_marker = request.headers.get("X-Crash-Once")
    if crash_marker and not Path(crash_marker).exists():
        # Effect written, key not yet completed: die here (transactional mode: neither lands).
        Path(crash_marker).write_text("crashed")
        os.kill(os.getpid(), signal.SIGKILL)
    hold = request.headers.get("X-Lock-Store")
    if hold:
        # The store stops serving after the effect (another process holds its write lock for
        # HOLD seconds): the answer cannot be recorded now.
        import sqlite3
        import threading

        from django.db import connection

        locker = sqlite3.connect(connection.settings_dict["NAME"], check_same_thread=False)
        locker.execute("BEGIN EXCLUSIVE")

        def unlock() -> None:
            locker.rollback()
            locker.close()

        threading.Timer(float(hold), unlock).start()
    status = int(request.headers.get("X-Status", "201"))
    if request.headers.get("X-Unknown"):
        mark_outcome_unknown(request.META)
    return JsonResponse({"id": made.pk, "amount": made.amount}, status=status)


@csrf_exempt
def stream(request: HttpRequest) -> StreamingHttpResponse:
    made = _charge(request)

    def parts() -> Iterator[bytes]:
        for i in range(3):
            yield f"part {i} of charge {made.pk}\n".encode()

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


@csrf_exempt
def astream(request: HttpRequest) -> StreamingHttpResponse:
    made = _charge(request)
    pause = float(request.headers.get("X-Chunk-Sleep", "0"))

    async def parts() -> AsyncIterator[bytes]:
        import asyncio

        for i in range(3):
            if i:
                await asyncio.sleep(pause)
            yield f"async part {i} of charge {made.pk}\n".encode()

    return StreamingHttpResponse(parts(), status=201, content_type="text/plain")


def charges(request: HttpRequest) -> JsonResponse:
    key = request.GET.get("key")
    rows = Charge.objects.filter(key=key) if key is not None else Charge.objects.all()
    return JsonResponse({"charges": rows.count()})


urlpatterns = [
    path("charge", charge),
    path("checked-charge", charge.__wrapped__),  # type: ignore[attr-defined]  # CSRF-checked
    path("stream", stream),
    path("astream", astream),
    path("charges", charges),
]
