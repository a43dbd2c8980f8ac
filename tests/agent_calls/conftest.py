"""A ticket service on a real socket, protected by the idempotency middleware, counting its
effects in an effect ledger; a chaos proxy in front that loses answers after commit; and the
agent store, once per store that can hold agent runs (SQLite, PostgreSQL).

PostgreSQL (``RETRYSAFE_TEST_POSTGRES``, default ``postgresql://postgres@127.0.0.1:5432/test``)
gets a fresh schema per test, dropped afterwards, as in ``tests/stores/conftest.py``. When it is
unreachable its tests are skipped with the reason — except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread
from retrysafe.agents import AgentStore
from retrysafe.agents import agent_store as agent_store_of
from retrysafe.chaos import ChaosProxy, EffectLedger, FaultRates
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore, open_store

AGENT_STORES = ["sqlite", "postgres"]


@dataclass
class Tickets:
    """A running ticket service: its URL, its ledger and the key each POST carried."""

    url: str
    ledger: EffectLedger
    keys: list[str | None] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)

    def created(self, title: str | None = None) -> int:
        """Tickets created (for ``title``, or in total)."""
        return self.ledger.total() if title is None else self.ledger.count(title)


def ticket_app(tickets: Tickets, store: SQLiteStore, *, work_seconds: float = 0.0) -> Any:
    """``POST /tickets {"title"}`` creates a ticket (commits, then answers after
    ``work_seconds``); ``GET /tickets`` lists titles without an effect."""

    async def create(request: Request) -> Response:
        body = await request.json()
        tickets.keys.append(request.headers.get("idempotency-key"))
        tickets.ledger.record(body["title"], key=request.headers.get("idempotency-key"))
        number = tickets.ledger.total()
        if work_seconds:
            await asyncio.sleep(work_seconds)
        tickets.answered.append(body["title"])
        return JSONResponse({"id": f"T-{number}", "title": body["title"]}, status_code=201)

    async def listing(request: Request) -> Response:
        tickets.reads.append(request.headers.get("idempotency-key") or "")
        return JSONResponse([e.operation_id for e in tickets.ledger.effects()])

    app = Starlette(
        routes=[
            Route("/tickets", create, methods=["POST"]),
            Route("/tickets", listing, methods=["GET"]),
        ]
    )
    return IdempotencyMiddleware(app, store=store)


def _serve(tmp_path: Path, name: str, work_seconds: float) -> Iterator[Tickets]:
    store = SQLiteStore(tmp_path / f"{name}-keys.db")
    tickets = Tickets("", EffectLedger())
    with ServerThread(ticket_app(tickets, store, work_seconds=work_seconds)) as server:
        tickets.url = server.url
        yield tickets
    store.close()


@pytest.fixture
def tickets(tmp_path: Path) -> Iterator[Tickets]:
    yield from _serve(tmp_path, "tickets", 0.0)


@pytest.fixture
def slow_tickets(tmp_path: Path) -> Iterator[Tickets]:
    """Commits at once, answers 0.5 s later (a process can be killed in between)."""
    yield from _serve(tmp_path, "slow", 0.5)


@pytest.fixture
def lose_first(tickets: Tickets) -> Iterator[ChaosProxy]:
    """A chaos proxy in front of ``tickets`` that loses the first answer after the service
    committed it, then heals."""
    proxies: list[ChaosProxy] = []

    def heal_after_first(record: dict[str, Any]) -> None:
        proxies[0].heal()

    proxy = ChaosProxy(
        tickets.url, rates=FaultRates(lose_after_commit=1.0), seed=1, on_record=heal_after_first
    )
    proxies.append(proxy)
    with proxy:
        yield proxy


@pytest.fixture
def lose_all(tickets: Tickets) -> Iterator[ChaosProxy]:
    """A chaos proxy that loses every answer after commit until healed."""
    with ChaosProxy(tickets.url, rates=FaultRates(lose_after_commit=1.0), seed=1) as proxy:
        yield proxy


@dataclass(frozen=True)
class StoreSpec:
    """How to open the test's agent store: a store URL and constructor options (a child
    process or the CLI opens it again from these)."""

    url: str
    schema: str | None = None

    def open(self) -> Any:
        return open_store(self.url, **({} if self.schema is None else {"schema": self.schema}))


@pytest.fixture(params=AGENT_STORES)
def agent_store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreSpec]:
    """Each store that can hold agent runs, on a private namespace (a fresh SQLite file, or a
    fresh PostgreSQL schema dropped after the test)."""
    if request.param == "sqlite":
        yield StoreSpec(f"sqlite:///{tmp_path / 'agent.db'}")
        return
    url: str = request.getfixturevalue("pg_url")
    yield StoreSpec(url, request.getfixturevalue("pg_schema"))


@pytest.fixture
def agent_store(agent_store_spec: StoreSpec) -> Iterator[AgentStore]:
    """The agent store of the test's store (closed with it)."""
    store = agent_store_spec.open()
    yield agent_store_of(store)
    store.close()
