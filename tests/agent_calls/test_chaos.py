"""The adversarial proof: a ticket service commits, then the chaos proxy loses its answer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from retrysafe.agents import (
    AgentCallState,
    AgentStore,
    OutcomeUnknownError,
    instrument,
    resume_run,
    start_run,
    tool,
)
from retrysafe.chaos import ChaosProxy

from .conftest import Tickets


def _create(client: httpx.Client, base: str, title: str) -> dict[str, Any]:
    r = client.post(f"{base}/tickets", json={"title": title})
    r.raise_for_status()
    result: dict[str, Any] = r.json()
    return result


def test_naive_loop_creates_two_tickets(tickets: Tickets, lose_first: ChaosProxy) -> None:
    """A naive agent loop (blind retry, no key) turns one lost answer into two tickets."""
    with httpx.Client(timeout=5) as client:
        for _ in range(3):
            try:
                _create(client, lose_first.url, "printer on fire")
                break
            except httpx.TransportError:
                continue
    assert tickets.created("printer on fire") == 2


def test_guarded_loop_creates_one_ticket(
    tickets: Tickets, lose_first: ChaosProxy, agent_store: AgentStore
) -> None:
    """The same request through a write tool creates one ticket and returns its answer."""
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="write", attempts=3, wait_initial=0.01)
    def create_ticket(title: str) -> dict[str, Any]:
        return _create(client, lose_first.url, title)

    with start_run(agent_store) as run, run.step():
        result = create_ticket("printer on fire")
    client.close()
    assert tickets.created("printer on fire") == 1
    assert result == {"id": "T-1", "title": "printer on fire"}
    (call,) = run.calls()
    assert call.state is AgentCallState.SUCCEEDED and call.attempts == 2
    assert tickets.keys == [call.key]  # the retry carried it too and was replayed
    assert lose_first.stats().requests == 2
    # The audit log and the effects match: one succeeded write call, one ticket.
    succeeded = [c for c in run.calls() if c.state is AgentCallState.SUCCEEDED]
    assert len(succeeded) == tickets.created() == 1


def test_unknown_outcome_is_reported_with_the_key_and_not_rerun(
    tickets: Tickets, lose_all: ChaosProxy, agent_store: AgentStore
) -> None:
    """When every answer is lost the call ends UNKNOWN; a repeat reports it without running."""
    runs: list[str] = []
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="write", attempts=2, wait_initial=0.01)
    def create_ticket(title: str) -> dict[str, Any]:
        runs.append(title)
        return _create(client, lose_all.url, title)

    with start_run(agent_store) as run:
        with run.step(1), pytest.raises(OutcomeUnknownError) as first:
            create_ticket("disk full")
        with run.step(1), pytest.raises(OutcomeUnknownError) as again:
            create_ticket("disk full")
    assert "outcome unknown, key " + first.value.key in str(first.value)  # type: ignore[operator]
    assert again.value.key == first.value.key
    assert len(runs) == 2  # the two attempts of the first call; the repeat ran nothing
    assert tickets.created("disk full") == 1  # same key: the server deduped the retry
    (call,) = run.calls()
    assert call.state is AgentCallState.UNKNOWN and call.attempts == 2

    # Reconciled later with the same key once the link is healthy: still one ticket.
    lose_all.heal()
    with resume_run(agent_store, run.id, retry_unknown=True) as resumed, resumed.step(1):
        result = create_ticket("disk full")
    client.close()
    assert result["title"] == "disk full"
    assert tickets.created("disk full") == 1
    assert set(tickets.keys) == {first.value.key}
    assert resumed.calls()[0].state is AgentCallState.SUCCEEDED
