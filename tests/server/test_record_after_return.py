"""SPEC §3 "record before answer", as the ASGI middleware schedules it: the answer is recorded
once the app has returned (so the app's frames are gone before the store round trip), or
meanwhile when the app goes on after its answer — never holding the answer back for the app's
own later work, never letting it out before its record, and leaving no garbage behind."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from _garbage import cycles_left
from retrysafe import ConfigurationError
from retrysafe._serving import ServerThread
from retrysafe.core import KeyState, key_hash
from retrysafe.server import IdempotencyMiddleware, transaction
from retrysafe.stores import MemoryStore, SQLiteStore

AFTER = 1.0  # seconds of work the apps below do after their answer


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "keys.db")
    yield store
    store.close()


def _serve(app: Any) -> ServerThread:
    return ServerThread(app)


def test_an_answer_is_not_held_back_by_work_the_app_does_after_it(store: SQLiteStore) -> None:
    """A handler with a background task (Starlette's, run after the response): the client
    gets the answer as soon as it is recorded, not after the background work; a retry then
    replays it."""
    finished = threading.Event()

    async def later() -> None:
        await asyncio.sleep(AFTER)
        finished.set()

    async def create(request: Request) -> JSONResponse:
        return JSONResponse({"id": 1}, 201, background=BackgroundTask(later))

    app = IdempotencyMiddleware(Starlette(routes=[Route("/p", create, methods=["POST"])]), store)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    with _serve(app) as server, httpx.Client(base_url=server.url, timeout=10) as client:
        started = time.monotonic()
        first = client.post("/p", json={}, headers=key)
        took = time.monotonic() - started
        assert first.status_code == 201 and took < AFTER * 0.8
        record = store.get(key_hash("", key["Idempotency-Key"]))
        assert record is not None and record.state is KeyState.COMPLETED  # recorded first
        assert finished.wait(5)
        again = client.post("/p", json={}, headers=key)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


def test_an_app_that_raises_after_its_answer_has_it_recorded_and_sent(
    store: SQLiteStore,
) -> None:
    """An ASGI app that sends its whole answer and then raises: the answer goes out and is
    recorded (the effect happened once); the retry replays it."""
    runs = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(1)
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"made"})
        raise RuntimeError("after the answer")

    key = {"Idempotency-Key": str(uuid.uuid4())}
    with _serve(IdempotencyMiddleware(app, store)) as server:
        # uvicorn closes a connection whose app raised: one client per request.
        with httpx.Client(base_url=server.url, timeout=10) as client:
            first = client.post("/x", content=b"a", headers=key)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            again = client.post("/x", content=b"a", headers=key)
    assert first.status_code == 201 and first.content == b"made"
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert runs == [1]


def test_transaction_after_the_answer_ended_is_refused(store: SQLiteStore) -> None:
    """``transaction()`` called once the answer is complete raises ConfigurationError (the
    key is being completed; there is no transaction left to join)."""
    seen: list[BaseException] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        try:
            with transaction(scope):
                pass
        except ConfigurationError as exc:
            seen.append(exc)

    key = {"Idempotency-Key": str(uuid.uuid4())}
    server = _serve(IdempotencyMiddleware(app, store))
    with server, httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/x", content=b"a", headers=key).status_code == 200
    assert len(seen) == 1 and "after the response ended" in str(seen[0])


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_finished_requests_leave_nothing_for_the_garbage_collector(
    kind: str, tmp_path: Path
) -> None:
    """A protected request that ran, was recorded and answered leaves no reference cycle
    behind: its objects are freed at once, not by the garbage collector (which would cost
    every request its share of a collection)."""
    store: Any = MemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "gc.db")

    async def create(request: Request) -> JSONResponse:
        return JSONResponse(await request.json(), 201)

    app = IdempotencyMiddleware(Starlette(routes=[Route("/p", create, methods=["POST"])]), store)

    async def one(i: int) -> None:
        body = b'{"n": %d}' % i
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/p", "raw_path": b"/p",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"idempotency-key", f"gc-{i}".encode())],
        }  # fmt: skip
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Any:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            pass

        await app(scope, receive, send)

    await asyncio.gather(*(one(i) for i in range(20)))  # warm up (imports, connections)
    # Only retrysafe's own objects count: other tests' threads in this worker process (a
    # server, a heartbeat, a framework's connection) may leave cycles of their own meanwhile.
    try:
        with cycles_left() as garbage:
            await asyncio.gather(*(one(i) for i in range(20, 220)))
        ours = sorted(
            {type(o).__qualname__ for o in garbage if type(o).__module__.startswith("retrysafe")}
        )
        assert ours == []
    finally:
        if kind == "sqlite":
            await app.store.aclose()  # type: ignore[attr-defined]
            store.close()


@pytest.mark.anyio
async def test_a_stop_while_the_answer_is_recorded_is_logged_for_its_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server cancels a request (its shutdown grace ran out) while its answer is being
    recorded (the store hangs): one ``outcome-unknown`` line names the key, so an operator
    can tell which effects happened (helper-54: none did)."""
    store = MemoryStore()
    app = IdempotencyMiddleware(_plain, store=store)
    recording = asyncio.Event()

    async def hang(*args: Any, **kwargs: Any) -> Any:
        recording.set()
        await asyncio.sleep(3600)

    app.store.complete = hang  # type: ignore[method-assign]
    scope = {
        "type": "http", "method": "POST", "path": "/x", "raw_path": b"/x", "query_string": b"",
        "headers": [(b"idempotency-key", b"stop-1")], "client": ("127.0.0.1", 1),
        "scheme": "http", "http_version": "1.1", "server": ("127.0.0.1", 80),
    }  # fmt: skip
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    caplog.set_level("WARNING", logger="retrysafe")
    call = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.wait_for(recording.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    lines = [r for r in caplog.records if getattr(r, "decision", None) == "outcome-unknown"]
    assert len(lines) == 1
    assert getattr(lines[0], "key_hash", "")
    assert "stopped while the answer was being recorded" in lines[0].getMessage() + str(
        getattr(lines[0], "error", "")
    )
    store.close()


async def _plain(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})
