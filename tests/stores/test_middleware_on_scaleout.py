"""IdempotencyMiddleware on the PostgreSQL and Redis stores, one Redis server or a Redis Cluster
(SPEC §3): the real server clock, the stores' own async faces, a Starlette app over httpx's ASGI
transport."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from retrysafe.server import IdempotencyMiddleware

from .conftest import open_test_store


class App:
    """A tiny Starlette app whose POST /orders counts how often it really ran."""

    def __init__(self) -> None:
        self.runs = 0

        async def create(request: Request) -> JSONResponse:
            self.runs += 1
            body = await request.json()
            await asyncio.sleep(0.2)  # long enough for concurrent repeats to collide
            return JSONResponse({"order": self.runs, **body}, status_code=201)

        self.asgi = Starlette(routes=[Route("/orders", create, methods=["POST"])])


@pytest.fixture(params=["postgres", "redis", "redis-cluster"])
async def served(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[App, httpx.AsyncClient]]:
    store = open_test_store(request.param, request, tmp_path, clock="server")
    app = App()
    middleware = IdempotencyMiddleware(app.asgi, store=store)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield app, client
    aclose = getattr(middleware.store, "aclose", None)
    if aclose is not None:
        await aclose()
    store.close()


@pytest.mark.anyio
async def test_first_request_runs_and_the_repeat_replays(
    served: tuple[App, httpx.AsyncClient],
) -> None:
    """The first request runs the handler; the repeat replays it with Idempotent-Replayed."""
    app, client = served
    key = {"Idempotency-Key": str(uuid.uuid4())}
    first = await client.post("/orders", json={"sku": "a"}, headers=key)
    again = await client.post("/orders", json={"sku": "a"}, headers=key)
    assert first.status_code == again.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert app.runs == 1


@pytest.mark.anyio
async def test_twenty_concurrent_identical_requests_run_the_handler_once(
    served: tuple[App, httpx.AsyncClient],
) -> None:
    """Of 20 simultaneous identical requests exactly one runs; the rest get 409 or a replay."""
    app, client = served
    key = {"Idempotency-Key": str(uuid.uuid4())}
    answers = await asyncio.gather(
        *(client.post("/orders", json={"sku": "b"}, headers=key) for _ in range(20))
    )
    assert app.runs == 1
    ran = [r for r in answers if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(ran) == 1
    assert all(r is ran[0] or r.status_code in (201, 409) for r in answers)
    replay = await client.post("/orders", json={"sku": "b"}, headers=key)
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == ran[0].content


@pytest.mark.anyio
async def test_reused_key_with_another_body_is_rejected(
    served: tuple[App, httpx.AsyncClient],
) -> None:
    """The same key with a different body answers 422 key-reused; the handler runs once."""
    app, client = served
    key = {"Idempotency-Key": str(uuid.uuid4())}
    await client.post("/orders", json={"sku": "c"}, headers=key)
    other = await client.post("/orders", json={"sku": "d"}, headers=key)
    assert other.status_code == 422
    assert app.runs == 1
