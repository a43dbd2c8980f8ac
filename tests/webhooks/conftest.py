"""A real local webhook receiver whose answers each test scripts per path, and a fast policy.

Every request the receiver gets is checked with the official ``standardwebhooks`` verifier
(the reference implementation) and recorded with its headers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as RefError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread
from retrysafe.webhooks import SVIX, Schedule, WebhookPolicy, Webhooks

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
    """Per-path scripted statuses (the last one repeats) and secrets to verify with."""

    plans: dict[str, list[tuple[int, dict[str, str]]]] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
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
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'hooks.db'}"


@pytest.fixture
def hooks(store_url: str) -> Iterator[Webhooks]:
    """Webhooks on a fresh SQLite file; loopback allowed (the receiver is local)."""
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
