"""Edges that need a hand-written app: streaming, disconnects, URL stores, lifespan."""

from __future__ import annotations

import io
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from retrysafe.core import KeyState
from retrysafe.server import IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import SQLiteStore

from .harness import is_replay, records

pytestmark = pytest.mark.anyio


class StreamingApp:
    """ASGI app that streams three chunks; ``finish=False`` stops before the last one."""

    def __init__(self, *, finish: bool = True) -> None:
        self.finish = finish
        self.runs = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.runs += 1
        message = await receive()
        assert message["body"] == b"payload"
        headers = [(b"content-type", b"text/plain"), (b"x-run", str(self.runs).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b", "more_body": True})
        if self.finish:
            await send({"type": "http.response.body", "body": b"c", "more_body": False})


async def test_streamed_asgi_response_is_forwarded_and_stored(tmp_path: Path) -> None:
    """Chunks pass through unchanged; the joined body is stored and replayed."""
    app = StreamingApp()
    mw = IdempotencyMiddleware(app, f"sqlite:///{tmp_path / 'keys.db'}")
    transport = httpx.ASGITransport(app=mw)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        headers = {"Idempotency-Key": "k1"}
        first = await client.post("/x", content=b"payload", headers=headers)
        second = await client.post("/x", content=b"payload", headers=headers)
    mw.close()
    assert first.content == second.content == b"abc"
    assert is_replay(second)
    assert app.runs == 1


async def test_incomplete_asgi_response_keeps_the_key_as_outcome_unknown(tmp_path: Path) -> None:
    """An app that stops after its response started, before its last chunk, keeps the key
    claimed as outcome-unknown (the effect may have happened, SPEC §4)."""
    store = SQLiteStore(tmp_path / "keys.db")
    app = StreamingApp(finish=False)
    mw = IdempotencyMiddleware(app, store)
    sent: list[MutableMapping[str, Any]] = []
    messages: list[MutableMapping[str, Any]] = [
        {"type": "http.request", "body": b"payload", "more_body": False}
    ]

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k1")],
    }
    await mw(scope, receive, send)
    assert [m.get("body") for m in sent[1:]] == [b"a", b"b"]
    [record] = records(store)
    assert record.state is KeyState.RUNNING
    store.close()


async def test_client_disconnect_while_sending_the_body_claims_nothing(tmp_path: Path) -> None:
    """A client that disconnects before its body arrived leaves no key behind."""
    store = SQLiteStore(tmp_path / "keys.db")
    app = StreamingApp()
    mw = IdempotencyMiddleware(app, store)
    messages: list[MutableMapping[str, Any]] = [
        {"type": "http.request", "body": b"pay", "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:  # pragma: no cover
        raise AssertionError(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k1")],
    }
    await mw(scope, receive, send)
    assert app.runs == 0
    assert records(store) == []
    store.close()


async def test_lifespan_passes_through(tmp_path: Path) -> None:
    """Non-HTTP scopes reach the app untouched."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    mw = IdempotencyMiddleware(app, SQLiteStore(tmp_path / "keys.db"))

    async def nothing() -> dict[str, Any]:  # pragma: no cover
        return {}

    async def drop(message: Any) -> None:  # pragma: no cover
        pass

    await mw({"type": "lifespan"}, nothing, drop)
    assert seen == ["lifespan"]


def _environ(body: bytes = b"payload") -> dict[str, Any]:
    return {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/x",
        "QUERY_STRING": "",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_IDEMPOTENCY_KEY": "k1",
        "wsgi.input": io.BytesIO(body),
    }


class ClosingIterable:
    """A WSGI body that records whether the server closed it."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    def __iter__(self) -> Any:
        return iter(self.chunks)

    def close(self) -> None:
        self.closed = True


def test_wsgi_abandoned_iteration_is_drained_recorded_and_closed(tmp_path: Path) -> None:
    """A WSGI server that stops iterating (client gone): the rest of the answer is captured
    and the key completed with all of it; the app's iterable is closed (SPEC §3)."""
    store = SQLiteStore(tmp_path / "keys.db")
    body = ClosingIterable([b"a", b"b", b"c"])

    def app(environ: Any, start_response: Any) -> ClosingIterable:
        start_response("201 Created", [("Content-Type", "text/plain")])
        return body

    mw = WSGIIdempotencyMiddleware(app, store)
    result: Any = mw(_environ(), lambda status, headers, exc_info=None: len)
    iterator = iter(result)
    assert next(iterator) == b"a"
    result.close()
    assert body.closed
    [record] = records(store)
    assert record.state is KeyState.COMPLETED
    assert record.response is not None
    assert record.response.body == b"abc"
    store.close()


def test_wsgi_write_callable_is_captured(tmp_path: Path) -> None:
    """Bytes sent through the legacy ``write()`` callable are part of the stored body."""
    store = SQLiteStore(tmp_path / "keys.db")
    runs = []
    written: list[bytes] = []

    def app(environ: Any, start_response: Any) -> list[bytes]:
        runs.append(1)
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"head-")
        return [b"tail"]

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        return written.append

    mw = WSGIIdempotencyMiddleware(app, store)
    written.extend(mw(_environ(), start_response))
    assert b"".join(written) == b"head-tail"
    replay = b"".join(mw(_environ(), start_response))
    assert replay == b"head-tail"
    assert runs == [1]
    store.close()


async def test_outer_middleware_mutating_headers_does_not_leak(tmp_path: Path) -> None:
    """An outer middleware appending to a problem answer's headers never changes the next one."""
    store = SQLiteStore(tmp_path / "keys.db")
    mw = IdempotencyMiddleware(StreamingApp(), store, key_required=True)

    async def outer(scope: Any, receive: Any, send: Any) -> None:
        async def tagging_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"].append((b"x-outer", b"1"))
            await send(message)

        await mw(scope, receive, tagging_send)

    transport = httpx.ASGITransport(app=outer)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(3):
            r = await client.post("/x", content=b"payload")
            assert r.status_code == 400
            assert r.headers.get_list("x-outer") == ["1"]
    store.close()
