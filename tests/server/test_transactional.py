"""Transactional mode (SPEC §4): the handler's writes and the key's completion commit together.

Every test runs on SQLite and on PostgreSQL (a fresh schema per test; unreachable PostgreSQL
skips, or fails under ``CI=true``). Handlers write one row into ``effects`` through
:func:`retrysafe.server.transaction`; the tests count the committed rows from a separate
connection and read the key's row from ``idempotency_keys``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from retrysafe import ConfigurationError
from retrysafe.server import IdempotencyMiddleware, WSGIIdempotencyMiddleware, transaction
from retrysafe.stores import MemoryStore, SQLiteStore

from .harness import FakeClock

STORES = ["sqlite", "postgres"]
FRAMEWORKS = ["starlette", "flask"]


class DB:
    """One test database: the store, and direct access to the effect and key tables."""

    def __init__(self, kind: str, store: Any, url: str, schema: str = "") -> None:
        self.kind = kind
        self.store = store
        self.url = url
        self.schema = schema
        self.ph = "?" if kind == "sqlite" else "%s"
        self.exec("CREATE TABLE effects (note TEXT NOT NULL)")

    def exec(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.url, isolation_level=None, timeout=5)
            try:
                return conn.execute(statement, params).fetchall()
            finally:
                conn.close()
        import psycopg

        with psycopg.connect(
            self.url, autocommit=True, options=f"-c search_path={self.schema}"
        ) as pg:
            cur = cast(Any, pg).execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []

    def rows(self) -> list[str]:
        return [r[0] for r in self.exec("SELECT note FROM effects")]

    def key_rows(self) -> list[tuple[str, int]]:
        """``(state, fencing_token)`` of every key."""
        return [
            (str(s), int(t))
            for s, t in self.exec("SELECT state, fencing_token FROM idempotency_keys")
        ]


@pytest.fixture(params=STORES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DB]:
    store: Any
    if request.param == "sqlite":
        path = str(tmp_path / "app.db")
        store = SQLiteStore(path)
        yield DB("sqlite", store, path)
        store.close()
        return
    from retrysafe.stores import PostgresStore

    pg_url: str = request.getfixturevalue("pg_url")
    schema: str = request.getfixturevalue("pg_schema")
    store = PostgresStore(pg_url, schema=schema, clock="caller")
    yield DB("postgres", store, pg_url, schema)
    store.close()


def _insert(conn: Any, note: str) -> None:
    ph = "?" if isinstance(conn, sqlite3.Connection) else "%s"
    conn.execute(f"INSERT INTO effects (note) VALUES ({ph})", (note,))


# ----------------------------------------------------------------------------- apps
def _starlette(db: DB, clock: FakeClock) -> Any:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def write(request: Request) -> Response:  # sync: runs in the threadpool
        with transaction(request.scope) as conn:
            _insert(conn, request.query_params.get("note", "x"))
        mode = request.query_params.get("mode", "")
        if mode == "500":
            return JSONResponse({"error": "later"}, status_code=500)
        if mode == "raise":
            raise RuntimeError("handler failed after writing")
        return JSONResponse({"created": True}, status_code=201)

    middleware = [Middleware(IdempotencyMiddleware, store=db.store, clock=clock)]
    return Starlette(routes=[Route("/write", write, methods=["POST"])], middleware=middleware)


def _flask(db: DB, clock: FakeClock) -> Any:
    from flask import Flask, jsonify, request

    app = Flask(__name__)

    @app.post("/write")
    def write() -> Any:
        with transaction(request.environ) as conn:
            _insert(conn, request.args.get("note", "x"))
        mode = request.args.get("mode", "")
        if mode == "500":
            return jsonify(error="later"), 500
        if mode == "raise":
            raise RuntimeError("handler failed after writing")
        return jsonify(created=True), 201

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, store=db.store, clock=clock
    )
    return app


@pytest.fixture(params=FRAMEWORKS)
def client(request: pytest.FixtureRequest, db: DB) -> Iterator[httpx.Client]:
    """A sync client for the Starlette app (through a portal) or the Flask app."""
    clock = FakeClock()
    if request.param == "flask":
        transport: httpx.BaseTransport = httpx.WSGITransport(app=_flask(db, clock))
        with httpx.Client(transport=transport, base_url="http://t") as c:
            yield c
        return
    from starlette.testclient import TestClient

    with TestClient(_starlette(db, clock), raise_server_exceptions=False) as c:
        yield c


KEY = {"Idempotency-Key": "tx-1"}


# ----------------------------------------------------------------------------- 1-3
def test_effect_and_completion_commit_together(client: httpx.Client, db: DB) -> None:
    """A 201 commits the row and the completed key; a repeat replays and writes nothing."""
    first = client.post("/write", json={}, headers=KEY)
    assert first.status_code == 201
    assert db.rows() == ["x"]
    assert [s for s, _ in db.key_rows()] == ["completed"]
    again = client.post("/write", json={}, headers=KEY)
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert db.rows() == ["x"]


def test_server_error_rolls_the_effect_back(client: httpx.Client, db: DB) -> None:
    """A 500 rolls the row back and releases the key; the retry runs once more: one row."""
    assert client.post("/write?mode=500", json={}, headers=KEY).status_code == 500
    assert db.rows() == []
    assert [s for s, _ in db.key_rows()] == ["released"]
    assert client.post("/write", json={}, headers=KEY).status_code == 201
    assert db.rows() == ["x"]


def test_exception_rolls_the_effect_back(client: httpx.Client, db: DB) -> None:
    """A handler that raises after writing: the row is rolled back and the key released."""
    assert client.post("/write?mode=raise", json={}, headers=KEY).status_code == 500
    assert db.rows() == []
    assert [s for s, _ in db.key_rows()] == ["released"]


# ----------------------------------------------------------------------------- 4: crash
_CRASH_APP = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from werkzeug.serving import make_server
    from retrysafe.server import WSGIIdempotencyMiddleware, transaction

    kind, url, schema, marker, port_file = sys.argv[1:6]
    if kind == "sqlite":
        from retrysafe.stores import SQLiteStore
        store = SQLiteStore(url)
    else:
        from retrysafe.stores import PostgresStore
        store = PostgresStore(url, schema=schema, clock="caller")
    ph = "?" if kind == "sqlite" else "%s"

    def app(environ, start_response):
        with transaction(environ) as conn:
            conn.execute(f"INSERT INTO effects (note) VALUES ({ph})", ("crash",))
        Path(marker).write_text("written")
        time.sleep(60)  # killed here: written, not committed
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"never"]

    server = make_server("127.0.0.1", 0, WSGIIdempotencyMiddleware(app, store, lease=5))
    Path(port_file).write_text(str(server.server_port))
    server.serve_forever()
    """
)


def test_crash_before_commit_leaves_no_effect(db: DB, tmp_path: Path) -> None:
    """The process dies after the write, before the commit: no row; after the lease the
    retry runs the effect exactly once."""
    script = tmp_path / "crash_app.py"
    script.write_text(_CRASH_APP)
    marker, port_file = tmp_path / "written", tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, str(script), db.kind, db.url, db.schema, str(marker), str(port_file)]
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline, "crash app did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port_file.read_text()}/write"

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies mid-request
                httpx.post(url, json={}, headers=KEY, timeout=30)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        while not marker.exists():
            assert time.monotonic() < deadline, "handler never wrote"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert db.rows() == []
    assert [s for s, _ in db.key_rows()] == ["running"]

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with transaction(environ) as conn:
            _insert(conn, "retry")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    later = lambda: time.time() + 60  # noqa: E731 - the crashed owner's lease (5 s) is over
    middleware = WSGIIdempotencyMiddleware(app, db.store, lease=5, clock=later)
    with httpx.Client(transport=httpx.WSGITransport(app=middleware), base_url="http://t") as c:
        assert c.post("/write", json={}, headers=KEY).status_code == 201
        assert c.post("/write", json={}, headers=KEY).headers["idempotent-replayed"] == "true"
    assert db.rows() == ["retry"]
    assert db.key_rows() == [("completed", 2)]


# ----------------------------------------------------------------------------- 5: fencing
def test_lease_taken_over_rolls_the_effect_back(db: DB) -> None:
    """A handler whose lease was taken over: its row is rolled back, the new owner's record
    stays as it is."""
    clock = FakeClock()
    entered, gate = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        entered.set()
        assert gate.wait(10)
        with transaction(environ) as conn:
            _insert(conn, "stale")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"stale"]

    middleware = WSGIIdempotencyMiddleware(app, db.store, lease=5, clock=clock)
    result: list[int] = []

    def send() -> None:
        with httpx.Client(
            transport=httpx.WSGITransport(app=middleware), base_url="http://t"
        ) as c:
            result.append(c.post("/write", json={}, headers=KEY).status_code)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert entered.wait(10)
        ((key_hash, token),) = db.exec("SELECT key_hash, fencing_token FROM idempotency_keys")
        new = db.store.take_over(key_hash, token, now=clock() + 10, lease=30)
        assert new is not None
    finally:
        gate.set()
        sender.join(10)
    assert result == [409]  # not its record: its client is sent to retry (record before answer)
    assert db.rows() == []
    assert db.key_rows() == [("running", new.fencing_token)]


def _wsgi_client(app: Any, db: DB) -> httpx.Client:
    middleware = WSGIIdempotencyMiddleware(app, db.store)
    return httpx.Client(transport=httpx.WSGITransport(app=middleware), base_url="http://t")


def test_long_transaction_keeps_its_key_past_the_lease(db: DB) -> None:
    """A handler holding its transaction for twice its 1 s lease is renewed, never taken
    over: the retry meanwhile gets 409 or, once committed, the replay; one effect."""
    entered, gate = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with transaction(environ) as conn:
            _insert(conn, "once")
        entered.set()
        assert gate.wait(10)
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    middleware = WSGIIdempotencyMiddleware(app, db.store, lease=1)
    results: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        with httpx.Client(
            transport=httpx.WSGITransport(app=middleware), base_url="http://t", timeout=20
        ) as c:
            results[name] = c.post("/write", json={}, headers=KEY)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    retry = threading.Thread(target=send, args=("retry",))
    try:
        assert entered.wait(10)
        time.sleep(2.0)  # twice the lease
        retry.start()
        time.sleep(0.3)
    finally:
        gate.set()
        first.join(20)
        if retry.is_alive() or retry.ident is not None:
            retry.join(20)
    assert results["first"].status_code == 201
    late = results["retry"]
    assert late.status_code == 409 or late.headers.get("idempotent-replayed") == "true"
    assert db.rows() == ["once"]


def test_failed_transaction_block_rolls_back_even_on_success(db: DB) -> None:
    """A handler whose transaction() block raised, then answered 201 anyway: rolled back,
    key released."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with contextlib.suppress(ValueError), transaction(environ) as conn:
            _insert(conn, "half")
            raise ValueError("second write failed")
        start_response("201 Created", [])
        return [b"ok"]

    with _wsgi_client(app, db) as c:
        assert c.post("/write", json={}, headers=KEY).status_code == 201
    assert db.rows() == []
    assert [s for s, _ in db.key_rows()] == ["released"]


def test_unknown_outcome_rolls_back_and_keeps_the_claim(db: DB) -> None:
    """Outcome marked unknown: the row is rolled back and the key stays claimed (409)."""
    from retrysafe.server import mark_outcome_unknown

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with transaction(environ) as conn:
            _insert(conn, "maybe")
        mark_outcome_unknown(environ)
        start_response("504 Gateway Timeout", [])
        return [b"lost track"]

    with _wsgi_client(app, db) as c:
        assert c.post("/write", json={}, headers=KEY).status_code == 504
        assert c.post("/write", json={}, headers=KEY).status_code == 409
    assert db.rows() == []
    assert [s for s, _ in db.key_rows()] == ["running"]


def test_an_invalid_answer_rolls_back_and_releases_the_key(db: DB) -> None:
    """An answer that is no valid HTTP response (a header with CR LF) is neither sent nor
    stored: in transactional mode its effect is rolled back, so nothing happened and the
    key is released (500 invalid-answer; the retry runs again and writes the one row)."""
    headers = [[("Content-Type", "text/plain\r\nX-Injected: 1")], [("Content-Type", "text/plain")]]

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with transaction(environ) as conn:
            _insert(conn, "once")
        start_response("201 Created", headers.pop(0))
        return [b"ok"]

    with _wsgi_client(app, db) as c:
        first = c.post("/write", json={}, headers=KEY)
        assert first.status_code == 500
        assert first.json()["type"] == "urn:retrysafe:problem:invalid-answer"
        assert db.rows() == []
        assert [s for s, _ in db.key_rows()] == ["released"]
        assert c.post("/write", json={}, headers=KEY).status_code == 201
    assert db.rows() == ["once"]


# ----------------------------------------------------------------------------- 6: misuse
def test_outside_the_middleware_is_an_error() -> None:
    """transaction() on a scope the middleware never saw raises ConfigurationError."""
    with pytest.raises(ConfigurationError, match="Idempotency-Key"), transaction({}):
        pass


def _probe_app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    try:
        with transaction(environ):
            pass
    except ConfigurationError as exc:
        start_response("418 I'm a teapot", [("Content-Type", "text/plain")])
        return [str(exc).encode()]
    start_response("200 OK", [])
    return [b"opened"]


def test_unkeyed_request_is_an_error(db: DB) -> None:
    """A protected request without a key (key optional) holds no claim: clear error."""
    middleware = WSGIIdempotencyMiddleware(_probe_app, db.store)
    with httpx.Client(transport=httpx.WSGITransport(app=middleware), base_url="http://t") as c:
        answer = c.post("/write", json={})
    assert answer.status_code == 418
    assert "claimed" in answer.text


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_store_without_sql_is_an_error(kind: str, request: pytest.FixtureRequest) -> None:
    """Memory and Redis stores cannot hold the handler's writes: the error names the SQL
    stores."""
    if kind == "memory":
        store: Any = MemoryStore()
    else:
        from retrysafe.stores import RedisStore

        redis_url: str = request.getfixturevalue("redis_url")
        store = RedisStore(redis_url, prefix=request.getfixturevalue("redis_prefix"))
    try:
        middleware = WSGIIdempotencyMiddleware(_probe_app, store)
        with httpx.Client(
            transport=httpx.WSGITransport(app=middleware), base_url="http://t"
        ) as c:
            answer = c.post("/write", json={}, headers=KEY)
        assert answer.status_code == 418
        assert "SQLiteStore" in answer.text and "PostgresStore" in answer.text
    finally:
        store.close()


def test_asgi_store_without_sql_is_an_error() -> None:
    """The ASGI middleware gives the same clear error on a memory store."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            with transaction(scope):
                pass
        except ConfigurationError as exc:
            body = str(exc).encode()
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": body})

    from starlette.testclient import TestClient

    answer = TestClient(IdempotencyMiddleware(app, MemoryStore())).post(
        "/write", json={}, headers=KEY
    )
    assert answer.status_code == 418
    assert "PostgresStore" in answer.text


def test_asgi_commits_are_not_starved_by_handlers_waiting_for_the_lock(tmp_path: Path) -> None:
    """SQLite, ASGI, handlers that open their transaction with ``asyncio.to_thread``: more
    concurrent requests than the loop's default executor has threads. Each handler waits
    there for the write lock that another request's open transaction holds; the holder's
    commit runs on the middleware's own threads, so it ends and releases the lock, and every
    request commits: no 503 store-unavailable after a busy timeout."""
    import asyncio

    store = SQLiteStore(tmp_path / "keys.db", busy_timeout=1.0)
    db = DB("sqlite", store, str(tmp_path / "keys.db"))

    def write(scope: Any) -> None:
        with transaction(scope) as conn:
            conn.execute("INSERT INTO effects (note) VALUES (?)", ("one",))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.to_thread(write, scope)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = IdempotencyMiddleware(app, store)
    requests = 4 * (min(32, (os.cpu_count() or 1) + 4))  # the default executor's size, 4×

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            answers = await asyncio.gather(
                *(
                    c.post("/write", json={}, headers={"Idempotency-Key": f"k-{i}"})
                    for i in range(requests)
                )
            )
        return [a.status_code for a in answers]

    try:
        statuses = asyncio.run(main())
    finally:
        store.close()
    assert statuses == [201] * requests
    assert len(db.rows()) == requests
