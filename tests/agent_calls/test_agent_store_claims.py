"""The agent store's claim (``claim_agent_call``) and its async face, on every store that holds
agent runs: one winner per call, the step budget applied inside the claim, times kept as given."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from retrysafe import ConfigurationError, MemoryStore, SQLiteStore
from retrysafe.agents import AgentCall, AgentCallState, AgentStore
from retrysafe.agents import agent_store as agent_store_of
from retrysafe.agents._models import StepBudget
from retrysafe.agents._store import AsyncSQLAgentStore, SQLAgentStore
from retrysafe.stores._connector import _load

T0 = 1_000_000.0  # far from any clock: a store that used its own clock would show it


def _call(key: str = "agent-k1", *, tool: str = "send", signature: str = "sig") -> AgentCall:
    return AgentCall(
        key=key,
        run_id="r1",
        step=1,
        tool=tool,
        kind="write",
        signature=signature,
        arguments_hash="h",
        arguments_json="{}",
        state=AgentCallState.RUNNING,
        owner="me",
        lease_expires_at=T0 + 30,
        created_at=T0,
        updated_at=T0,
    )


def _refuse_at(limit: int, seen: list[int]) -> StepBudget:
    def budget(used: int) -> str | None:
        seen.append(used)
        return f"no more than {limit}" if used >= limit else None

    return budget


@pytest.fixture
def run_r1(agent_store: AgentStore) -> AgentStore:
    """The agent store with run ``r1`` recorded at ``T0``."""
    created, _ = agent_store.create_agent_run("r1", max_steps=None, max_attempts=None, now=T0)
    assert created
    return agent_store


def test_claim_records_the_call_once(run_r1: AgentStore) -> None:
    """The first claim records the call with the caller's times; a repeat gets that row."""
    outcome, row = run_r1.claim_agent_call(_call(), now=T0)
    assert outcome == "claimed"
    assert (row.state, row.fencing_token, row.attempts) == (AgentCallState.RUNNING, 1, 0)
    assert (row.created_at, row.lease_expires_at) == (T0, T0 + 30)
    again, existing = run_r1.claim_agent_call(_call(), now=T0 + 1)
    assert (again, existing) == ("existing", row)


def test_claim_of_a_tool_under_another_signature_is_a_conflict(run_r1: AgentStore) -> None:
    """A run that recorded a tool under one signature answers another with that call."""
    _, first = run_r1.claim_agent_call(_call("agent-k1"), now=T0)
    outcome, row = run_r1.claim_agent_call(_call("agent-k2", signature="other"), now=T0)
    assert (outcome, row) == ("conflict", first)
    assert run_r1.get_agent_call("agent-k2") is None


def test_budget_sees_the_logical_calls_and_its_refusal_is_recorded(run_r1: AgentStore) -> None:
    """The budget gets the count of recorded calls (refusals excluded); its reason refuses the
    call: a REFUSED row with that error, and the run stopped with it."""
    seen: list[int] = []
    budget = _refuse_at(1, seen)
    assert run_r1.claim_agent_call(_call("agent-k1"), now=T0, budget=budget)[0] == "claimed"
    outcome, row = run_r1.claim_agent_call(_call("agent-k2"), now=T0 + 1, budget=budget)
    assert outcome == "refused"
    assert (row.state, row.error, row.finished_at) == (
        AgentCallState.REFUSED,
        "no more than 1",
        T0 + 1,
    )
    run_r1.claim_agent_call(_call("agent-k3"), now=T0 + 2, budget=budget)
    assert seen == [0, 1, 1]
    record = run_r1.get_agent_run("r1")
    assert record is not None
    assert (record.state, record.reason) == ("stopped", "no more than 1")


def test_concurrent_claimants_of_one_call_never_both_win(run_r1: AgentStore) -> None:
    """Eight threads claim one key at once: exactly one gets "claimed", the others its row."""
    gate = threading.Barrier(8)

    def claim(_: int) -> tuple[str, AgentCall]:
        gate.wait()
        return run_r1.claim_agent_call(_call(), now=T0)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(claim, range(8)))
    outcomes = sorted(outcome for outcome, _ in results)
    assert outcomes == ["claimed"] + ["existing"] * 7
    assert len({row for _, row in results}) == 1


def test_async_face_runs_the_same_operations(run_r1: AgentStore) -> None:
    """The async face claims, fences and reads like the sync one, in the same tables."""
    assert isinstance(run_r1, SQLAgentStore)

    async def main(face: AsyncSQLAgentStore) -> None:
        try:
            outcome, row = await face.claim_agent_call(_call(), now=T0)
            assert outcome == "claimed"
            assert await face.start_agent_attempt(row.key, 1, lease_expires_at=T0 + 40, now=T0) == 1
            assert (
                await face.finish_agent_call(
                    row.key,
                    2,
                    state=AgentCallState.SUCCEEDED,
                    result="1",
                    result_summary="1",
                    error=None,
                    now=T0 + 1,
                )
                is False
            )
            assert (
                await face.finish_agent_call(
                    row.key,
                    1,
                    state=AgentCallState.SUCCEEDED,
                    result="1",
                    result_summary="1",
                    error=None,
                    now=T0 + 1,
                )
                is True
            )
            (listed,) = await face.list_agent_calls("r1")
            assert (listed.state, listed.result, listed.attempts) == (
                AgentCallState.SUCCEEDED,
                1,
                1,
            )
        finally:
            await face.aclose()

    asyncio.run(main(run_r1.asyncio_agent_store()))
    assert run_r1.list_agent_calls("r1") == [run_r1.get_agent_call("agent-k1")]


def test_a_recorded_call_is_returned_while_another_process_holds_the_write_lock(
    tmp_path: Path,
) -> None:
    """SQLite, the async face: the claim of a call already recorded under its key returns it
    at once while another process holds the write lock (it is read); a new call's claim
    waits for the lock and is recorded once it is free."""
    path = tmp_path / "agent.db"
    store = SQLiteStore(path, busy_timeout=30)
    agents = agent_store_of(store)
    assert agents.create_agent_run("r1", max_steps=None, max_attempts=None, now=T0)[0]
    assert agents.claim_agent_call(_call(), now=T0)[0] == "claimed"

    async def main(face: AsyncSQLAgentStore) -> None:
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        try:
            repeat = asyncio.ensure_future(face.claim_agent_call(_call(), now=T0 + 1))
            new = asyncio.ensure_future(
                face.claim_agent_call(_call("agent-k2"), now=T0 + 1)
            )
            await asyncio.wait({repeat}, timeout=10)
            assert repeat.done() and not new.done()
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        outcome, row = repeat.result()
        assert (outcome, row.key, row.created_at) == ("existing", "agent-k1", T0)
        assert (await new)[0] == "claimed"
        await face.aclose()

    try:
        asyncio.run(main(agents.asyncio_agent_store()))  # type: ignore[attr-defined]
    finally:
        store.close()


def test_agent_store_of_a_store_without_sql_is_refused() -> None:
    """Only stores with SQL tables hold agent runs; an agent store is returned as it is."""
    with pytest.raises(ConfigurationError, match="cannot hold agent runs") as err:
        agent_store_of(MemoryStore())
    assert err.value.option == "store"


def test_agent_store_of_an_agent_store_is_itself(agent_store: AgentStore) -> None:
    """Passing an AgentStore through ``agent_store`` changes nothing."""
    assert agent_store_of(agent_store) is agent_store


def test_both_dialects_name_the_same_parameters() -> None:
    """Every statement takes the same parameters on SQLite (``:name``) and PostgreSQL."""
    sqlite = _load("retrysafe.agents", "sql/agents.sqlite.sql")
    postgres = _load("retrysafe.agents", "sql/agents.postgres.sql")
    for name, text in sqlite.items():
        names = set(re.findall(r"(?<!:):(\w+)", re.sub(r"'[^']*'", "", text)))
        assert names == set(re.findall(r"%\((\w+)\)s", postgres[name])), name
