"""Budgets: steps per run (logical calls) and attempts per call, enforced in code."""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from retrysafe import ConfigurationError
from retrysafe.agents import (
    AgentCallState,
    AgentRun,
    AgentStore,
    BudgetExceededError,
    OutcomeUnknownError,
    resume_run,
    start_run,
    tool,
)


def test_step_budget_stops_a_looping_agent(agent_store: AgentStore) -> None:
    """An agent that loops forever is stopped at max_steps; the audit log says why."""
    effects: list[int] = []

    @tool(kind="write")
    def poll_and_post(i: int) -> int:
        effects.append(i)
        return i

    def agent_loop(run: AgentRun) -> None:
        for i in range(100):  # a model that never stops asking
            with run.step():
                poll_and_post(i)

    run = start_run(agent_store, "loop", max_steps=3)
    with pytest.raises(BudgetExceededError) as err:
        agent_loop(run)
    assert effects == [0, 1, 2]
    assert err.value.kind == "steps" and err.value.limit == 3 and err.value.run_id == "loop"
    assert "step budget exhausted: 3 of 3" in str(err.value)
    calls = run.calls()
    assert [c.state for c in calls] == [AgentCallState.SUCCEEDED] * 3 + [AgentCallState.REFUSED]
    assert calls[-1].error == "step budget exhausted: 3 of 3 logical calls used"
    record = run.record()
    assert record.state == "stopped" and record.reason == calls[-1].error


def test_budget_counts_logical_calls_not_repeats(agent_store: AgentStore) -> None:
    """Repeating the same call (a retried step, a resume) does not use up the budget."""

    @tool(kind="write")
    def send(text: str) -> str:
        return text

    with start_run(agent_store, "r", max_steps=2) as run:
        for _ in range(5):
            with run.step(1):
                send("a")
        with run.step(2):
            send("b")
    with resume_run(agent_store, "r") as resumed:
        with resumed.step(1):
            send("a")
        with resumed.step(2):
            send("b")
        with resumed.step(3), pytest.raises(BudgetExceededError):
            send("c")


def test_step_budget_holds_under_concurrent_calls(agent_store: AgentStore) -> None:
    """Eight different calls claimed at once under max_steps=3: exactly three run, the rest
    are refused (the budget check and the insert are one serialised claim)."""
    effects: list[int] = []
    gate = threading.Barrier(8)

    @tool(kind="write")
    def post(i: int) -> int:
        effects.append(i)
        return i

    def call(i: int) -> str:
        gate.wait()
        try:
            post(i)
        except BudgetExceededError:
            return "refused"
        return "ran"

    run = start_run(agent_store, "burst", max_steps=3)
    with run, run.step(1), ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(contextvars.copy_context().run, call, i) for i in range(8)]
        outcomes = [f.result() for f in futures]
    assert sorted(outcomes) == ["ran"] * 3 + ["refused"] * 5
    assert len(effects) == 3
    states = [c.state for c in run.calls()]
    assert states.count(AgentCallState.SUCCEEDED) == 3


def test_attempt_budget_across_processes(agent_store: AgentStore) -> None:
    """max_attempts caps one call's attempts summed over resumes; the error names the key."""
    attempts: list[int] = []

    @tool(kind="write", attempts=2, wait_initial=0.01)
    def send(text: str) -> str:
        attempts.append(1)
        raise ConnectionError("link down")

    with (
        start_run(agent_store, "r", max_attempts=3) as run,
        run.step(1),
        pytest.raises(OutcomeUnknownError),
    ):
        send("a")
    resumed = resume_run(agent_store, "r", retry_unknown=True)
    with resumed.step(1), pytest.raises(BudgetExceededError) as err:
        send("a")
    assert len(attempts) == 3
    assert err.value.kind == "attempts" and err.value.limit == 3
    (call,) = run.calls()
    assert err.value.key == call.key
    assert call.state is AgentCallState.UNKNOWN and call.attempts == 3
    assert call.error == "attempt budget exhausted: 3 of 3"


def test_bad_budgets_are_refused(agent_store: AgentStore) -> None:
    """Budgets must be positive integers."""
    with pytest.raises(ConfigurationError):
        start_run(agent_store, max_steps=0)
