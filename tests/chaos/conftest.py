"""An upstream API on a real socket that records its effects in an effect ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread
from retrysafe.chaos import EffectLedger


@dataclass
class Upstream:
    """A running upstream: its URL, its ledger and how many requests reached it."""

    url: str
    ledger: EffectLedger
    hits: list[str]


def make_app(ledger: EffectLedger, hits: list[str], *, work_seconds: float = 0.0) -> Starlette:
    """``POST /effects/{op}`` commits one effect of ``op`` and answers 201 (after ``work_seconds``).

    ``GET /ping`` answers 200 without an effect.
    """

    async def effect(request: Request) -> Response:
        op = request.path_params["op"]
        hits.append(op)
        body = await request.body()
        if work_seconds:
            await asyncio.sleep(work_seconds)
        n = ledger.record(op, key=request.headers.get("idempotency-key"), size=len(body))
        return JSONResponse({"op": op, "effects": n}, status_code=201)

    async def ping(request: Request) -> Response:
        hits.append("ping")
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/effects/{op}", effect, methods=["POST"]),
            Route("/ping", ping, methods=["GET", "HEAD"]),
        ]
    )


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    ledger = EffectLedger()
    hits: list[str] = []
    with ServerThread(make_app(ledger, hits)) as server:
        yield Upstream(server.url, ledger, hits)


@pytest.fixture
def slow_upstream() -> Iterator[Upstream]:
    """Like ``upstream``, but each effect takes 0.2 s of work before it commits."""
    ledger = EffectLedger()
    hits: list[str] = []
    with ServerThread(make_app(ledger, hits, work_seconds=0.2)) as server:
        yield Upstream(server.url, ledger, hits)
