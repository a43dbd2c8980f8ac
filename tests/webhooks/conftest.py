"""A real local webhook receiver whose answers each test scripts per path, and a fast policy.

Every request the receiver gets is checked with the official ``standardwebhooks`` verifier
(the reference implementation) and recorded with its headers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as RefError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread
from retrysafe.stores import open_store
from retrysafe.webhooks import SVIX, Schedule, WebhookPolicy, Webhooks

#: The stores webhooks run on (SPEC §9): every store test runs on each.
WEBHOOK_STORES = ("sqlite", "postgresql")

#: Tiny waits so tests never sleep through a real schedule: 4 attempts, ~10–40 ms apart.
FAST_SCHEDULE = Schedule(name="default", attempts=4, base=0.01, cap=0.05, jitter=0.001)
FAST = WebhookPolicy(schedules=(FAST_SCHEDULE, SVIX), timeout=2.0, disable_after=None)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes
    verified: bool
    at: float


@dataclass
class Receiver:
    """Per-path scripted statuses (the last one repeats) and secrets to verify with; a
    path's ``before_answer`` runs (in a thread) after its request is read, before it is
    answered."""

    plans: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    before_answer: dict[str, Callable[[], object]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, path: str, *statuses: int | tuple[int, dict[str, str]]) -> str:
        self.plans[path] = [s if isinstance(s, tuple) else (s, {}) for s in statuses]
        return path

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def endpoint(self, request: Request) -> Response:
        body = await request.body()
        headers = dict(request.headers)
        path = request.url.path
        secret = self.secrets.get(path)
        verified = False
        if secret is not None:
            try:
                Webhook(secret).verify(body, headers)
                verified = True
            except RefError:
                verified = False
        with self.lock:
            self.seen.append(Seen(path, headers, body, verified, time.time()))
            plan = self.plans.get(path) or [(200, {})]
            status, extra = plan.pop(0) if len(plan) > 1 else plan[0]
            before = self.before_answer.get(path)
        if before is not None:
            await asyncio.to_thread(before)
        return JSONResponse({"ok": status < 300}, status, headers=extra)


@pytest.fixture(scope="session")
def _server() -> Iterator[tuple[ServerThread, list[Receiver]]]:
    holder = [Receiver()]

    async def endpoint(request: Request) -> Response:
        return await holder[0].endpoint(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST"])])
    with ServerThread(app) as server:
        yield server, holder


@pytest.fixture
def receiver(_server: tuple[ServerThread, list[Receiver]]) -> Receiver:
    """A fresh script on the session's receiver."""
    _server[1][0] = Receiver()
    return _server[1][0]


@pytest.fixture
def base_url(_server: tuple[ServerThread, list[Receiver]]) -> str:
    return _server[0].url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file's URL (for what only SQLite has: files, read-only opening)."""
    return f"sqlite:///{tmp_path / 'hooks.db'}"


@pytest.fixture
def pg_store_url(pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The PostgreSQL URL, opened (by Webhooks, Outbox, reconcile, the CLI: every opening in
    this test) in a fresh schema, dropped after the test, on the caller's clock, so tests that
    move their clock move the store's too. A URL cannot name a schema."""

    def open_in_schema(url: str, **options: Any) -> Any:
        if url == pg_url:
            options.setdefault("schema", pg_schema)
            options.setdefault("clock", "caller")
        return open_store(url, **options)

    monkeypatch.setattr("retrysafe.stores.open_store", open_in_schema)
    return pg_url


@pytest.fixture(params=WEBHOOK_STORES)
def store_url(request: pytest.FixtureRequest) -> str:
    """Each store that keeps webhooks, on a private namespace: a fresh SQLite file or a
    fresh PostgreSQL schema (see ``pg_store_url``)."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_store_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def hooks(store_url: str) -> Iterator[Webhooks]:
    """Webhooks on a fresh store (each of WEBHOOK_STORES); loopback allowed (the receiver is
    local)."""
    with Webhooks(store_url, allow_private=True, policy=FAST) as wh:
        yield wh


def add(hooks: Webhooks, receiver: Receiver, base_url: str, path: str, **kw: object) -> str:
    """Register ``base_url + path`` and let the receiver verify with its secret."""
    endpoint = hooks.add_endpoint(base_url + path, **kw)  # type: ignore[arg-type]
    receiver.secrets[path] = endpoint.secrets[0][0]
    return endpoint.id


def run(hooks: Webhooks, **options: object) -> None:
    """Deliver until nothing is pending (seeded jitter, no retry budget)."""
    import random

    options.setdefault("poll_interval", 0.01)
    options.setdefault("rng", random.Random(7))
    options.setdefault("budget", None)
    hooks.worker(**options).run_until_idle()
