"""Parallel duplicate calls run the effect once; read tools retry freely without keys."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from retrysafe.agents import (
    AgentCallState,
    AgentStore,
    current_call_key,
    instrument,
    start_run,
    tool,
)

from .conftest import Tickets


def test_parallel_duplicates_in_one_step_run_once(agent_store: AgentStore) -> None:
    """Five concurrent identical calls (asyncio tasks) in one step: one effect, one result."""
    effects: list[str] = []

    @tool(kind="write")
    async def send(text: str) -> dict[str, Any]:
        effects.append(text)
        await asyncio.sleep(0.1)
        return {"sent": text, "n": len(effects)}

    async def main() -> list[dict[str, Any]]:
        async with start_run(agent_store) as run:
            with run.step(1):
                return list(await asyncio.gather(*(send("hi") for _ in range(5))))

    results = asyncio.run(main())
    assert effects == ["hi"]
    assert results == [{"sent": "hi", "n": 1}] * 5


def test_parallel_duplicates_in_threads_run_once(agent_store: AgentStore) -> None:
    """The same with threads (each running in a copy of the run's context)."""
    effects: list[str] = []
    gate = threading.Barrier(4)

    @tool(kind="write")
    def send(text: str) -> str:
        effects.append(text)
        return text

    def call() -> str:
        gate.wait()
        return send("hi")

    with start_run(agent_store) as run, run.step(1), ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(contextvars.copy_context().run, call) for _ in range(4)]
        results = [f.result() for f in futures]
    assert results == ["hi"] * 4
    assert effects == ["hi"]
    assert len(run.calls()) == 1


def test_parallel_calls_with_different_arguments_run_separately(
    agent_store: AgentStore,
) -> None:
    """Different arguments in one step are different logical calls, each run once."""
    effects: list[str] = []

    @tool(kind="write")
    async def send(text: str) -> str:
        effects.append(text)
        await asyncio.sleep(0.05)
        return text

    async def main() -> list[str]:
        async with start_run(agent_store) as run:
            with run.step(1):
                return list(await asyncio.gather(send("a"), send("b"), send("a")))

    assert asyncio.run(main()) == ["a", "b", "a"]
    assert sorted(effects) == ["a", "b"]


def test_read_tool_is_retried_without_a_key(tickets: Tickets, agent_store: AgentStore) -> None:
    """A read tool retries transport errors (no key sent) and runs again when repeated."""
    failures = [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")]
    keys: list[str | None] = []
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="read", attempts=3, wait_initial=0.01)
    def list_tickets() -> list[str]:
        keys.append(current_call_key())
        if failures:
            raise failures.pop(0)
        r = client.get(f"{tickets.url}/tickets")
        r.raise_for_status()
        result: list[str] = r.json()
        return result

    with start_run(agent_store) as run, run.step(1):
        assert list_tickets() == []
        assert list_tickets() == []  # a repeated read runs again
    client.close()
    assert keys == [None] * 4
    assert tickets.reads == ["", ""]  # no Idempotency-Key header
    (call,) = run.calls()
    assert call.kind == "read" and call.state is AgentCallState.SUCCEEDED and call.attempts == 3


def test_read_tool_gives_up_after_its_attempts() -> None:
    """A read tool that keeps failing raises the last error after ``attempts``."""
    calls: list[int] = []

    @tool(kind="read", attempts=2, wait_initial=0.01)
    def flaky() -> None:
        calls.append(1)
        raise TimeoutError("still slow")

    with pytest.raises(TimeoutError):
        flaky()
    assert len(calls) == 2
