"""A LangGraph process for the kill/resume test (run as a script, killed with SIGKILL).

usage: langgraph_child.py guarded|naive STORE_URL CHECKPOINTS SERVICE_URL THREAD start|resume
[SCHEMA]

The graph is ``intake → file_ticket``; ``file_ticket`` POSTs a ticket to SERVICE_URL. The
checkpointer is a ``SqliteSaver`` on the file CHECKPOINTS; ``start`` invokes the thread with a
title, ``resume`` resumes it from its last checkpoint (``invoke(None)``), as a new process
after a crash does. ``guarded`` keys the POST with ``ThreadRuns`` on STORE_URL (SCHEMA: the
PostgreSQL schema of a postgresql:// store) under a 1 s lease, so the resumed process takes
the dead one's call over after at most that long; ``naive`` POSTs plainly. Prints the final
state as one JSON line.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from typing import Any, TypedDict

import httpx
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph

from retrysafe.agents import instrument
from retrysafe.agents.langgraph import ThreadRuns
from retrysafe.stores import open_store


class State(TypedDict, total=False):
    title: str
    ticket: dict[str, Any]


def main() -> None:
    mode, store_url, checkpoints, url, thread, phase = sys.argv[1:7]
    options = {"schema": sys.argv[7]} if len(sys.argv) > 7 else {}
    client = instrument(httpx.Client(timeout=5))

    def post(title: str) -> dict[str, Any]:
        r = client.post(f"{url}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    create_ticket = post
    if mode == "guarded":
        runs = ThreadRuns(open_store(store_url, **options))
        create_ticket = runs.effect(attempts=8, wait_initial=0.05, wait_max=0.2, lease=1.0)(post)

    def intake(state: State) -> State:
        return {"title": state["title"].strip()}

    def file_ticket(state: State) -> State:
        return {"ticket": create_ticket(state["title"])}

    graph = StateGraph(State)
    graph.add_node("intake", intake)
    graph.add_node("file_ticket", file_ticket)
    graph.add_edge(START, "intake")
    graph.add_edge("intake", "file_ticket")
    conn = sqlite3.connect(checkpoints, check_same_thread=False)
    app = graph.compile(checkpointer=SqliteSaver(conn))
    config: Any = {"configurable": {"thread_id": thread}}
    state = app.invoke({"title": " kill me "} if phase == "start" else None, config)
    print(json.dumps(state), flush=True)


if __name__ == "__main__":
    main()
