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


_INVALID_ANSWERS = {
    "status 999": (999, [(b"content-type", b"text/plain")], b"done"),
    "status 101": (101, [], b""),  # informational: never the answer (it was stored)
    "status 199": (199, [], b""),
    "status as text": ("201", [], b"done"),
    "response splitting": (201, [(b"content-type", b"text/plain\r\nX-Injected: 1")], b"done"),
    "a NUL in a value": (201, [(b"x-note", b"a\x00b")], b"done"),
    "a space in a name": (201, [(b"x note", b"a")], b"done"),
    "a body longer than its length": (201, [(b"content-length", b"5")], b"0123456789"),
    "a body shorter than its length": (201, [(b"content-length", b"50")], b"0123456789"),
    "two lengths": (201, [(b"content-length", b"4"), (b"content-length", b"5")], b"done"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(_INVALID_ANSWERS))
async def test_an_answer_no_server_can_send_keeps_the_key_claimed(
    tmp_path: Path, case: str
) -> None:
    """A fresh user's check: an app whose answer is no valid HTTP response ran again on
    every retry (status 999: a 5xx to the middleware, so the key was released, while uvicorn
    failed the answer with a KeyError: three requests, three effects), or its broken answer
    was stored and every replay failed the same way for the whole retention (a CR LF in a
    header: an empty reply each time), or a replay was whole where the first answer was
    cut (a body longer than its Content-Length). Now the client gets 500 ``invalid-answer``
    and the key stays claimed as outcome-unknown: the retry gets 409, the effect ran once."""
    import json

    status, headers, body = _INVALID_ANSWERS[case]
    effects: list[int] = []

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        effects.append(1)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    store = SQLiteStore(tmp_path / "a.db")
    app_ = IdempotencyMiddleware(app, store=store)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app_), base_url="http://t"
    ) as client:
        key = {"Idempotency-Key": "bad-answer-1"}
        first = await client.post("/x", json={}, headers=key)
        assert first.status_code == 500, (first.status_code, first.headers, first.content)
        problem = json.loads(first.content)
        assert problem["type"] == "urn:retrysafe:problem:invalid-answer"
        again = await client.post("/x", json={}, headers=key)
        assert again.status_code == 409
    assert effects == [1]
    store.close()


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        ("201 Created", [("Content-Type", "text/plain\r\nX-Injected: 1")]),
        ("abc", []),  # no code: the middleware's start_response raised, the key was released
        ("200 OK\r\nX-Injected: 1", []),  # CR LF in the reason: stored, gunicorn 500'd
        ("199 Early", []),
        ("20 Short", []),
    ],
    ids=["crlf-header", "no-code", "crlf-reason", "informational", "two-digits"],
)
def test_a_wsgi_answer_no_server_can_send_keeps_the_key_claimed(
    tmp_path: Path, status: str, headers: list[tuple[str, str]]
) -> None:
    """WSGI, the same rule (the engine's), and its status line: three digits, a space, a
    reason without CR or LF (a fresh user's check: "abc" ran the handler on every retry, a
    reason with CR LF was stored)."""
    effects: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        effects.append(1)
        start_response(status, headers)
        return [b"done"]

    store = SQLiteStore(tmp_path / "w.db")
    wrapped = WSGIIdempotencyMiddleware(app, store=store)
    with httpx.Client(transport=httpx.WSGITransport(app=wrapped), base_url="http://t") as client:
        key = {"Idempotency-Key": "bad-answer-2"}
        first = client.post("/x", json={}, headers=key)
        assert first.status_code == 500
        assert first.json()["type"] == "urn:retrysafe:problem:invalid-answer"
        assert client.post("/x", json={}, headers=key).status_code == 409
    assert effects == [1]  # the store stays open: the claim is renewed (outcome unknown)


@pytest.mark.anyio
async def test_a_head_answer_keeps_its_content_length_and_is_stored(tmp_path: Path) -> None:
    """What the rule leaves alone: HEAD answers (no body, the GET's length), 204 and 304."""

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]}
        )
        await send({"type": "http.response.body", "body": b""})

    store = SQLiteStore(tmp_path / "h.db")
    config_app = IdempotencyMiddleware(app, store=store, protected_methods={"HEAD"})
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=config_app), base_url="http://t"
    ) as client:
        key = {"Idempotency-Key": "head-1"}
        first = await client.head("/x", headers=key)
        assert (first.status_code, first.headers["content-length"]) == (200, "9")
        again = await client.head("/x", headers=key)
        assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
        assert again.headers["content-length"] == "9"  # the GET's length, as answered
        assert again.headers.get_list("content-length") == ["9"]
    store.close()


@pytest.mark.anyio
async def test_an_app_returning_after_its_head_alone_says_so_and_keeps_the_key(
    tmp_path: Path,
) -> None:
    """An app that started its answer and returned without its body: the middleware held the
    head (it leaves with the body), so none of it reached the server, which answered its
    bare 500. The key stays claimed as outcome-unknown (the app may have acted), and the
    client is now told so: 500 ``invalid-answer``, then 409 for the retry."""
    effects: list[int] = []

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        effects.append(1)
        await send({"type": "http.response.start", "status": 201, "headers": []})

    store = SQLiteStore(tmp_path / "a.db")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=IdempotencyMiddleware(app, store=store)),
        base_url="http://t",
    ) as client:
        key = {"Idempotency-Key": "head-alone"}
        first = await client.post("/x", json={}, headers=key)
        assert first.status_code == 500
        assert first.json()["type"] == "urn:retrysafe:problem:invalid-answer"
        assert (await client.post("/x", json={}, headers=key)).status_code == 409
    assert effects == [1]
    store.close()
