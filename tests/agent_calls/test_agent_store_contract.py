"""The agent store's lease renewal (``extend_agent_call_lease``), on every store that holds
agent runs: it moves a running call's lease forward only under exactly the caller's token."""

from __future__ import annotations

import dataclasses

import pytest

from retrysafe.agents import AgentCall, AgentCallState, AgentStore

T0 = 1_000_000.0
KEY = "agent-contract-key"


def _running(store: AgentStore, *, lease_expires_at: float = T0 + 30) -> AgentCall:
    """Record run ``r1`` and claim one RUNNING call in it (token 1) at ``T0``."""
    store.create_agent_run("r1", max_steps=None, max_attempts=None, now=T0)
    call = AgentCall(
        key=KEY,
        run_id="r1",
        step=1,
        tool="send",
        kind="write",
        signature="sig",
        arguments_hash="h",
        arguments_json="{}",
        state=AgentCallState.RUNNING,
        owner="me",
        lease_expires_at=lease_expires_at,
        created_at=T0,
        updated_at=T0,
    )
    outcome, row = store.claim_agent_call(call, now=T0)
    assert outcome == "claimed"
    return row


def _row(store: AgentStore) -> AgentCall:
    row = store.get_agent_call(KEY)
    assert row is not None
    return row


def test_renewal_moves_the_lease_of_a_running_call(agent_store: AgentStore) -> None:
    """Under its own token a running call's lease end moves to the given time; nothing else."""
    before = _running(agent_store)
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 45) is True
    after = _row(agent_store)
    assert after.lease_expires_at == T0 + 45
    assert after == dataclasses.replace(before, lease_expires_at=T0 + 45)


def test_renewal_never_moves_the_lease_backward(agent_store: AgentStore) -> None:
    """A late renewal with an earlier end is still ours (True) but keeps the later lease."""
    _running(agent_store, lease_expires_at=T0 + 30)
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 10) is True
    assert _row(agent_store).lease_expires_at == T0 + 30


def test_renewal_of_an_expired_lease_nobody_took_is_still_ours(agent_store: AgentStore) -> None:
    """A lease that ran out but was not taken over is renewed (the token still owns it)."""
    _running(agent_store, lease_expires_at=T0 + 1)
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 100) is True
    assert _row(agent_store).lease_expires_at == T0 + 100


def test_renewal_after_a_take_over_is_refused(agent_store: AgentStore) -> None:
    """Once another claimant took the call over (token 2), the old token renews nothing."""
    _running(agent_store, lease_expires_at=T0 + 1)
    token = agent_store.take_over_agent_call(
        KEY, 1, owner="other", lease_expires_at=T0 + 40, now=T0 + 2, allow_unknown=False
    )
    assert token == 2
    taken = _row(agent_store)
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 99) is False
    assert _row(agent_store) == taken
    assert agent_store.extend_agent_call_lease(KEY, 2, lease_expires_at=T0 + 99) is True


@pytest.mark.parametrize("state", [AgentCallState.SUCCEEDED, AgentCallState.UNKNOWN])
def test_renewal_of_a_finished_call_is_refused(
    agent_store: AgentStore, state: AgentCallState
) -> None:
    """A call that is no longer running (finished, or interrupted to UNKNOWN) is not renewed,
    even under its own token, and stays as it was."""
    _running(agent_store)
    assert agent_store.finish_agent_call(
        KEY, 1, state=state, result=None, result_summary=None, error=None, now=T0 + 1
    )
    finished = _row(agent_store)
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 99) is False
    assert _row(agent_store) == finished


def test_renewal_of_an_interrupted_call_is_refused(agent_store: AgentStore) -> None:
    """``resume_run``'s interruption (RUNNING to UNKNOWN) ends the old claimant's renewals."""
    _running(agent_store)
    assert agent_store.interrupt_agent_calls("r1", now=T0 + 1) == 1
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0 + 99) is False
    assert _row(agent_store).state is AgentCallState.UNKNOWN


def test_renewal_of_an_unknown_key_is_refused(agent_store: AgentStore) -> None:
    """No call under the key: False, and nothing is created."""
    assert agent_store.extend_agent_call_lease(KEY, 1, lease_expires_at=T0) is False
    assert agent_store.get_agent_call(KEY) is None
