"""retrysafe.django in this process: Django's test Client through the whole middleware chain,
on Django's own SQLite database (SPEC §3, §4 as the ASGI/WSGI middleware)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping
from typing import Any

import pytest

from retrysafe import StoreUnavailableError

pytestmark = pytest.mark.usefixtures("django_project")


def _key() -> str:
    return f"k-{uuid.uuid4().hex}"


def _post(
    client: Any,
    key: str | None,
    amount: int = 5,
    path: str = "/charge",
    extra: dict[str, str] | None = None,
) -> Any:
    headers = dict(extra or {})
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(
        path,
        data=json.dumps({"amount": amount}),
        content_type="application/json",
        headers=headers,
    )


def _charges(key: str) -> int:
    from djangoapp.shop.models import Charge

    return int(Charge.objects.filter(key=key).count())


def _state(key: str) -> str | None:
    import time

    from retrysafe.core import key_hash
    from retrysafe.django import DjangoStore

    found = DjangoStore().find_keys(key_hash("", key), now=time.time(), limit=1)
    return found[0].state if found else None


@pytest.fixture
def client() -> Any:
    from django.test import Client

    return Client()


def test_repeat_replays_the_stored_answer_and_the_view_runs_once(client: Any) -> None:
    """Same key and body twice: one Charge row, the second answer is the first replayed."""
    key = _key()
    first, second = _post(client, key), _post(client, key)
    assert first.status_code == second.status_code == 201
    assert second.content == first.content
    assert second.headers["Idempotent-Replayed"] == "true"
    assert _charges(key) == 1
    assert _state(key) == "completed"


def test_same_key_with_another_body_is_422_key_reused(client: Any) -> None:
    """SPEC §3: the key names one request; another body with it is refused, nothing runs."""
    key = _key()
    assert _post(client, key, amount=5).status_code == 201
    reused = _post(client, key, amount=6)
    assert reused.status_code == 422
    assert reused.json()["type"].endswith("key-reused")
    assert _charges(key) == 1


def test_server_error_releases_the_key_so_a_retry_runs_again(client: Any) -> None:
    """A 5xx means "not done" (SPEC §4): the key is released and the retry runs the view."""
    key = _key()
    assert _post(client, key, extra={"X-Status": "500"}).status_code == 500
    assert _state(key) == "released"
    assert _post(client, key).status_code == 201
    assert _charges(key) == 2


def test_required_route_without_a_key_is_400_and_runs_nothing(configured: Any) -> None:
    """KEY_REQUIRED path patterns: a protected request there without a key gets 400."""
    from djangoapp.shop.models import Charge

    client = configured(KEY_REQUIRED=[r"/charge"])
    before = Charge.objects.count()
    missing = _post(client, None)
    assert missing.status_code == 400
    assert missing.json()["type"].endswith("missing-key")
    assert Charge.objects.count() == before
    assert _post(client, None, path="/stream").status_code == 201  # not a required route


def test_malformed_key_is_400_invalid_key(client: Any) -> None:
    """A key outside 1–255 visible ASCII is refused before anything runs (SPEC §2)."""
    answer = _post(client, "x" * 256)
    assert answer.status_code == 400
    assert answer.json()["type"].endswith("invalid-key")


def test_streaming_answer_is_recorded_and_replayed(client: Any) -> None:
    """A StreamingHttpResponse flows through, is recorded at its end, and is replayed."""
    key = _key()
    first = _post(client, key, path="/stream")
    body = b"".join(first.streaming_content)
    second = _post(client, key, path="/stream")
    assert second.status_code == 201
    assert second.content == body and body.count(b"part") == 3
    assert second.headers["Idempotent-Replayed"] == "true"
    assert _charges(key) == 1


def test_outcome_unknown_keeps_the_key_claimed(client: Any) -> None:
    """mark_outcome_unknown(request.META): the key stays running, a retry gets 409."""
    key = _key()
    assert _post(client, key, extra={"X-Unknown": "1"}).status_code == 201
    assert _state(key) == "running"
    retry = _post(client, key, extra={"X-Unknown": "1"})
    assert retry.status_code == 409
    assert _charges(key) == 1


def test_scope_function_keeps_tenants_apart(configured: Any) -> None:
    """SCOPE fn(request): the same key from two tenants is two operations."""
    client = configured(SCOPE="djangoapp.scopes.by_tenant")
    key = _key()
    a = _post(client, key, extra={"X-Tenant": "a"})
    b = _post(client, key, extra={"X-Tenant": "b"})
    a2 = _post(client, key, extra={"X-Tenant": "a"})
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert a2.headers["Idempotent-Replayed"] == "true"
    assert _charges(key) == 2


def test_async_face_replays_like_the_sync_one() -> None:
    """Under ASGI (AsyncClient, the async middleware chain) a repeat is replayed too."""
    import asyncio

    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    key = _key()

    async def both() -> tuple[Any, Any]:
        client = AsyncClient()
        body = json.dumps({"amount": 5})
        headers = {"Idempotency-Key": key}
        first = await client.post(
            "/charge", data=body, content_type="application/json", headers=headers
        )
        second = await client.post(
            "/charge", data=body, content_type="application/json", headers=headers
        )
        return first, second

    first, second = asyncio.run(both())
    assert first.status_code == second.status_code == 201
    assert second.headers["Idempotent-Replayed"] == "true"
    assert asyncio.run(sync_to_async(_charges)(key)) == 1


def test_transactional_mode_commits_the_effect_with_the_completion(configured: Any) -> None:
    """TRANSACTIONAL: a stored answer commits the view's row and the key together."""
    client = configured(TRANSACTIONAL=True)
    key = _key()
    assert _post(client, key).status_code == 201
    assert _charges(key) == 1 and _state(key) == "completed"
    assert _post(client, key).headers["Idempotent-Replayed"] == "true"
    assert _charges(key) == 1


def test_transactional_mode_rolls_the_effect_back_on_a_server_error(configured: Any) -> None:
    """TRANSACTIONAL: a 5xx rolls the view's writes back and releases the key."""
    client = configured(TRANSACTIONAL=True)
    key = _key()
    assert _post(client, key, extra={"X-Status": "503"}).status_code == 503
    assert _charges(key) == 0
    assert _state(key) == "released"


def test_missing_table_answers_503_and_runs_nothing(client: Any, caplog: Any) -> None:
    """Without retrysafe's tables (migration not applied) a protected request gets 503
    store-unavailable, the view does not run, and the log says to migrate."""
    from django.db import connection

    key = _key()
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE idempotency_keys RENAME TO idempotency_keys_away")
    try:
        answer = _post(client, key)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE idempotency_keys_away RENAME TO idempotency_keys")
    assert answer.status_code == 503
    assert answer.json()["type"].endswith("store-unavailable")
    assert _charges(key) == 0
    errors = [str(getattr(r, "error", "")) for r in caplog.records]
    assert any("manage.py migrate retrysafe" in e for e in errors), errors


def test_client_leaving_mid_stream_still_records_the_whole_answer(client: Any) -> None:
    """The server stops reading a streaming answer after one chunk (the client left): the
    rest is drained and recorded, and the retry gets the whole answer replayed."""
    key = _key()
    first = _post(client, key, path="/stream")
    chunks = iter(first.streaming_content)
    assert next(chunks).startswith(b"part 0")
    first.close()  # what the server does when the client goes away
    assert _state(key) == "completed"
    replay = _post(client, key, path="/stream")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content.count(b"part") == 3
    assert _charges(key) == 1


def test_async_streaming_answer_is_recorded_and_replayed() -> None:
    """An async StreamingHttpResponse under ASGI is recorded at its end and replayed."""
    import asyncio

    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    key = _key()

    async def twice() -> tuple[bytes, Any]:
        client = AsyncClient()
        headers = {"Idempotency-Key": key}
        first: Any = await client.post(
            "/astream", data="{}", content_type="application/json", headers=headers
        )
        body = b"".join([chunk async for chunk in first.streaming_content])
        second = await client.post(
            "/astream", data="{}", content_type="application/json", headers=headers
        )
        return body, second

    body, second = asyncio.run(twice())
    assert body.count(b"async part") == 3
    assert second.headers["Idempotent-Replayed"] == "true" and second.content == body
    assert asyncio.run(sync_to_async(_charges)(key)) == 1


def test_store_failing_after_the_effect_answers_503_then_records_in_the_background(
    client: Any,
) -> None:
    """The store is locked for 2 s right after the view's effect: the client gets 503
    store-unavailable (not the unrecorded answer); once the store is back the answer is
    recorded in the background and the retry gets it replayed; one effect (record before
    answer, SPEC §3)."""
    import time

    key = _key()
    answer = _post(client, key, extra={"X-Lock-Store": "2"})
    assert answer.status_code == 503
    assert answer.json()["type"].endswith("store-unavailable")
    # the view ran: the answer must not say "nothing was run" (a new key would duplicate)
    assert "was handled" in answer.json()["detail"]
    assert "Nothing was run" not in answer.json()["detail"]
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(StoreUnavailableError):  # locked meanwhile
            if _state(key) == "completed":
                break
        assert time.monotonic() < deadline, "the answer was never recorded"
        time.sleep(0.1)
    replay = _post(client, key)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert _charges(key) == 1


def test_two_key_headers_under_asgi_are_400_invalid_key() -> None:
    """Two Idempotency-Key headers (Django would join them as "K,K"): 400 invalid-key, as the
    ASGI middleware answers; nothing runs."""
    import asyncio

    from asgiref.sync import sync_to_async
    from django.core.handlers.asgi import ASGIHandler

    key = _key()
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/charge", "raw_path": b"/charge", "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"2"),
            (b"idempotency-key", key.encode()), (b"idempotency-key", key.encode()),
        ],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> Any:
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)

    async def send(message: Mapping[str, Any]) -> None:
        sent.append(dict(message))

    asyncio.run(ASGIHandler()(scope, receive, send))
    assert sent[0]["status"] == 400
    assert b"more than one Idempotency-Key header" in sent[1]["body"]
    assert asyncio.run(sync_to_async(_charges)(key)) == 0


def test_a_csrf_refusal_is_not_stored_so_the_retry_with_the_token_runs() -> None:
    """Django's CSRF check refuses inside the middleware chain (403, the view never ran):
    the key is released, not stored, so the retry with a valid token runs the view once
    (a view's own 403 is still stored)."""
    from django.middleware.csrf import _get_new_csrf_string
    from django.test import Client, override_settings

    chain = ["django.middleware.csrf.CsrfViewMiddleware", "retrysafe.django.IdempotencyMiddleware"]
    key = _key()
    with override_settings(MIDDLEWARE=chain, RETRYSAFE={"STORE": "django"}):
        client = Client(enforce_csrf_checks=True)
        refused = _post(client, key, path="/checked-charge")
        assert refused.status_code == 403 and _state(key) == "released"
        token = _get_new_csrf_string()
        client.cookies["csrftoken"] = token
        ran = _post(client, key, path="/checked-charge", extra={"X-CSRFToken": token})
        assert ran.status_code == 201 and "Idempotent-Replayed" not in ran.headers
        again = _post(client, key, path="/checked-charge", extra={"X-CSRFToken": token})
        assert again.headers["Idempotent-Replayed"] == "true"
        own = _key()  # a view's own 403 (no CSRF involved: the view is csrf_exempt)
        assert _post(client, own, extra={"X-Status": "403"}).status_code == 403
        assert _state(own) == "completed"
    assert _charges(key) == 1
