"""Harness for the middleware tests: one app, three frameworks, real HTTP on loopback.

Every behaviour test takes the ``serve`` fixture, parametrized over a Starlette app and a
FastAPI app (ASGI, under uvicorn via :class:`retrysafe._serving.ServerThread`) and a Flask app
(WSGI, under werkzeug's threaded server). All three expose the same routes and count the
effects their handlers perform, so a test can assert how often a handler really ran.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from retrysafe.core import PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_PREFIX, KeyRecord
from retrysafe.server import IdempotencyConfig, IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import SQLiteStore

FRAMEWORKS = ["starlette", "fastapi", "flask"]
HOLD = {"X-Hold": "1"}  # makes /slow wait for Effects.gate (not part of the fingerprint)


class FakeClock:
    """An injectable clock (Unix seconds) that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@dataclass
class Effects:
    """What the handlers did: counts per route, and a gate that holds ``/slow``."""

    counts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def record(self, name: str) -> int:
        with self.lock:
            self.counts[name] += 1
            return self.counts[name]

    def hold(self, headers: Any) -> None:
        self.entered.set()
        if headers.get("x-hold"):
            assert self.gate.wait(10), "test never opened the gate"


BIG = b"x" * 5000
STREAM_CHUNKS = 4  # /stream: the effect first, then this many chunks ...
STREAM_PAUSE = 0.15  # ... each after this many seconds


def stream_chunk(n: int, i: int) -> bytes:
    """Chunk ``i`` of the /stream answer of effect ``n``: 1 KiB, so it leaves at once."""
    return f"effect {n} chunk {i}\n".encode().ljust(1024, b".")


async def stream_chunks(n: int) -> AsyncIterator[bytes]:
    import asyncio

    for i in range(STREAM_CHUNKS):
        await asyncio.sleep(STREAM_PAUSE)
        yield stream_chunk(n, i)


def stream_body(n: int) -> bytes:
    """The whole /stream answer of effect ``n``."""
    return b"".join(stream_chunk(n, i) for i in range(STREAM_CHUNKS))


def _post_headers(n: int) -> dict[str, str]:
    return {
        "Location": f"/posts/{n}",
        "ETag": f'"v{n}"',
        "Cache-Control": "no-store",
        "Set-Cookie": f"session=s{n}",
        "X-Custom": f"c{n}",
    }


def _post_body(n: int, body: bytes) -> bytes:
    return json.dumps({"n": n, "body_len": len(body)}).encode()


# ----------------------------------------------------------------------------- apps
def starlette_app(effects: Effects, middleware: list[Any]) -> Any:
    """The test routes as a Starlette app."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def posts(request: Request) -> Response:
        body = await request.body()
        n = effects.record("posts")
        return Response(
            _post_body(n, body), 201, _post_headers(n), media_type="application/json"
        )

    async def read_posts(request: Request) -> Response:
        return JSONResponse({"n": effects.record("get")})

    async def empty(request: Request) -> Response:
        effects.record("empty")
        return Response(status_code=204)

    async def null(request: Request) -> Response:
        effects.record("null")
        return JSONResponse(None)

    async def boom(request: Request) -> Response:
        effects.record("boom")
        raise RuntimeError("handler failed")

    async def status(request: Request) -> Response:
        code = int(request.path_params["code"])
        n = effects.record(f"status{code}")
        return JSONResponse({"n": n}, status_code=code)

    async def big(request: Request) -> Response:
        effects.record("big")
        return Response(BIG, media_type="application/octet-stream")

    async def binary(request: Request) -> Response:
        body = await request.body()
        effects.record("binary")
        return Response(body[::-1], media_type="application/octet-stream")

    def slow(request: Request) -> Response:  # sync: runs in the threadpool
        effects.hold(request.headers)
        n = effects.record("slow")
        return JSONResponse({"n": n}, status_code=201)

    def late(request: Request) -> Response:  # the effect first, then a held answer
        n = effects.record("late")
        effects.hold(request.headers)
        return JSONResponse({"n": n}, status_code=201)

    async def stream(request: Request) -> Response:
        from starlette.responses import StreamingResponse

        n = effects.record("stream")
        return StreamingResponse(stream_chunks(n), status_code=201, media_type="text/plain")

    routes = [
        Route("/posts", posts, methods=["POST", "PATCH"]),
        Route("/posts", read_posts, methods=["GET"]),
        Route("/other", posts, methods=["POST"]),
        Route("/empty", empty, methods=["POST"]),
        Route("/null", null, methods=["POST"]),
        Route("/boom", boom, methods=["POST"]),
        Route("/status/{code:int}", status, methods=["POST"]),
        Route("/big", big, methods=["POST"]),
        Route("/binary", binary, methods=["POST"]),
        Route("/slow", slow, methods=["POST"]),
        Route("/late", late, methods=["POST"]),
        Route("/stream", stream, methods=["POST"]),
    ]
    return Starlette(routes=routes, middleware=middleware)


def fastapi_app(effects: Effects) -> Any:
    """The test routes as FastAPI path operations."""
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    @app.post("/posts", status_code=201)
    @app.patch("/posts", status_code=201)
    @app.post("/other", status_code=201)
    async def posts(request: FastAPIRequest) -> Response:
        body = await request.body()
        n = effects.record("posts")
        return Response(
            _post_body(n, body), 201, _post_headers(n), media_type="application/json"
        )

    @app.get("/posts")
    def read_posts() -> dict[str, int]:
        return {"n": effects.record("get")}

    @app.post("/empty", status_code=204, response_model=None)
    def empty() -> Response:
        effects.record("empty")
        return Response(status_code=204)

    @app.post("/null")
    def null() -> None:
        effects.record("null")
        return None

    @app.post("/boom")
    def boom() -> None:
        effects.record("boom")
        raise RuntimeError("handler failed")

    @app.post("/status/{code}")
    def status(code: int) -> JSONResponse:
        return JSONResponse({"n": effects.record(f"status{code}")}, status_code=code)

    @app.post("/big")
    def big() -> Response:
        effects.record("big")
        return Response(BIG, media_type="application/octet-stream")

    @app.post("/binary")
    async def binary(request: FastAPIRequest) -> Response:
        body = await request.body()
        effects.record("binary")
        return Response(body[::-1], media_type="application/octet-stream")

    @app.post("/slow", status_code=201)
    def slow(request: FastAPIRequest) -> dict[str, int]:
        effects.hold(request.headers)
        return {"n": effects.record("slow")}

    @app.post("/late", status_code=201)
    def late(request: FastAPIRequest) -> dict[str, int]:
        n = effects.record("late")
        effects.hold(request.headers)
        return {"n": n}

    @app.post("/stream")
    async def stream() -> Response:
        from fastapi.responses import StreamingResponse

        n = effects.record("stream")
        return StreamingResponse(stream_chunks(n), status_code=201, media_type="text/plain")

    return app


def flask_app(effects: Effects) -> Any:
    """The test routes as a Flask app."""
    from flask import Flask, Response, jsonify, request

    app = Flask("retrysafe-test")

    @app.route("/posts", methods=["POST", "PATCH"], endpoint="posts")
    @app.route("/other", methods=["POST"], endpoint="other")
    def posts() -> Response:
        body = request.get_data()
        n = effects.record("posts")
        return Response(
            _post_body(n, body), 201, _post_headers(n), content_type="application/json"
        )

    @app.get("/posts")
    def read_posts() -> Response:
        return jsonify(n=effects.record("get"))

    @app.post("/empty")
    def empty() -> tuple[str, int]:
        effects.record("empty")
        return "", 204

    @app.post("/null")
    def null() -> Response:
        effects.record("null")
        return Response("null", 200, content_type="application/json")

    @app.post("/boom")
    def boom() -> Response:
        effects.record("boom")
        raise RuntimeError("handler failed")

    @app.post("/status/<int:code>")
    def status(code: int) -> tuple[Response, int]:
        return jsonify(n=effects.record(f"status{code}")), code

    @app.post("/big")
    def big() -> Response:
        effects.record("big")
        return Response(BIG, 200, content_type="application/octet-stream")

    @app.post("/binary")
    def binary() -> Response:
        body = request.get_data()
        effects.record("binary")
        return Response(body[::-1], 200, content_type="application/octet-stream")

    @app.post("/slow")
    def slow() -> tuple[Response, int]:
        effects.hold(request.headers)
        return jsonify(n=effects.record("slow")), 201

    @app.post("/late")
    def late() -> tuple[Response, int]:
        n = effects.record("late")
        effects.hold(request.headers)
        return jsonify(n=n), 201

    @app.post("/stream")
    def stream() -> Response:
        n = effects.record("stream")

        def chunks() -> Iterator[bytes]:
            for i in range(STREAM_CHUNKS):
                time.sleep(STREAM_PAUSE)
                yield stream_chunk(n, i)

        return Response(chunks(), 201, content_type="text/plain")

    return app


# ----------------------------------------------------------------------------- servers
class _QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


def keyed_post(
    url: str, key: bytes, *, path: bytes = b"/x", rcvbuf: int | None = None
) -> socket.socket:
    """A socket to the server at ``url`` that has sent ``POST path`` with Idempotency-Key
    ``key`` and the body ``{}`` (``Connection: close``), its receive buffer ``rcvbuf`` bytes
    when given (a small one makes a slow reader's pauses reach the server at once)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: t\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}" % (path, key)
    )
    return sock


class WSGIServerThread:
    """werkzeug's threaded WSGI server on a loopback port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.server: BaseWSGIServer = make_server(
            "127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler
        )
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    def __enter__(self) -> WSGIServerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@dataclass
class Harness:
    """One running app behind the middleware."""

    framework: str
    url: str
    client: httpx.Client
    effects: Effects
    store: SQLiteStore
    clock: FakeClock
    middleware: Any

    def post(self, path: str, key: str | bytes | None = None, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers["Idempotency-Key"] = key
        return self.client.post(path, headers=headers, **kwargs)

    def request(
        self, method: str, path: str, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers["Idempotency-Key"] = key
        return self.client.request(method, path, headers=headers, **kwargs)


Serve = Callable[..., Harness]


def build_app(framework: str, effects: Effects, store: Any, config: IdempotencyConfig) -> Any:
    """The framework's app with the middleware installed the way its users would."""
    if framework == "flask":
        app = flask_app(effects)
        app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, store, config=config)
        return app
    if framework == "fastapi":
        app = fastapi_app(effects)
        app.add_middleware(IdempotencyMiddleware, store=store, config=config)
        return app
    from starlette.middleware import Middleware

    return starlette_app(
        effects, [Middleware(IdempotencyMiddleware, store=store, config=config)]
    )


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every millisecond until true (fails the test after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    """The response is an RFC 9457 problem of type ``urn:retrysafe:problem:<slug>``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_CONTENT_TYPE
    doc: dict[str, Any] = response.json()
    assert doc["type"] == PROBLEM_TYPE_PREFIX + slug
    assert doc["status"] == status
    assert doc["title"]
    assert doc["detail"]
    assert "Traceback" not in response.text
    return doc


def is_replay(response: httpx.Response) -> bool:
    """True when the middleware answered from the store."""
    return bool(response.headers.get("idempotent-replayed") == "true")


def records(store: SQLiteStore) -> list[KeyRecord]:
    """Every record in a SQLite store, expired or not."""
    rows = store.run(lambda c: c.execute("SELECT key_hash FROM idempotency_keys").fetchall())
    out = [store.get(row[0]) for row in rows]
    return [r for r in out if r is not None]

