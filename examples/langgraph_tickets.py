"""LangGraph: a node that creates a ticket, then waits for a human (``pip install
'retrysafe[langgraph]'``).

LangGraph resumes an interrupted node by running it again from its start
(langchain-ai/langgraph#6577), so the ticket created before ``interrupt()`` is created again on
resume. ``ThreadRuns.effect`` keys the call by the thread, the node's step and the arguments:
the re-run gets the stored ticket back.

    python examples/langgraph_tickets.py      # no network, no model: prints both graphs' counts
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.types import Command, interrupt

from retrysafe.agents.langgraph import ThreadRuns


class State(TypedDict, total=False):
    title: str
    ticket: dict[str, Any]
    notified: bool


def build(create_ticket: Callable[[str], dict[str, Any]]) -> Any:
    """``START → file_ticket``: a human reviews the request before the node runs
    (``interrupt_before``) and approves the notification inside it (``interrupt()``)."""

    def file_ticket(state: State) -> State:
        ticket = create_ticket(state["title"])  # the effect
        answer = interrupt(f"ticket {ticket['id']} created; notify the customer?")
        return {"ticket": ticket, "notified": answer == "yes"}  # the resume re-ran the node

    graph = StateGraph(State)
    graph.add_node("file_ticket", file_ticket)
    graph.add_edge(START, "file_ticket")
    return graph.compile(checkpointer=InMemorySaver(), interrupt_before=["file_ticket"])


def drive(app: Any, thread: str) -> State:
    """Submit, approve the request, approve the notification."""
    config: Any = {"configurable": {"thread_id": thread}}
    app.invoke({"title": "printer on fire"}, config)  # stops before file_ticket
    app.invoke(None, config)  # file_ticket runs, creates the ticket, interrupts
    state: State = app.invoke(Command(resume="yes"), config)  # file_ticket runs again
    return state


def main() -> int:
    created: list[str] = []

    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket (here: a list; in life: an API call)."""
        created.append(title)
        return {"id": f"T-{len(created)}", "title": title}

    drive(build(create_ticket), "naive")
    print(f"plain node: tickets created = {len(created)}")

    created.clear()
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadRuns(f"sqlite:///{Path(tmp) / 'agent.db'}") as runs:
            keyed = runs.effect(name="create_ticket")(create_ticket)
            state = drive(build(keyed), "thread-1")
            for c in runs.calls("thread-1"):
                print(f"  step {c.step} {c.tool} {c.state.value} {c.key[:18]}… {c.result_summary}")
        print(f"keyed node: {state['ticket']['id']}, notified={state['notified']}")
    print(f"tickets created = {len(created)}")
    return 0 if len(created) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
