"""Run context and write-call dedupe: recorded before the first attempt, never re-executed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retrysafe import ConfigurationError, MemoryStore, PayloadError
from retrysafe.agents import (
    AgentCallState,
    AgentError,
    AgentStore,
    NoActiveRunError,
    RunNotFoundError,
    ToolCallFailedError,
    ToolSignatureError,
    call_id,
    current_call_key,
    resume_run,
    start_run,
    tool,
)


def test_write_tool_outside_a_run_is_refused() -> None:
    """A write tool called outside an agent run raises NoActiveRunError and does not run."""
    ran: list[int] = []

    @tool(kind="write")
    def send(n: int) -> int:
        ran.append(n)
        return n

    with pytest.raises(NoActiveRunError, match="outside an agent run"):
        send(1)
    assert ran == []


def test_read_tool_runs_outside_a_run() -> None:
    """Read tools need no run."""

    @tool(kind="read")
    def look(n: int) -> int:
        return n * 2

    assert look(2) == 4


def test_run_id_is_generated_and_stored(agent_store: AgentStore) -> None:
    """start_run without an id generates one, records it, and refuses to start it twice."""
    run = start_run(agent_store, max_steps=5)
    assert run.id.startswith("run_")
    assert agent_store.get_agent_run(run.id) is not None
    assert run.record().max_steps == 5
    with pytest.raises(AgentError, match="exists already"):
        start_run(agent_store, run.id)


def test_resume_unknown_run_id(agent_store: AgentStore) -> None:
    """Resuming a run id the store does not hold raises RunNotFoundError naming it."""
    with pytest.raises(RunNotFoundError, match="nope") as err:
        resume_run(agent_store, "nope")
    assert err.value.run_id == "nope"


def test_store_url_is_accepted_and_memory_store_is_refused(tmp_path: Path) -> None:
    """A store URL opens a SQLite store; a store that cannot hold runs is a clear error."""
    run = start_run(f"sqlite:///{tmp_path / 'a.db'}", "r1")
    assert run.id == "r1"
    with pytest.raises(ConfigurationError, match="cannot hold agent runs"):
        start_run(MemoryStore())


def test_call_is_recorded_with_its_key_before_the_first_attempt(agent_store: AgentStore) -> None:
    """Inside the first attempt the call row exists, RUNNING, with the key the tool sees."""
    seen: list[Any] = []

    @tool(kind="write")
    def send(text: str) -> str:
        key = current_call_key()
        assert key is not None
        row = agent_store.get_agent_call(key)
        seen.append(row)
        return "sent"

    with start_run(agent_store) as run, run.step():
        send("hi")
    (row,) = seen
    assert row.state is AgentCallState.RUNNING and row.attempts == 1
    assert run.calls()[0].key == row.key


def test_repeated_call_returns_the_stored_result(agent_store: AgentStore) -> None:
    """The same call again in the same step (or resumed) returns the stored result."""
    effects: list[str] = []

    @tool(kind="write")
    def send(text: str, loud: bool = False) -> dict[str, Any]:
        effects.append(text)
        return {"n": len(effects), "text": text}

    with start_run(agent_store, "r") as run:
        with run.step(1):
            first = send("hi")
            again = send(text="hi", loud=False)
        with run.step(2):
            other_step = send("hi")
    with resume_run(agent_store, "r") as resumed, resumed.step(1):
        resumed_result = send("hi")
    assert first == again == resumed_result == {"n": 1, "text": "hi"}
    assert other_step == {"n": 2, "text": "hi"}
    assert effects == ["hi", "hi"]
    assert [c.step for c in run.calls()] == [1, 2]


def test_explicit_call_id_dedupes_across_steps(agent_store: AgentStore) -> None:
    """Calls named by the same call id are one call, whatever their step."""
    effects: list[str] = []

    @tool(kind="write")
    def send(text: str) -> str:
        effects.append(text)
        return text

    with start_run(agent_store) as run:
        for step in (1, 2):
            with run.step(step), call_id("tool_call_1"):
                send("hi")
    assert effects == ["hi"]


def test_async_write_tool_dedupes(agent_store: AgentStore) -> None:
    """Async tools follow the same rules."""
    import asyncio

    effects: list[str] = []

    @tool(kind="write")
    async def send(text: str) -> str:
        effects.append(text)
        return text.upper()

    async def main() -> list[str]:
        async with start_run(agent_store) as run:
            with run.step(1):
                return [await send("a"), await send("a")]

    assert asyncio.run(main()) == ["A", "A"]
    assert effects == ["a"]


def test_definitive_failure_is_not_rerun(agent_store: AgentStore) -> None:
    """A call that raised a non-retryable error is FAILED; a repeat re-raises it, no effect."""
    effects: list[str] = []

    @tool(kind="write")
    def send(text: str) -> str:
        effects.append(text)
        raise ValueError("bad address")

    with start_run(agent_store) as run, run.step(1):
        with pytest.raises(ValueError, match="bad address"):
            send("hi")
        with pytest.raises(ToolCallFailedError, match="bad address") as err:
            send("hi")
    assert effects == ["hi"]
    assert err.value.key == run.calls()[0].key
    assert run.calls()[0].state is AgentCallState.FAILED


def test_non_serialisable_argument_runs_nothing(agent_store: AgentStore) -> None:
    """A non-JSON argument is a PayloadError naming it; nothing is recorded or executed."""
    effects: list[object] = []

    @tool(kind="write")
    def send(payload: object) -> None:
        effects.append(payload)

    with start_run(agent_store) as run, run.step(1), pytest.raises(PayloadError, match="payload"):
        send(object())
    assert effects == [] and run.calls() == []


def test_changed_signature_between_runs_is_refused(agent_store: AgentStore) -> None:
    """A resumed run whose tool changed its parameters raises ToolSignatureError, no effect."""
    effects: list[str] = []

    @tool(kind="write", name="send")
    def send_v1(text: str) -> str:
        effects.append(text)
        return text

    @tool(kind="write", name="send")
    def send_v2(text: str, channel: str = "email") -> str:
        effects.append(text)
        return text

    with start_run(agent_store, "r") as run, run.step(1):
        send_v1("hi")
    resumed = resume_run(agent_store, "r")
    with resumed.step(1), pytest.raises(ToolSignatureError, match="changed its parameters") as err:
        send_v2("hi")
    assert effects == ["hi"]
    assert err.value.tool == "send" and err.value.recorded != err.value.current


def test_non_serialisable_result_is_not_replayed_nor_rerun(agent_store: AgentStore) -> None:
    """A result that is not JSON is kept as a summary; a repeat says so and runs nothing."""
    effects: list[int] = []

    @tool(kind="write")
    def send() -> object:
        effects.append(1)
        return object()

    with start_run(agent_store) as run, run.step(1):
        send()
        with pytest.raises(ToolCallFailedError, match="cannot be replayed"):
            send()
    assert effects == [1]


def test_bad_tool_declarations() -> None:
    """Bad kinds and attempts are configuration errors naming the option."""
    with pytest.raises(ConfigurationError) as err:
        tool(kind="delete")  # type: ignore[call-overload]
    assert err.value.option == "kind"
    with pytest.raises(ConfigurationError) as err:
        tool(kind="write", attempts=0)
    assert err.value.option == "attempts"


def test_two_tools_sharing_a_name_in_one_run_are_refused(agent_store: AgentStore) -> None:
    """Two different functions writing under one tool name (the same ``__qualname__`` in two
    modules) would share keys: the second is refused before it records or runs anything."""
    import types

    jira, zendesk = types.ModuleType("pkg.jira"), types.ModuleType("pkg.zendesk")
    made: list[str] = []
    for module in (jira, zendesk):
        exec(
            "def create(title):\n    made.append(__name__)\n    return __name__\n",
            {"__name__": module.__name__, "made": made},
            module.__dict__,
        )
        module.__dict__["create"] = tool(kind="write")(module.__dict__["create"])
    with start_run(agent_store) as run, run.step(1):
        assert jira.__dict__["create"]("printer") == "pkg.jira"
        with pytest.raises(ConfigurationError) as info:
            zendesk.__dict__["create"]("printer")
    assert "pkg.jira:create and pkg.zendesk:create" in str(info.value)
    assert "@tool(kind=..., name='...')" in str(info.value)
    assert made == ["pkg.jira"] and len(run.calls()) == 1


@pytest.mark.parametrize("bad", [-1, -3, 1.5, True, "2", 2**63])
def test_negative_or_non_integer_step_numbers_are_refused(
    agent_store: AgentStore, bad: object
) -> None:
    """run.step(n) takes whole numbers >= 0 (0: calls outside any step): anything else is a
    ConfigurationError."""
    with (
        start_run(agent_store) as run,
        pytest.raises(ConfigurationError) as info,
        run.step(bad),  # type: ignore[arg-type]
    ):
        pass
    assert "step must be an integer from 0 to 2**63-1" in str(info.value)
