"""The LangGraph adapter (SPEC §7, issue 17): a node's or tool's effect keyed by the thread,
the node's step and the arguments, so a resumed, retried or re-run node never repeats it.

The ticket service is ``conftest.Tickets`` behind the idempotency middleware (and the chaos
proxy where answers get lost); graphs use LangGraph's own checkpointers.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import operator
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, RetryPolicy, interrupt

from retrysafe import ConfigurationError, PayloadError
from retrysafe.agents import (
    AgentCallState,
    AgentError,
    NoActiveRunError,
    OutcomeUnknownError,
    instrument,
    tool,
)
from retrysafe.agents.langgraph import SUPPORTED, ThreadRuns
from retrysafe.chaos import ChaosProxy
from retrysafe.stores import SQLiteStore

from .conftest import StoreSpec, Tickets

CHILD = str(Path(__file__).with_name("langgraph_child.py"))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langgraph_tickets.py"
THREAD: Any = {"configurable": {"thread_id": "thread-1"}}


class State(TypedDict, total=False):
    title: str
    ticket: dict[str, Any]
    answers: Annotated[list[str], operator.add]


class Messages(TypedDict):
    messages: Annotated[list[Any], operator.add]


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[ThreadRuns]:
    """ThreadRuns on a fresh SQLite store."""
    with SQLiteStore(tmp_path / "agent.db") as store:
        yield ThreadRuns(store)


def poster(url: str) -> Callable[[str], dict[str, Any]]:
    """``create_ticket(title)``: POST /tickets, carrying the call's key when keyed."""
    client = instrument(httpx.Client(timeout=5))

    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket."""
        r = client.post(f"{url}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    return create_ticket


def one_node(node: Any, **compile_options: Any) -> Any:
    """``START → node`` (a node function) with an in-memory checkpointer."""
    graph = StateGraph(State)
    graph.add_node("file_ticket", node, **compile_options.pop("node_options", {}))
    graph.add_edge(START, "file_ticket")
    return graph.compile(checkpointer=InMemorySaver(), **compile_options)


def approving(create_ticket: Callable[[str], dict[str, Any]]) -> Any:
    """A node that asks a human before and after creating the ticket (``interrupt()``);
    typed Any, as LangGraph's node protocols want a parameter named ``state``."""

    def file_ticket(state: State) -> State:
        before = interrupt("create it?")
        ticket = create_ticket(state["title"])
        after = interrupt(f"{ticket['id']} created; notify the customer?")
        return {"ticket": ticket, "answers": [before, after]}

    return file_ticket


# ----------------------------------------------------------------------------- resumes
@pytest.mark.parametrize(("keyed", "expected"), [(False, 2), (True, 1)])
def test_interrupts_before_and_after_the_ticket_resumed_twice(
    keyed: bool, expected: int, tickets: Tickets, agent_store_spec: StoreSpec
) -> None:
    """A node that interrupts before and after creating a ticket, resumed twice: LangGraph
    re-runs it from its start, so a plain call makes 2 tickets and a keyed one 1."""
    create_ticket = poster(tickets.url)
    with agent_store_spec.open() as store:
        runs = ThreadRuns(store)
        if keyed:
            create_ticket = runs.effect(create_ticket)
        app = one_node(approving(create_ticket))
        app.invoke({"title": "printer on fire"}, THREAD)
        app.invoke(Command(resume="yes"), THREAD)
        state = app.invoke(Command(resume="yes"), THREAD)
        calls = runs.calls("thread-1")
    assert tickets.created("printer on fire") == expected
    assert state["ticket"]["id"] == f"T-{expected}"
    if keyed:
        (call,) = calls
        assert (call.state, call.step, call.run_id) == (
            AgentCallState.SUCCEEDED,
            1,
            "langgraph:thread-1",
        )
        assert set(tickets.keys) == {call.key}


def test_static_interrupts_around_the_node(runs: ThreadRuns, tickets: Tickets) -> None:
    """``interrupt_before`` / ``interrupt_after`` around a node that also interrupts inside:
    four invocations of the thread, one ticket, and the resumed node sees the first ticket."""
    create_ticket = runs.effect(poster(tickets.url))

    def file_ticket(state: State) -> State:
        ticket = create_ticket(state["title"])
        return {"ticket": ticket, "answers": [interrupt("notify?")]}

    app = one_node(file_ticket, interrupt_before=["file_ticket"], interrupt_after=["file_ticket"])
    app.invoke({"title": "printer"}, THREAD)  # stops before the node
    app.invoke(None, THREAD)  # runs it up to interrupt()
    app.invoke(Command(resume="yes"), THREAD)  # runs it again, stops after it
    state = app.invoke(None, THREAD)
    assert tickets.created() == 1
    assert state["ticket"] == {"id": "T-1", "title": "printer"}


def test_node_retried_by_its_retry_policy(runs: ThreadRuns, tickets: Tickets) -> None:
    """A node that fails after its effect and is retried by a ``RetryPolicy`` gets the
    stored ticket back: one ticket, the same id in both executions."""
    create_ticket = runs.effect(poster(tickets.url))
    seen: list[str] = []

    def file_ticket(state: State) -> State:
        ticket = create_ticket(state["title"])
        seen.append(ticket["id"])
        if len(seen) == 1:
            raise RuntimeError("the step after the effect failed")
        return {"ticket": ticket}

    policy = RetryPolicy(max_attempts=2, initial_interval=0.01, jitter=False, retry_on=RuntimeError)
    app = one_node(file_ticket, node_options={"retry_policy": policy})
    app.invoke({"title": "printer"}, THREAD)
    assert seen == ["T-1", "T-1"]
    assert tickets.created() == 1


def test_lost_checkpoints_do_not_change_the_key(runs: ThreadRuns, tickets: Tickets) -> None:
    """A thread whose checkpoints were lost (``durability="async"`` writes them in the
    background) and that is re-run from its input counts the same steps, so the re-run gets
    the stored ticket: keys never depend on checkpoint or task ids."""
    create_ticket = runs.effect(poster(tickets.url))

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    one_node(file_ticket).invoke({"title": "printer"}, THREAD)
    again = one_node(file_ticket).invoke({"title": "printer"}, THREAD)  # new checkpointer
    assert again["ticket"]["id"] == "T-1"
    assert tickets.created() == 1


def test_functional_task_resumed_after_its_interrupt(runs: ThreadRuns, tickets: Tickets) -> None:
    """An ``@task`` that creates a ticket and then interrupts re-runs on resume; keyed, it
    gets the stored ticket back."""
    create_ticket = runs.effect(poster(tickets.url))

    @task
    def file_ticket(title: str) -> dict[str, Any]:
        ticket = create_ticket(title)
        interrupt("notify?")
        return ticket

    @entrypoint(checkpointer=InMemorySaver())
    def workflow(title: str) -> dict[str, Any]:
        result: dict[str, Any] = file_ticket(title).result()
        return result

    workflow.invoke("printer", THREAD)
    assert workflow.invoke(Command(resume="yes"), THREAD) == {"id": "T-1", "title": "printer"}
    assert tickets.created() == 1


def test_async_node_and_tool_resumed(runs: ThreadRuns, tickets: Tickets) -> None:
    """An async effect in an async node, resumed twice through ``ainvoke``: one ticket."""
    client = instrument(httpx.AsyncClient(timeout=5))

    @runs.effect
    async def create_ticket(title: str) -> dict[str, Any]:
        r = await client.post(f"{tickets.url}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    async def file_ticket(state: State) -> State:
        before = interrupt("create it?")
        ticket = await create_ticket(state["title"])
        return {"ticket": ticket, "answers": [before, interrupt("notify?")]}

    async def drive() -> State:
        app = one_node(file_ticket)
        await app.ainvoke({"title": "printer"}, THREAD)
        await app.ainvoke(Command(resume="yes"), THREAD)
        state: State = await app.ainvoke(Command(resume="yes"), THREAD)
        await client.aclose()
        return state

    assert asyncio.run(drive())["ticket"]["id"] == "T-1"
    assert tickets.created() == 1


def test_resume_marks_a_stopped_process_calls_unknown(runs: ThreadRuns) -> None:
    """``runs.resume(thread)`` turns the calls a stopped process left RUNNING into UNKNOWN at
    once: the re-run node reports unknown instead of waiting out the 30 s lease."""
    entered, gate = threading.Event(), threading.Event()

    @runs.effect
    def create_ticket(title: str) -> dict[str, Any]:
        entered.set()
        gate.wait(5)
        return {"id": "T-1"}

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    app = one_node(file_ticket)

    raised: list[BaseException] = []

    def stuck() -> None:
        try:
            app.invoke({"title": "printer"}, THREAD)
        except AgentError as exc:
            raised.append(exc)

    worker = threading.Thread(target=stuck)
    worker.start()
    assert entered.wait(5)
    runs.resume("thread-1")
    gate.set()
    worker.join(5)
    assert "taken over" in str(raised[0])  # the stopped claimant's late result is dropped
    started = time.monotonic()
    with pytest.raises(OutcomeUnknownError):
        app.invoke(None, THREAD)
    assert time.monotonic() - started < 5
    assert [c.state for c in runs.calls("thread-1")] == [AgentCallState.UNKNOWN]


# ----------------------------------------------------------------------------- new calls
def test_new_turn_with_the_same_arguments_is_a_new_call(runs: ThreadRuns, tickets: Tickets) -> None:
    """Invoking the thread again (another user message) runs the node at a later step:
    the same arguments make a second logical call and a second ticket."""
    app = one_node(approving(runs.effect(poster(tickets.url))))
    for _turn in range(2):
        app.invoke({"title": "printer"}, THREAD)
        app.invoke(Command(resume="yes"), THREAD)
        app.invoke(Command(resume="yes"), THREAD)
    first, second = runs.calls("thread-1")
    assert second.step > first.step
    assert first.key != second.key
    assert tickets.created("printer") == 2


def test_dedupe_run_makes_later_turns_the_same_call(runs: ThreadRuns, tickets: Tickets) -> None:
    """A tool declared ``dedupe="run"`` is one call per thread for the same arguments,
    whatever the turn: one ticket over two turns."""
    create_ticket = runs.effect(dedupe="run")(poster(tickets.url))

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    app = one_node(file_ticket)
    app.invoke({"title": "printer"}, THREAD)
    assert app.invoke({"title": "printer"}, THREAD)["ticket"]["id"] == "T-1"
    assert tickets.created() == 1


def test_subgraph_calls_are_named_by_their_invocation(runs: ThreadRuns, tickets: Tickets) -> None:
    """A subgraph counts its steps afresh on every invocation: its resumed node gets the
    stored ticket, and its invocation in the next turn (same step, same arguments) a new one."""
    sub = StateGraph(State)
    sub.add_node("file_ticket", approving(runs.effect(poster(tickets.url))))
    sub.add_edge(START, "file_ticket")
    parent = StateGraph(State)
    parent.add_node("support", sub.compile())
    parent.add_edge(START, "support")
    app = parent.compile(checkpointer=InMemorySaver())
    app.invoke({"title": "printer"}, THREAD)
    app.invoke(Command(resume="yes"), THREAD)
    app.invoke(Command(resume="yes"), THREAD)
    assert tickets.created() == 1
    app.invoke({"title": "printer"}, THREAD)
    app.invoke(Command(resume="yes"), THREAD)
    first, second = runs.calls("thread-1")
    assert first.step == second.step
    assert tickets.created() == 2


# ----------------------------------------------------------------------------- ToolNode
def tool_calls(*call_ids: str) -> dict[str, Any]:
    """A model message calling create_ticket("printer") once per tool-call id."""
    calls = [{"name": "create_ticket", "args": {"title": "printer"}, "id": i} for i in call_ids]
    return {"messages": [AIMessage("", tool_calls=calls)]}


def tool_graph(tools: list[Callable[..., Any]]) -> Any:
    graph = StateGraph(Messages)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "tools")
    return graph.compile(checkpointer=InMemorySaver())


def test_tool_node_emitting_one_call_under_two_ids(runs: ThreadRuns, tickets: Tickets) -> None:
    """A ToolNode given the same create_ticket call twice, with different tool-call ids,
    creates one ticket and answers both with it (the model's ids are never the key)."""
    app = tool_graph(runs.tools(tool(kind="write")(poster(tickets.url))))
    out = app.invoke(tool_calls("call_a", "call_b"), THREAD)
    answers = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [json.loads(str(m.content))["id"] for m in answers] == ["T-1", "T-1"]
    assert tickets.created() == 1


def test_tool_node_reports_an_unknown_outcome_with_its_key(
    runs: ThreadRuns, tickets: Tickets, lose_all: ChaosProxy
) -> None:
    """Every answer lost: the ToolNode answers the model "outcome unknown, key K" (not an
    error, and the graph goes on), K being the recorded call's key; one ticket."""
    create_ticket = tool(kind="write", attempts=2, wait_initial=0.01)(poster(lose_all.url))
    out = tool_graph(runs.tools(create_ticket)).invoke(tool_calls("call_a"), THREAD)
    (call,) = runs.calls("thread-1")
    (answer,) = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert call.state is AgentCallState.UNKNOWN
    assert str(answer.content).startswith(f"outcome unknown, key {call.key}")
    assert tickets.created() == 1


def test_model_asking_again_after_unknown_in_a_tool_loop_creates_one_ticket(
    runs: ThreadRuns, tickets: Tickets, lose_first: ChaosProxy
) -> None:
    """agent → ToolNode → agent in one invoke: the first create_ticket loses its answer and
    is reported unknown; the scripted model asks again on its next turn (a new step, a new
    tool-call id). The second call joins the UNKNOWN one: reported unknown with the same key,
    nothing sent, one ticket (issue langchain-ai/langgraph#6577's failure, SPEC §0)."""
    create_ticket = tool(kind="write", attempts=1)(poster(lose_first.url))
    turns: list[int] = []

    def agent(state: Messages) -> dict[str, Any]:
        turns.append(1)
        if len(turns) <= 2:  # ask for the ticket, then ask again after "outcome unknown"
            return tool_calls(f"call_{len(turns)}")
        return {"messages": [AIMessage("done")]}

    graph = StateGraph(Messages)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(runs.tools(create_ticket)))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges(
        "agent", lambda s: "tools" if s["messages"][-1].tool_calls else "__end__"
    )
    graph.add_edge("tools", "agent")
    out = graph.compile(checkpointer=InMemorySaver()).invoke({"messages": []}, THREAD)
    answers = [str(m.content) for m in out["messages"] if isinstance(m, ToolMessage)]
    (call,) = runs.calls("thread-1")
    assert call.state is AgentCallState.UNKNOWN
    assert answers == [answers[0]] * 2 and answers[0].startswith(f"outcome unknown, key {call.key}")
    assert tickets.created() == 1


# ----------------------------------------------------------------------------- unknown
def unknown_node(runs: ThreadRuns, url: str) -> Any:
    create_ticket = runs.effect(attempts=2, wait_initial=0.01)(poster(url))

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    return one_node(file_ticket)


def test_plain_node_raises_unknown_and_a_rerun_does_not_resend(
    runs: ThreadRuns, tickets: Tickets, lose_all: ChaosProxy
) -> None:
    """In a plain node an unknown outcome is OutcomeUnknownError with the key; resuming the
    thread raises it again without sending the request again."""
    app = unknown_node(runs, lose_all.url)
    with pytest.raises(OutcomeUnknownError) as first:
        app.invoke({"title": "printer"}, THREAD)
    sent = len(tickets.keys)
    with pytest.raises(OutcomeUnknownError) as again:
        app.invoke(None, THREAD)
    assert again.value.key == first.value.key == runs.calls("thread-1")[0].key
    assert len(tickets.keys) == sent
    assert tickets.created() == 1


def test_unknown_reconciled_with_retry_unknown(
    tmp_path: Path, tickets: Tickets, lose_all: ChaosProxy
) -> None:
    """Once the network heals, resuming the thread under ``retry_unknown=True`` re-sends
    the call with its same key: the service replays T-1, still one ticket."""
    with SQLiteStore(tmp_path / "agent.db") as store:
        app = unknown_node(ThreadRuns(store), lose_all.url)
        with pytest.raises(OutcomeUnknownError):
            app.invoke({"title": "printer"}, THREAD)
        lose_all.heal()
        app_again = unknown_node(ThreadRuns(store, retry_unknown=True), lose_all.url)
        app_again.checkpointer = app.checkpointer  # the same thread's checkpoints
        state = app_again.invoke(None, THREAD)
    assert state["ticket"] == {"id": "T-1", "title": "printer"}
    assert len(set(tickets.keys)) == 1
    assert tickets.created() == 1


# ----------------------------------------------------------------------------- bad input
def test_non_serialisable_argument_is_named(runs: ThreadRuns, tickets: Tickets) -> None:
    """An argument JSON cannot hold raises PayloadError naming it and its path; nothing is
    recorded or sent."""

    @runs.effect
    def schedule(title: str, when: object) -> dict[str, Any]:
        return poster(tickets.url)(title)

    def file_ticket(state: State) -> State:
        return {"ticket": schedule(state["title"], when={"at": object()})}

    with pytest.raises(PayloadError, match=r"argument 'when' of tool") as err:
        one_node(file_ticket).invoke({"title": "printer"}, THREAD)
    assert err.value.path == "$.when.at"
    assert runs.calls("thread-1") == []
    assert tickets.created() == 0


def test_graph_without_a_thread_id(runs: ThreadRuns, tickets: Tickets) -> None:
    """A write tool in a graph invoked without a thread_id raises NoActiveRunError saying
    what to do; nothing is sent."""
    create_ticket = runs.effect(poster(tickets.url))

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    graph = StateGraph(State)
    graph.add_node("file_ticket", file_ticket)
    graph.add_edge(START, "file_ticket")
    with pytest.raises(NoActiveRunError, match="thread_id"):
        graph.compile().invoke({"title": "printer"})
    assert tickets.created() == 0


def test_a_thread_id_cannot_name_another_threads_hashed_run(
    runs: ThreadRuns, tickets: Tickets
) -> None:
    """A thread id that is hashed (it has a space) and a thread id spelling that hash
    literally are two threads: the second does not get the first's ticket."""
    app = one_node(lambda state: {"ticket": runs.effect(poster(tickets.url))(state["title"])})
    victim = "tenant a/x1"
    app.invoke({"title": "printer"}, {"configurable": {"thread_id": victim}})
    spelled = runs.run_id(victim)[len("langgraph:") :]
    assert spelled.startswith("sha256:")
    app.invoke({"title": "printer"}, {"configurable": {"thread_id": spelled}})
    assert runs.run_id(spelled) != runs.run_id(victim)
    assert tickets.created() == 2


def test_an_empty_thread_id_is_refused(runs: ThreadRuns, tickets: Tickets) -> None:
    """thread_id "" would make every such thread one run: refused, nothing sent."""
    app = one_node(lambda state: {"ticket": runs.effect(poster(tickets.url))(state["title"])})
    with pytest.raises(ConfigurationError, match="thread_id is empty"):
        app.invoke({"title": "printer"}, {"configurable": {"thread_id": ""}})
    assert tickets.created() == 0


def test_keyed_needs_a_declared_tool(runs: ThreadRuns) -> None:
    """``keyed`` refuses a function not declared read or write (SPEC §7)."""
    with pytest.raises(ConfigurationError, match="not a retrysafe tool"):
        runs.keyed(print)


def test_unsupported_langgraph_version_names_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the adapter under an unsupported LangGraph raises ConfigurationError naming
    the installed version and the supported range."""
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.1.0" if name == "langgraph" else real(name),
    )
    path = Path(__file__).resolve().parents[2] / "src/retrysafe/agents/langgraph.py"
    spec = importlib.util.spec_from_file_location("langgraph_adapter_copy", path)
    assert spec is not None and spec.loader is not None
    with pytest.raises(ConfigurationError) as err:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "found langgraph 0.1.0" in str(err.value)
    assert SUPPORTED in str(err.value)


def test_retrysafe_agents_does_not_import_langgraph() -> None:
    """``import retrysafe`` and ``import retrysafe.agents`` leave LangGraph unimported."""
    code = "import retrysafe, retrysafe.agents, sys; print('langgraph' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- crash
def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_killed_in_the_node_and_resumed_from_the_checkpointer(
    tmp_path: Path, slow_tickets: Tickets
) -> None:
    """SIGKILLed in the node after the service committed, the thread resumed from its
    SqliteSaver file in a new process: the call is taken over once its 1 s lease ends and
    re-sent with its key, so one ticket, and the resumed graph holds T-1."""
    store_url = f"sqlite:///{tmp_path / 'agent.db'}"
    checkpoints = str(tmp_path / "checkpoints.db")
    args = [CHILD, "guarded", store_url, checkpoints, slow_tickets.url, "thread-k"]
    child = subprocess.Popen([sys.executable, *args, "start"], stdout=subprocess.PIPE)
    try:
        _wait_for(lambda: slow_tickets.created() >= 1, timeout=60)  # imports LangGraph first
        assert not slow_tickets.answered
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
        assert child.stdout is not None
        child.stdout.close()
    with SQLiteStore(tmp_path / "agent.db") as store:
        (killed,) = ThreadRuns(store).calls("thread-k")
    assert killed.state is AgentCallState.RUNNING  # recorded before the attempt
    out = subprocess.run(
        [sys.executable, *args, "resume"], capture_output=True, text=True, timeout=60, check=True
    )
    state = json.loads(out.stdout.strip().splitlines()[-1])
    with SQLiteStore(tmp_path / "agent.db") as store:
        (call,) = ThreadRuns(store).calls("thread-k")
    assert state["ticket"] == {"id": "T-1", "title": "kill me"}
    assert (call.key, call.state) == (killed.key, AgentCallState.SUCCEEDED)
    assert set(slow_tickets.keys) == {call.key}
    assert slow_tickets.created() == 1


# ----------------------------------------------------------------------------- example
def test_example(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/langgraph_tickets.py: the plain node creates 2 tickets, the keyed one 1."""
    spec = importlib.util.spec_from_file_location("example_langgraph_tickets", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # LangGraph reads the State annotations from it
    spec.loader.exec_module(module)
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "plain node: tickets created = 2" in out
    assert out.rstrip().endswith("tickets created = 1")
