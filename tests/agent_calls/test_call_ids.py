"""Explicit call ids and run ids: validated like idempotency keys, never silently reused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from retrysafe import ConfigurationError
from retrysafe.agents import (
    AgentCallState,
    AgentStore,
    CallIdReusedError,
    arguments_hash,
    call_id,
    start_run,
    tool,
)


def _tools(effects: list[str]) -> tuple[Any, Any]:
    @tool(kind="write", name="mk")
    def mk(name: str) -> dict[str, str]:
        effects.append(f"mk {name}")
        return {"created": name}

    @tool(kind="write", name="rm")
    def rm(name: str) -> dict[str, str]:
        effects.append(f"rm {name}")
        return {"deleted": name}

    return mk, rm


def test_call_id_reused_with_other_arguments_is_refused(agent_store: AgentStore) -> None:
    """The same call id with other arguments raises CallIdReusedError naming id, tool and
    both argument hashes."""
    effects: list[str] = []
    mk, _ = _tools(effects)
    with start_run(agent_store, "run-1") as run, run.step(3):
        with call_id("tc_7"):
            mk("printer")
        with call_id("tc_7"), pytest.raises(CallIdReusedError) as err:
            mk("coffee")
    e = err.value
    assert (e.call_id, e.tool, e.recorded_tool) == ("tc_7", "mk", "mk")
    assert e.recorded_arguments_hash == arguments_hash({"name": "printer"})
    assert e.arguments_hash == arguments_hash({"name": "coffee"})
    for part in ("'tc_7'", "'mk'", "other arguments", e.arguments_hash, e.recorded_arguments_hash):
        assert part in str(e)


def test_call_id_reuse_runs_nothing_and_keeps_the_original(agent_store: AgentStore) -> None:
    """A refused call id reuse runs nothing; the audit log keeps the original call only."""
    effects: list[str] = []
    mk, _ = _tools(effects)
    with start_run(agent_store) as run, run.step(3):
        with call_id("tc_7"):
            mk("printer")
        with call_id("tc_7"), pytest.raises(CallIdReusedError):
            mk("coffee")
    assert effects == ["mk printer"]
    (call,) = run.calls()
    assert call.arguments == {"name": "printer"} and call.state is AgentCallState.SUCCEEDED


def test_call_id_reused_by_another_tool_is_refused(agent_store: AgentStore) -> None:
    """The same call id used for a different tool raises CallIdReusedError and runs nothing."""
    effects: list[str] = []
    mk, rm = _tools(effects)
    with start_run(agent_store) as run, run.step(1):
        with call_id("tc_7"):
            mk("printer")
        with call_id("tc_7"), pytest.raises(CallIdReusedError, match="for tool 'mk', not 'rm'"):
            rm("printer")
    assert effects == ["mk printer"]
    assert [c.tool for c in run.calls()] == ["mk"]


def test_call_id_repeated_with_same_call_replays(agent_store: AgentStore) -> None:
    """The same call id with the same tool and arguments replays the stored result."""
    effects: list[str] = []
    mk, _ = _tools(effects)
    with start_run(agent_store) as run:
        for step in (1, 2):
            with run.step(step), call_id("tc_7"):
                assert mk("printer") == {"created": "printer"}
    assert effects == ["mk printer"]


@pytest.mark.parametrize("bad", ["a b/\n", "", "x" * 256, "tab\there", "café", " run"])
def test_start_run_rejects_invalid_run_id(agent_store: AgentStore, bad: str) -> None:
    """A run id that is not 1–255 visible ASCII is a ConfigurationError quoting it; no run."""
    with pytest.raises(ConfigurationError) as err:
        start_run(agent_store, bad)
    assert err.value.option == "run_id" and repr(bad[:300]) in str(err.value)
    assert agent_store.list_agent_runs() == []


@pytest.mark.parametrize("bad", ["tc 7", "", "tc\n", "y" * 256])
def test_call_id_rejects_invalid_id(bad: str) -> None:
    """An explicit call id that is not 1–255 visible ASCII is a ConfigurationError quoting it."""
    with pytest.raises(ConfigurationError) as err, call_id(bad):
        pass  # pragma: no cover - call_id raises on entry
    assert err.value.option == "call_id" and repr(bad) in str(err.value)


def test_visible_ascii_ids_are_accepted(agent_store: AgentStore) -> None:
    """Ids like model tool-call ids and UUIDs with punctuation are accepted unchanged."""
    run = start_run(agent_store, "run:2024-05-01/agent#1")
    assert run.id == "run:2024-05-01/agent#1"
    with call_id("toolu_01A09q90qw90lq917835lq9"):
        pass


def test_agent_call_decodes_arguments_and_result(agent_store: AgentStore) -> None:
    """AgentCall.arguments and .result are JSON values (a tuple becomes a list); the raw
    text stays in arguments_json / result_json."""

    @tool(kind="write")
    def pair(items: tuple[int, ...]) -> tuple[int, int]:
        return (items[0], len(items))

    with start_run(agent_store) as run, run.step(1):
        assert pair((4, 5)) == (4, 2)  # the first call returns the tool's own value
        replayed: Any = pair((4, 5))
        assert replayed == [4, 2]  # a replay returns JSON values
    (call,) = run.calls()
    assert call.arguments == {"items": [4, 5]} and call.result == [4, 2]
    assert json.loads(call.arguments_json) == call.arguments
    assert call.result_json == "[4,2]"
