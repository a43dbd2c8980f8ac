"""``answer_early``: the client gets an answer now while the handler still works, and the
handler's own answer is recorded for the retry of the same key (over real sockets: an ASGI
test transport waits for the app to return before it shows any answer)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread
from retrysafe.server import IdempotencyMiddleware, answer_early
from retrysafe.stores import SQLiteStore

ACCEPTED = (202, [(b"content-type", b"application/json")], b'{"status":"accepted"}')


def _app(effects: Counter[str], early: list[float | None]) -> Starlette:
    async def report(request: Request) -> Response:  # a slow AI call: accepted, then done
        effects["report"] += 1
        early.append(await answer_early(request.scope, *ACCEPTED))
        early.append(await answer_early(request.scope, *ACCEPTED))  # once only
        await asyncio.sleep(0.5)
        return JSONResponse({"report": effects["report"]}, status_code=201)

    return Starlette(routes=[Route("/report", report, methods=["POST"])])


def _started(effects: Counter[str], early: list[float | None]) -> Any:
    async def started(scope: Any, receive: Any, send: Any) -> None:
        effects["started"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part ", "more_body": True})
        early.append(await answer_early(scope, *ACCEPTED))
        await send({"type": "http.response.body", "body": b"and the rest"})

    return started


def _until_not_409(url: str, headers: dict[str, str], within: float = 15.0) -> httpx.Response:
    end = time.monotonic() + within
    while True:
        answer = httpx.post(url, headers=headers)
        if answer.status_code != 409 or time.monotonic() > end:
            return answer
        time.sleep(0.05)


def test_the_early_answer_goes_now_and_the_handlers_is_replayed(tmp_path: Path) -> None:
    """202 at once; a retry meanwhile gets 409; once the handler returned, the retry gets
    its 201, replayed; the handler ran once. A second early answer is refused (None)."""
    effects: Counter[str] = Counter()
    early: list[float | None] = []
    store = SQLiteStore(tmp_path / "k.db")
    app = IdempotencyMiddleware(_app(effects, early), store=store, lease=30, max_run_time=60)
    headers = {"Idempotency-Key": "report-1"}
    with ServerThread(app) as srv:
        start = time.monotonic()
        first = httpx.post(srv.url + "/report", headers=headers)
        assert time.monotonic() - start < 0.45  # before the handler's 0.5 s
        assert (first.status_code, first.json()) == (202, {"status": "accepted"})
        assert httpx.post(srv.url + "/report", headers=headers).status_code == 409
        replay = _until_not_409(srv.url + "/report", headers)
    assert (replay.status_code, replay.json()) == (201, {"report": 1})
    assert replay.headers["idempotent-replayed"] == "true"
    assert effects["report"] == 1
    left, again = early
    assert left is not None and 55 < left <= 60  # max_run_time from the claim
    assert again is None
    store.close()


def test_no_early_answer_once_part_of_the_answer_left(tmp_path: Path) -> None:
    """After the first bytes of the handler's answer left, an early answer is refused: the
    client gets the handler's answer whole, and it is replayed."""
    effects: Counter[str] = Counter()
    early: list[float | None] = []
    store = SQLiteStore(tmp_path / "s.db")
    app = IdempotencyMiddleware(_started(effects, early), store=store)
    headers = {"Idempotency-Key": "started-1"}
    with ServerThread(app) as srv:
        first = httpx.post(srv.url + "/started", headers=headers)
        again = httpx.post(srv.url + "/started", headers=headers)
    assert (first.status_code, first.content) == (200, b"part and the rest")
    assert (again.status_code, again.content) == (200, b"part and the rest")
    assert early == [None]
    assert effects["started"] == 1
    store.close()


def test_without_the_middleware_nothing_is_sent() -> None:
    """A plain scope (no middleware, or a request without a key): None, nothing sent."""
    scope: dict[str, Any] = {"type": "http"}
    assert asyncio.run(answer_early(scope, *ACCEPTED)) is None
    assert scope == {"type": "http"}


def test_no_early_answer_past_max_run_time(tmp_path: Path) -> None:
    """Once the claim is no longer renewed, no answer could be recorded: refused (None)."""
    effects: Counter[str] = Counter()
    early: list[float | None] = []
    max_run_time = 1.0

    async def late(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(max_run_time + 0.2)
        early.append(await answer_early(scope, *ACCEPTED))
        effects["late"] += 1
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    store = SQLiteStore(tmp_path / "m.db")
    app = IdempotencyMiddleware(late, store=store, lease=0.8, max_run_time=max_run_time)
    with ServerThread(app) as srv:
        answer = httpx.post(srv.url + "/late", headers={"Idempotency-Key": "late-1"})
    assert answer.status_code == 201
    assert early == [None]
    store.close()


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (99, [], b""),
        (600, [], b""),
        (True, [], b""),
        ("202", [], b""),
        (202, [("content-type", "text/plain")], b""),
        (202, [(b"x",)], b""),
        (202, [], "accepted"),
        (204, [], b"a body"),
        (304, [], b"a body"),
        (202, None, b""),
        (202, b"content-type", b""),
        (202, "content-type", b""),
    ],
)
def test_an_answer_no_server_could_send_is_refused(status: Any, headers: Any, body: Any) -> None:
    """A status outside 200-599, headers that are no byte-string pairs, a body that is no
    bytes: ValueError or TypeError before anything is sent, with or without the middleware."""
    with pytest.raises((TypeError, ValueError)):
        asyncio.run(answer_early({"type": "http"}, status, headers, body))


#: Answers no server could send faithfully: refused by the middleware's own checks.
UNSENDABLE = [
    [(b"content-length", b"100")],  # not the body's length: the client would hang
    [(b"content-length", b"1")],
    [(b"x-note", b"one\r\nSet-Cookie: evil=1")],  # response splitting
    [(b"bad name", b"x")],
]


def test_the_middleware_refuses_what_no_server_could_send(tmp_path: Path) -> None:
    """A Content-Length that is not the body's, CR LF in a value, a name that is no token:
    ValueError in the handler, nothing sent; the handler's own answer then goes as usual.
    Headers given as a generator are read once and sent."""
    refused: list[str] = []

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        for headers in UNSENDABLE:
            try:
                await answer_early(scope, 202, headers, b"abc")
            except ValueError as exc:
                refused.append(str(exc))
        pairs = ((name, value) for name, value in [(b"x-early", b"yes")])
        await answer_early(scope, 202, pairs, b"accepted")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    store = SQLiteStore(tmp_path / "v.db")
    app = IdempotencyMiddleware(handler, store=store)
    headers = {"Idempotency-Key": "refused-1"}
    with ServerThread(app) as srv:
        first = httpx.post(srv.url + "/x", headers=headers, timeout=5)
        replay = _until_not_409(srv.url + "/x", headers)
    assert (first.status_code, first.content, first.headers["x-early"]) == (202, b"accepted", "yes")
    assert len(refused) == len(UNSENDABLE)
    assert all(r.startswith("early answer refused, nothing sent") for r in refused)
    assert (replay.status_code, replay.content) == (201, b"done")
    store.close()

