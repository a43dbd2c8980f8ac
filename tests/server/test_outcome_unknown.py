"""An app that cannot tell whether its effect happened keeps the key claimed (SPEC §0)."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from retrysafe.server import IdempotencyMiddleware, WSGIIdempotencyMiddleware, mark_outcome_unknown
from retrysafe.stores import SQLiteStore


async def _asgi_app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    mark_outcome_unknown(scope)
    await send({"type": "http.response.start", "status": 504, "headers": []})
    await send({"type": "http.response.body", "body": b"lost track"})


def _wsgi_app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    mark_outcome_unknown(environ)
    start_response("504 Gateway Timeout", [("Content-Type", "text/plain")])
    return [b"lost track"]


@pytest.mark.anyio
async def test_asgi_unknown_outcome_is_neither_stored_nor_released(tmp_path: Path) -> None:
    """ASGI: after an 'unknown' 504 the key stays claimed, so a retry gets 409."""
    app = IdempotencyMiddleware(_asgi_app, store=SQLiteStore(tmp_path / "a.db"))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        headers = {"Idempotency-Key": "u-1"}
        assert (await client.post("/x", json={}, headers=headers)).status_code == 504
        assert (await client.post("/x", json={}, headers=headers)).status_code == 409


def test_wsgi_unknown_outcome_is_neither_stored_nor_released(tmp_path: Path) -> None:
    """WSGI: the same, through environ."""
    app = WSGIIdempotencyMiddleware(_wsgi_app, store=SQLiteStore(tmp_path / "w.db"))
    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://t") as client:
        headers = {"Idempotency-Key": "u-2"}
        assert client.post("/x", json={}, headers=headers).status_code == 504
        assert client.post("/x", json={}, headers=headers).status_code == 409


def test_without_the_middleware_marking_is_a_no_op() -> None:
    """mark_outcome_unknown on a plain scope does nothing and raises nothing."""
    scope: dict[str, Any] = {"type": "http"}
    mark_outcome_unknown(scope)
    assert scope == {"type": "http"}


@pytest.mark.anyio
async def test_a_request_the_server_cancels_is_told_server_stopped_and_keeps_its_key(
    tmp_path: Path,
) -> None:
    """The server cancels a request whose handler is still running (its shutdown grace ran
    out): the key stays claimed (the handler may have acted) and, since none of the answer
    had left, the client gets ``503 server-stopped`` saying to retry with the same key (it
    got the server's bare ``500 Internal Server Error``)."""
    import asyncio
    import json

    started = asyncio.Event()

    async def slow(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        started.set()
        await asyncio.Event().wait()  # an upstream call that never ends

    store = SQLiteStore(tmp_path / "a.db")
    app = IdempotencyMiddleware(slow, store=store)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/x", "raw_path": b"/x", "query_string": b"",
        "headers": [(b"idempotency-key", b"stop-1"), (b"content-type", b"application/json")],
    }  # fmt: skip
    task = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sent[0]["status"] == 503
    problem = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert problem["type"].endswith(":server-stopped") and "same key" in problem["detail"]
    assert any(k == b"retry-after" for k, _ in sent[0]["headers"])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t"
    ) as client:
        retry = await client.post("/x", json={}, headers={"Idempotency-Key": "stop-1"})
    assert retry.status_code == 409
    store.close()
