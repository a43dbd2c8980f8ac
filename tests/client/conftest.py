"""A real local HTTP server whose answers each test scripts, per path, request by request."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from retrysafe import Outbox, RetryPolicy, SQLiteStore, StoreUnavailableError
from retrysafe._serving import ServerThread
from retrysafe.client import OutboxStore, outbox_store

# Policies with tiny waits so tests never sleep through real backoff.
FAST = RetryPolicy(attempts=4, wait_initial=0.01, wait_max=0.05, timeout=2.0, poll_interval=0.01)


@dataclass
class Step:
    """One scripted answer: ``status`` after ``sleep`` seconds, or a truncated answer."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    sleep: float = 0.0
    truncate: bool = False


@dataclass
class Seen:
    path: str
    key: str | None
    body: bytes
    at: float


class _Truncated(Response):
    """Promises 1000 bytes, sends 10, then fails: the client sees a truncated answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"1000")],
            }
        )
        await send({"type": "http.response.body", "body": b"0123456789", "more_body": True})
        raise RuntimeError("connection dropped mid-answer (scripted)")


class Script:
    """Per-path queues of :class:`Step`; the last step of a path repeats forever."""

    def __init__(self) -> None:
        self.plans: dict[str, list[Step]] = {}
        self.seen: list[Seen] = []
        self.in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}
        self.started = threading.Event()
        self._lock = threading.Lock()

    def plan(self, path: str, *steps: Step) -> str:
        self.plans[path] = list(steps)
        return path

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    def _next(self, path: str) -> Step:
        with self._lock:
            plan = self.plans.get(path) or [Step()]
            return plan.pop(0) if len(plan) > 1 else plan[0]

    async def endpoint(self, request: Request) -> Response:
        path = request.url.path
        key = request.headers.get("idempotency-key")
        body = await request.body()
        step = self._next(path)
        with self._lock:
            self.seen.append(Seen(path, key, body, time.time()))
            k = key or ""
            self.in_flight[k] = self.in_flight.get(k, 0) + 1
            self.max_in_flight[k] = max(self.max_in_flight.get(k, 0), self.in_flight[k])
        self.started.set()
        try:
            if step.sleep:
                await asyncio.sleep(step.sleep)
            if step.truncate:
                return _Truncated()
            if isinstance(step.body, bytes):  # sent as is, whatever it claims to be
                return Response(step.body, step.status, headers=step.headers)
            if step.body is not None and step.headers.get("content-type") == (
                "application/problem+json"
            ):
                import json

                return Response(json.dumps(step.body), step.status, headers=step.headers)
            return JSONResponse(
                step.body if step.body is not None else {"path": path},
                step.status,
                headers=step.headers,
            )
        finally:
            with self._lock:
                self.in_flight[k] -= 1


@pytest.fixture(scope="session")
def _server() -> Iterator[tuple[ServerThread, list[Script]]]:
    holder: list[Script] = [Script()]

    async def endpoint(request: Request) -> Response:
        return await holder[0].endpoint(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST", "PUT", "PATCH"])])
    with ServerThread(app) as server:
        yield server, holder


@pytest.fixture
def script(_server: tuple[ServerThread, list[Script]]) -> Script:
    """A fresh script on the session's server."""
    _server[1][0] = Script()
    return _server[1][0]


@pytest.fixture
def base_url(_server: tuple[ServerThread, list[Script]]) -> str:
    return _server[0].url


@pytest.fixture
def outbox(sqlite_path: Path) -> Iterator[Outbox]:
    with Outbox(f"sqlite:///{sqlite_path}", policy=FAST) as ob:
        yield ob


@pytest.fixture
def sqlite_outbox(sqlite_store: SQLiteStore) -> OutboxStore:
    """The outbox store of the ``sqlite_store`` fixture (its jobs and attempts)."""
    return outbox_store(sqlite_store)


@dataclass(frozen=True)
class OutboxDatabase:
    """One fresh outbox database: ``open()`` gives a new store on it (own connections or
    pool, as another worker process would have); ``argv`` names it for a child process
    (``kind location schema``, see :func:`open_outbox_database`)."""

    open: Callable[[], Any]
    argv: tuple[str, str, str]


def open_outbox_database(kind: str, location: str, schema: str) -> Any:
    """The store a child process opens from :attr:`OutboxDatabase.argv`."""
    if kind == "sqlite":
        from retrysafe.stores import SQLiteStore

        return SQLiteStore(location)
    from retrysafe.stores import PostgresStore

    return PostgresStore(location, schema=schema)


@pytest.fixture(params=["sqlite", "postgres"])
def outbox_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutboxDatabase]:
    """A fresh outbox on SQLite (a file) or PostgreSQL (a schema, server clock), dropped after.
    PostgreSQL down: skipped, except under ``CI=true`` where the test fails."""
    if request.param == "sqlite":
        path = str(tmp_path / "outbox.db")
        yield OutboxDatabase(lambda: open_outbox_database("sqlite", path, ""), ("sqlite", path, ""))
        return
    url: str = request.getfixturevalue("pg_url")
    schema: str = request.getfixturevalue("pg_schema")
    yield OutboxDatabase(
        lambda: open_outbox_database("postgres", url, schema), ("postgres", url, schema)
    )


@pytest.fixture
def sql_store(outbox_database: OutboxDatabase) -> Iterator[Any]:
    """A :class:`~retrysafe.SQLiteStore` or a :class:`~retrysafe.stores.PostgresStore` (server
    clock) on a fresh outbox database: a test taking it runs once per SQL store (through the
    parametrized ``outbox_database``, whose ``open()`` gives more stores on the same data)."""
    store = outbox_database.open()
    yield store
    store.close()


@pytest.fixture
def pg_database_url(pg_url: str) -> Iterator[str]:
    """The URL of a fresh, empty PostgreSQL database (its default schema, as the CLI uses),
    dropped after the test."""
    import psycopg

    name = f"rs_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    yield urlsplit(pg_url)._replace(path="/" + name).geturl()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)".encode())


@pytest.fixture(params=["sqlite", "postgres"])
def sql_store_url(request: pytest.FixtureRequest, sqlite_path: Path) -> str:
    """The URL of a fresh SQLite file or PostgreSQL database (for the CLI): a test taking it
    runs once per SQL store."""
    if request.param == "sqlite":
        return f"sqlite:///{sqlite_path}"
    url: str = request.getfixturevalue("pg_database_url")
    return url


def run_bounded(worker: Any, seconds: float = 30.0) -> None:
    """Run ``worker`` until idle, failing after ``seconds`` instead of hanging (for bugs that
    would send a job forever)."""

    async def bounded() -> None:
        await asyncio.wait_for(worker.serve(until_idle=True), timeout=seconds)

    asyncio.run(bounded())


class RecordsDown:
    """A worker's async store face whose attempt records and lease renewals fail
    (StoreUnavailableError) while ``down`` is set, as it is at first; ``failed`` is set at
    the first failed record and ``waiting`` holds the jobs whose records failed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.down = threading.Event()
        self.down.set()
        self.failed = threading.Event()
        self.waiting: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def finish_attempts(self, finishes: Any) -> Any:
        if self.down.is_set():
            self.waiting.update(f.job_id for f in finishes)
            self.failed.set()
            raise StoreUnavailableError("the test's outage")
        return await self._inner.finish_attempts(finishes)

    async def extend_job_lease(self, *args: Any, **kwargs: Any) -> Any:
        if self.down.is_set():
            raise StoreUnavailableError("the test's outage")
        return await self._inner.extend_job_lease(*args, **kwargs)
