"""Propagation: requests made inside a write tool carry the call's key as Idempotency-Key."""

from __future__ import annotations

import asyncio

import httpx

from retrysafe.agents import (
    AgentStore,
    AsyncIdempotencyKeyTransport,
    IdempotencyKeyTransport,
    instrument,
    start_run,
    tool,
)


def _echo(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"key": request.headers.get("idempotency-key")})


def test_instrumented_client_sends_the_key_only_inside_write_tools(
    agent_store: AgentStore,
) -> None:
    """Inside a write tool the key is sent; in read tools and outside tools it is not."""
    client = instrument(httpx.Client(transport=httpx.MockTransport(_echo)))
    instrument(client)  # idempotent
    assert len(client.event_hooks["request"]) == 1

    @tool(kind="write")
    def write() -> str | None:
        key: str | None = client.post("http://api/x").json()["key"]
        return key

    @tool(kind="read")
    def read() -> str | None:
        key: str | None = client.get("http://api/x").json()["key"]
        return key

    with start_run(agent_store) as run, run.step(1):
        sent = write()
        assert read() is None
    assert client.post("http://api/x").json()["key"] is None
    assert sent == run.calls()[0].key


def test_explicit_header_wins(agent_store: AgentStore) -> None:
    """A request that sets its own Idempotency-Key keeps it."""
    client = instrument(httpx.Client(transport=httpx.MockTransport(_echo)))

    @tool(kind="write")
    def write() -> str:
        key: str = client.post("http://api/x", headers={"Idempotency-Key": "mine"}).json()["key"]
        return key

    with start_run(agent_store) as run, run.step(1):
        assert write() == "mine"


def test_transport_wrappers_sync_and_async(agent_store: AgentStore) -> None:
    """IdempotencyKeyTransport / AsyncIdempotencyKeyTransport add the key the same way."""
    sync_client = httpx.Client(transport=IdempotencyKeyTransport(httpx.MockTransport(_echo)))
    async_client = httpx.AsyncClient(
        transport=AsyncIdempotencyKeyTransport(httpx.MockTransport(_echo))
    )

    @tool(kind="write")
    def write_sync() -> str:
        key: str = sync_client.post("http://api/x").json()["key"]
        return key

    @tool(kind="write")
    async def write_async() -> str:
        key: str = (await async_client.post("http://api/x")).json()["key"]
        return key

    async def main() -> tuple[str, str]:
        async with start_run(agent_store) as run:
            with run.step(1):
                return write_sync(), await write_async()

    a, b = asyncio.run(main())
    assert a.startswith("agent-") and b.startswith("agent-") and a != b
    sync_client.close()
    asyncio.run(async_client.aclose())


def test_instrumented_async_client(agent_store: AgentStore) -> None:
    """instrument() works on an AsyncClient too."""
    client = instrument(httpx.AsyncClient(transport=httpx.MockTransport(_echo)))

    @tool(kind="write")
    async def write() -> str:
        key: str = (await client.post("http://api/x")).json()["key"]
        return key

    async def main() -> str:
        async with start_run(agent_store) as run:
            with run.step(1):
                return await write()

    assert asyncio.run(main()).startswith("agent-")
