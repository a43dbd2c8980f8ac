"""Fixtures for the middleware tests; the apps and servers live in ``harness.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from retrysafe._serving import ServerThread
from retrysafe.server import IdempotencyConfig
from retrysafe.stores import SQLiteStore

from .harness import FRAMEWORKS, Effects, FakeClock, Harness, Serve, WSGIServerThread, build_app


@pytest.fixture(params=FRAMEWORKS)
def framework(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def serve(framework: str, tmp_path: Path) -> Iterator[Serve]:
    """``serve(store=None, **config) -> Harness``: start the app; everything stops at teardown."""
    stack: list[Any] = []

    def start(store: SQLiteStore | None = None, **options: Any) -> Harness:
        clock = FakeClock()
        options.setdefault("clock", clock)
        config = IdempotencyConfig(**options)
        if store is None:
            store = SQLiteStore(tmp_path / f"keys{len(stack)}.db")
            stack.append(store)
        effects = Effects()
        app = build_app(framework, effects, store, config)
        server: Any = WSGIServerThread(app) if framework == "flask" else ServerThread(app)
        server.__enter__()
        stack.append(server)
        client = httpx.Client(base_url=server.url, timeout=15)
        stack.append(client)
        return Harness(framework, server.url, client, effects, store, clock, app)

    yield start
    for item in reversed(stack):
        if isinstance(item, (ServerThread, WSGIServerThread)):
            item.__exit__(None, None, None)
        else:
            item.close()
