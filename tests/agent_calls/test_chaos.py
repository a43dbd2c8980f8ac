"""The adversarial proof: a ticket service commits, then the chaos proxy loses its answer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from retrysafe.agents import (
    AgentCallState,
    AgentStore,
    OutcomeUnknownError,
    call_id,
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


def test_a_later_step_joins_an_unknown_call_instead_of_sending_it_again(
    tickets: Tickets, lose_all: ChaosProxy, agent_store: AgentStore
) -> None:
    """The same write with the same arguments in a later step, while the earlier call is
    UNKNOWN (an agent loop whose model asks again after "outcome unknown"), is that call: it
    is reported unknown with the first key and nothing is sent; reconciling it sends the
    first key again. One ticket (SPEC §0: a timeout means "I don't know")."""
    runs: list[str] = []
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="write", attempts=1)
    def create_ticket(title: str) -> dict[str, Any]:
        runs.append(title)
        return _create(client, lose_all.url, title)

    with start_run(agent_store) as run:
        with run.step(1), pytest.raises(OutcomeUnknownError) as first:
            create_ticket("printer")
        with run.step(2), pytest.raises(OutcomeUnknownError) as later:
            create_ticket("printer")
        # other arguments: another call, sent under its own key
        with run.step(3), pytest.raises(OutcomeUnknownError) as other:
            create_ticket("scanner")
    assert later.value.key == first.value.key
    assert other.value.key != first.value.key
    assert runs == ["printer", "scanner"]  # the joined call sent nothing
    lose_all.heal()
    with resume_run(agent_store, run.id, retry_unknown=True) as resumed, resumed.step(4):
        create_ticket("printer")
    client.close()
    assert tickets.created("printer") == 1
    assert [c.state for c in resumed.calls()] == [AgentCallState.SUCCEEDED, AgentCallState.UNKNOWN]
    # once it succeeded, a later step with the same arguments is a new logical call again
    assert resumed.calls()[0].key == first.value.key


def test_an_explicit_call_id_does_not_join_an_unknown_call(
    tickets: Tickets, lose_all: ChaosProxy, agent_store: AgentStore
) -> None:
    """call_id() names its own logical call: two ids with the same arguments are two calls,
    even while the first is UNKNOWN."""
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="write", attempts=1)
    def refund(amount: int) -> dict[str, Any]:
        return _create(client, lose_all.url, f"refund {amount}")

    with start_run(agent_store) as run, run.step(1):
        with call_id("refund-order-1"), pytest.raises(OutcomeUnknownError) as a:
            refund(5)
        with call_id("refund-order-2"), pytest.raises(OutcomeUnknownError) as b:
            refund(5)
    client.close()
    assert a.value.key != b.value.key
