"""The OpenAI Agents SDK adapter (SPEC §7, issue 17): retrysafe tools as SDK function tools,
one step per ``Runner.run``, keys never from the model's call ids.

The model is :class:`ScriptedModel` (the SDK's model interface, no network, no API key);
tracing is off, so nothing is exported.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.metadata
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import agents
import httpx
import pytest

import retrysafe.agents.openai_agents as adapter
from retrysafe import (
    BudgetExceededError,
    ConfigurationError,
    NoActiveRunError,
    RetrysafeError,
)
from retrysafe.agents import (
    AgentCallState,
    AgentRun,
    AgentStore,
    agent_store,
    instrument,
    resume_run,
    start_run,
    tool,
)
from retrysafe.agents.openai_agents import (
    function_tool,
    guard,
    run_agent,
    run_agent_streamed,
    run_agent_sync,
)
from retrysafe.chaos import ChaosProxy
from retrysafe.stores import SQLiteStore

from .conftest import Tickets
from .openai_agents_child import Script, ScriptedModel, create_then_answer, say, tool_call

agents.set_tracing_disabled(True)

ROOT = Path(__file__).resolve().parents[2]
CHILD = str(Path(__file__).with_name("openai_agents_child.py"))
MODULE = Path(adapter.__file__)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    with SQLiteStore(tmp_path / "agent.db") as s:
        yield s


def _agent(script: Script, *tools: Any) -> tuple[agents.Agent[Any], ScriptedModel]:
    model = ScriptedModel(script)
    return agents.Agent(name="support", model=model, tools=list(tools)), model


def _run(agent: agents.Agent[Any], run: AgentRun, step: int = 1) -> Any:
    return asyncio.run(run_agent(agent, "my printer is on fire", run=run, step=step)).final_output


def _same_call_twice(name: str, arguments: dict[str, Any]) -> Script:
    """Turns 1 and 2: the same call, each with a new call id; turn 3: answer."""

    def script(turn: int, outputs: list[str]) -> list[Any]:
        return [tool_call(name, arguments)] if turn <= 2 else [say("done")]

    return script


def _posting_tool(client: httpx.Client, base: str, attempts: int) -> Callable[..., Any]:
    @tool(kind="write", attempts=attempts, wait_initial=0.01, wait_max=0.02)
    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket."""
        r = client.post(f"{base}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    return create_ticket


def _counting_tool(kind: str, *, is_async: bool = False) -> tuple[Callable[..., Any], list[str]]:
    """A create_ticket tool of ``kind`` that counts its runs (in memory)."""
    ran: list[str] = []
    declare: Any = tool(kind=kind)  # type: ignore[call-overload]
    return declare(_async_counter(ran) if is_async else _sync_counter(ran)), ran


def _sync_counter(ran: list[str]) -> Callable[..., Any]:
    def create_ticket(title: str) -> dict[str, str]:
        """Create a support ticket."""
        ran.append(title)
        return {"id": f"T-{len(ran)}"}

    return create_ticket


def _async_counter(ran: list[str]) -> Callable[..., Any]:
    async def create_ticket(title: str) -> dict[str, str]:
        """Create a support ticket."""
        await asyncio.sleep(0)
        ran.append(title)
        return {"id": f"T-{len(ran)}"}

    return create_ticket


# ------------------------------------------------------------------ issue 17: what it must show
def test_same_call_on_two_turns_with_new_call_ids_creates_one_ticket(
    tickets: Tickets, lose_first: ChaosProxy, agent_store: AgentStore
) -> None:
    """The model emits create_ticket on two turns with two call ids while the first answer is
    lost after commit: one ticket, one recorded call, and the model gets T-1 both times."""
    with instrument(httpx.Client(timeout=5)) as client:
        create_ticket = _posting_tool(client, lose_first.url, attempts=3)
        agent, model = _agent(
            _same_call_twice("create_ticket", {"title": "printer on fire"}),
            function_tool(create_ticket),
        )
        run = start_run(agent_store, "oa-two-turns")
        assert _run(agent, run) == "done"
    assert tickets.created("printer on fire") == 1
    assert len(set(model.call_ids)) == 2
    assert len(model.outputs) == 2 and all("T-1" in o for o in model.outputs)
    (call,) = run.calls()
    assert (call.state, call.step) == (AgentCallState.SUCCEEDED, 1)
    assert set(tickets.keys) == {call.key}


def test_killed_mid_call_then_resumed_in_a_new_process(
    slow_tickets: Tickets, tmp_path: Path
) -> None:
    """SIGKILLed after the service committed, resumed in a new process (same run, same step):
    the model's new call id maps to the same key, the call is re-sent with it, one ticket."""
    url = f"sqlite:///{tmp_path / 'agent.db'}"
    args = [sys.executable, CHILD, url, slow_tickets.url, "oa-kill"]
    child = subprocess.Popen([*args, "start"], stdout=subprocess.DEVNULL)
    # the new process starts now, to import while the first one runs; it resumes on "go"
    resumed = subprocess.Popen(
        [*args, "resume"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        # generous: the child imports the Agents SDK, seconds on a loaded 2-core machine
        _wait_for(lambda: slow_tickets.created() >= 1, timeout=60)
        assert not slow_tickets.answered
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
    _wait_for(lambda: bool(slow_tickets.answered))
    with SQLiteStore(tmp_path / "agent.db") as s:
        (killed,) = agent_store(s).list_agent_calls("oa-kill")
    assert killed.state is AgentCallState.RUNNING  # recorded before the first attempt
    out, _ = resumed.communicate("go\n", timeout=30)
    assert resumed.returncode == 0
    seen = json.loads(out.strip().splitlines()[-1])
    assert slow_tickets.created("kill me") == 1
    assert "T-1" in seen["outputs"][-1]
    with SQLiteStore(tmp_path / "agent.db") as s:
        (call,) = agent_store(s).list_agent_calls("oa-kill")
    assert call.key == killed.key and call.state is AgentCallState.SUCCEEDED
    assert set(slow_tickets.keys) == {call.key}


def _wait_for(cond: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_unknown_outcome_reaches_the_model_as_text_with_the_key(
    tickets: Tickets, lose_all: ChaosProxy, store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Every answer lost: both turns' tool outputs say "outcome unknown, key K" (a result, not
    the SDK's error path), the call is not re-sent on turn 2, one ticket."""
    with instrument(httpx.Client(timeout=5)) as client:
        create_ticket = _posting_tool(client, lose_all.url, attempts=2)
        agent, model = _agent(
            _same_call_twice("create_ticket", {"title": "disk full"}), function_tool(create_ticket)
        )
        run = start_run(store)
        with caplog.at_level(logging.WARNING):
            assert _run(agent, run) == "done"
    (call,) = run.calls()
    assert call.state is AgentCallState.UNKNOWN
    assert len(model.outputs) == 2
    assert all(o.startswith(f"outcome unknown, key {call.key}") for o in model.outputs)
    assert tickets.created("disk full") == 1
    assert not [r for r in caplog.records if r.name.startswith("openai.agents")]


def test_resumed_run_reconciles_an_unknown_call_with_its_key(
    tickets: Tickets, lose_all: ChaosProxy, store: SQLiteStore
) -> None:
    """An unknown call, resumed with retry_unknown=True: the model's new call is re-sent with
    the same key, the service replays its answer, still one ticket."""
    with instrument(httpx.Client(timeout=5)) as client:
        create_ticket = _posting_tool(client, lose_all.url, attempts=1)
        agent, _ = _agent(create_then_answer("disk full"), function_tool(create_ticket))
        run = start_run(store, "oa-reconcile")
        assert str(_run(agent, run)).startswith("outcome unknown, key")
        lose_all.heal()
        agent, _ = _agent(create_then_answer("disk full"), function_tool(create_ticket))
        assert "T-1" in _run(agent, resume_run(store, "oa-reconcile", retry_unknown=True))
    assert tickets.created("disk full") == 1
    (call,) = run.calls()
    assert call.state is AgentCallState.SUCCEEDED and set(tickets.keys) == {call.key}


# ------------------------------------------------------------------ keys and steps
@pytest.mark.parametrize("is_async", [False, True], ids=["sync-tool", "async-tool"])
@pytest.mark.parametrize("entry", ["run_agent", "run_agent_sync", "run_agent_streamed"])
def test_every_entry_point_makes_the_run_active_in_tool_calls(
    entry: str, is_async: bool, store: SQLiteStore
) -> None:
    """Sync tools run in the SDK's threads, async ones in its tasks, streamed runs in a task
    of their own: each finds the run and the step, and the repeated call runs once."""
    create_ticket, ran = _counting_tool("write", is_async=is_async)
    agent, model = _agent(_same_call_twice("create_ticket", {"title": "x"}), *guard(create_ticket))
    run = start_run(store)
    if entry == "run_agent":
        result = asyncio.run(run_agent(agent, "hi", run=run, step=1))
    elif entry == "run_agent_sync":
        result = run_agent_sync(agent, "hi", run=run, step=1)
    else:

        async def consume() -> Any:
            streamed = run_agent_streamed(agent, "hi", run=run, step=1)
            async for _ in streamed.stream_events():
                pass
            return streamed

        result = asyncio.run(consume())
    assert result.final_output == "done"
    assert ran == ["x"] and model.outputs == ["{'id': 'T-1'}"] * 2
    (call,) = run.calls()
    assert call.step == 1


def test_another_step_is_another_logical_call(store: SQLiteStore) -> None:
    """The same write in another Runner.run (another step) runs again; the same step again
    (a retried or resumed request) replays it."""
    create_ticket, ran = _counting_tool("write")
    run = start_run(store)
    for step in (1, 2, 1):
        agent, _ = _agent(create_then_answer("x"), function_tool(create_ticket))
        _run(agent, run, step)
    assert len(ran) == 2
    assert [c.step for c in run.calls()] == [1, 2]


def test_read_tools_run_each_time(store: SQLiteStore) -> None:
    """A read tool emitted on two turns runs twice."""
    search, ran = _counting_tool("read")
    agent, model = _agent(_same_call_twice("create_ticket", {"title": "q"}), function_tool(search))
    _run(agent, start_run(store))
    assert ran == ["q", "q"] and model.outputs == ["{'id': 'T-1'}", "{'id': 'T-2'}"]


def test_non_strict_schema_tools_are_wrapped_as_the_sdk_wraps_them() -> None:
    """strict_mode=False: a dict[str, int] parameter (not allowed in strict schemas) is
    accepted, as agents.function_tool accepts it, with the same schema."""

    def tag_counts(counts: dict[str, int]) -> str:
        """Record tag counts."""
        return "ok"

    plain = agents.function_tool(tag_counts, strict_mode=False)
    ours = function_tool(tool(kind="write")(tag_counts), strict_mode=False)
    assert ours.strict_json_schema is False
    assert ours.params_json_schema == plain.params_json_schema


def test_the_model_sees_the_plain_function_tool_schema() -> None:
    """Name, description, parameter schema and strictness equal agents.function_tool's."""

    def create_ticket(title: str, priority: int = 2, tags: list[str] | None = None) -> str:
        """Create a support ticket.

        Args:
            title: what is wrong.
            priority: 1 (urgent) to 4.
            tags: labels for the ticket.
        """
        return title

    plain = agents.function_tool(create_ticket)
    ours = function_tool(tool(kind="write")(create_ticket))
    shape = ("name", "description", "params_json_schema", "strict_json_schema")
    assert {a: getattr(ours, a) for a in shape} == {a: getattr(plain, a) for a in shape}
    assert "priority" in ours.params_json_schema["properties"]
    named = function_tool(name_override="open_ticket")(tool(kind="write")(create_ticket))
    assert named.name == "open_ticket"


# ------------------------------------------------------------------ errors
def test_non_serialisable_argument_is_refused_naming_it(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A parameter the SDK turns into a date cannot be recorded: the model is told which
    argument and it is logged for the developer; nothing runs, nothing is recorded."""
    ran: list[datetime.date] = []

    @tool(kind="write")
    def remind(when: datetime.date) -> str:
        """Set a reminder."""
        ran.append(when)
        return "ok"

    agent, model = _agent(create_then_answer("x"), function_tool(remind))
    model.script = lambda turn, outputs: (
        [tool_call("remind", {"when": "2026-01-05"})] if turn == 1 else [say(outputs[-1])]
    )
    run = start_run(store)
    with caplog.at_level(logging.WARNING, logger="retrysafe.agents"):
        answer = _run(agent, run)
    assert "argument 'when' of tool " in answer and "$.when is a date" in answer
    assert not ran and not run.calls()
    (logged,) = [r.getMessage() for r in caplog.records if r.name == "retrysafe.agents"]
    assert logged.startswith("PayloadError, reported to the model: argument 'when'")


def test_repeat_of_a_failed_call_tells_the_model_it_is_not_run_again(store: SQLiteStore) -> None:
    """A write that failed definitively, emitted again with a new call id: the model gets
    retrysafe's "failed before …; it is not run again" with the key; the tool ran once."""
    ran: list[str] = []

    @tool(kind="write")
    def create_ticket(title: str) -> str:
        """Create a support ticket."""
        ran.append(title)
        raise ValueError("title rejected")

    agent, model = _agent(
        _same_call_twice("create_ticket", {"title": "x"}), function_tool(create_ticket)
    )
    run = start_run(store)
    _run(agent, run)
    (call,) = run.calls()
    first, second = model.outputs
    assert first == agents.default_tool_error_function(None, ValueError())  # type: ignore[arg-type]
    assert second.startswith(f"call {call.key} of ") and "it is not run again" in second
    assert ran == ["x"] and call.state is AgentCallState.FAILED


def test_write_tool_outside_a_run_raises_no_active_run() -> None:
    """Runner.run without a run: the SDK raises, with NoActiveRunError as the cause; the
    model is not told to try again."""
    create_ticket, ran = _counting_tool("write")
    agent, _ = _agent(create_then_answer("x"), function_tool(create_ticket))
    with pytest.raises(agents.exceptions.UserError) as info:
        asyncio.run(agents.Runner.run(agent, "hi"))
    assert isinstance(info.value.__cause__, NoActiveRunError) and not ran


def test_exhausted_budget_raises_out_of_run_agent(store: SQLiteStore) -> None:
    """A step budget of 1 and a second ticket: run_agent raises BudgetExceededError itself."""
    create_ticket, ran = _counting_tool("write")

    def script(turn: int, outputs: list[str]) -> list[Any]:
        return [tool_call("create_ticket", {"title": f"t{turn}"})] if turn <= 2 else [say("x")]

    agent, _ = _agent(script, function_tool(create_ticket))
    with pytest.raises(BudgetExceededError) as info:
        _run(agent, start_run(store, max_steps=1))
    assert info.value.kind == "steps" and ran == ["t1"]


def test_bad_tools_and_steps_are_refused(store: SQLiteStore) -> None:
    """A function without @tool, a tool taking the SDK's context, a step that is not an
    integer >= 1, a run that is not an AgentRun: ConfigurationError naming the option."""

    def plain(title: str) -> str:
        """Not declared."""
        return title

    def with_context(ctx: agents.RunContextWrapper[Any], title: str) -> str:
        """Takes the SDK's context."""
        return title

    with pytest.raises(ConfigurationError, match="is not a retrysafe tool") as e1:
        function_tool(plain)
    with pytest.raises(ConfigurationError, match="takes the SDK's run context"):
        function_tool(tool(kind="write")(with_context))
    agent, _ = _agent(create_then_answer("x"))
    run = start_run(store)
    for step in (0, True, "1"):
        with pytest.raises(ConfigurationError, match="step must be an integer") as e2:
            run_agent_sync(agent, "hi", run=run, step=step)  # type: ignore[arg-type]
        assert e2.value.option == "step"
    with pytest.raises(ConfigurationError, match="AgentRun") as e3:
        run_agent_sync(agent, "hi", run="run-1", step=1)  # type: ignore[arg-type]
    assert (e1.value.option, e3.value.option) == ("fn", "run")


@pytest.mark.parametrize("version", ["0.1.0", "1.0.0", "nightly"])
def test_unsupported_version_is_refused_naming_the_range(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing the adapter with openai-agents outside >=0.2,<1 raises ConfigurationError
    naming the version found and the supported range."""
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: version if name == "openai-agents" else real(name),
    )
    spec = importlib.util.spec_from_file_location("_openai_agents_version_probe", MODULE)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ConfigurationError) as info:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert f"found openai-agents {version}" in str(info.value) and ">=0.2,<1" in str(info.value)
    assert isinstance(info.value, RetrysafeError) and info.value.option == "openai-agents"


def test_missing_sdk_is_an_import_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without openai-agents installed, importing the adapter says what to install."""

    def version(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    spec = importlib.util.spec_from_file_location("_openai_agents_missing_probe", MODULE)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ImportError, match=r"pip install 'retrysafe\[openai-agents\]'"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_import_retrysafe_does_not_import_the_sdk() -> None:
    """`import retrysafe, retrysafe.agents` leaves the SDK unimported (a fresh interpreter)."""
    code = "import sys, retrysafe, retrysafe.agents; print('agents' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ the example
def test_openai_agents_example(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/openai_agents_tickets.py: naive creates 2 tickets, guarded creates 1."""
    spec = importlib.util.spec_from_file_location(
        "example_openai_agents_tickets", ROOT / "examples" / "openai_agents_tickets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "guarded: tickets created = 1" in out and "naive  : tickets created = 2" in out
