"""Async tools never block the event loop on the store: every store call of an async tool's
flow (claim, take-over, attempts, renewal, outcome) runs off the loop's thread."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrysafe import SQLiteStore, StoreUnavailableError
from retrysafe.agents import (
    AgentCallState,
    AgentStore,
    OutcomeUnknownError,
    resume_run,
    start_run,
    tool,
)


class _Watched:
    """An agent store that notes each of its methods called on a thread running a loop."""

    def __init__(self, store: AgentStore) -> None:
        self._store = store
        self.on_loop: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                self.on_loop.append(name)
            return attr(*args, **kwargs)

        return call


def test_async_tool_takes_over_and_records_off_the_loop(agent_store: AgentStore) -> None:
    """An async write whose outcome was unknown, re-sent after a resume (a take-over): no
    store call of either invocation ran on the event loop's thread."""
    watched = _Watched(agent_store)
    effects: list[str] = []

    @tool(kind="write", attempts=1, heartbeat=0.05, lease=1.0)
    async def send(text: str) -> str:
        effects.append(text)
        await asyncio.sleep(0.12)  # long enough for a renewal or two
        if len(effects) == 1:
            raise ConnectionError("answer lost")
        return text.upper()

    def in_loop(make: Callable[[], Any]) -> Any:
        async def main() -> Any:
            return await make()

        return asyncio.run(main())

    run = start_run(watched, "r")
    with run, run.step(1), pytest.raises(OutcomeUnknownError):
        in_loop(lambda: send("a"))
    resumed = resume_run(watched, "r", retry_unknown=True)
    with resumed, resumed.step(1):
        assert in_loop(lambda: send("a")) == "A"
    assert effects == ["a", "a"]
    (call,) = resumed.calls()
    assert (call.state, call.fencing_token) == (AgentCallState.SUCCEEDED, 2)
    assert watched.on_loop == []


def test_a_repeat_under_another_process_write_lock_gets_its_stored_result(
    tmp_path: Path,
) -> None:
    """A fresh user's check: while another process kept SQLite's write lock past
    busy_timeout, repeating a call that had already succeeded raised StoreUnavailableError
    (its claim is a write). It now gets the stored result from a read, sync and async tools
    alike, and runs nothing; a new call still needs the write and fails."""
    path = tmp_path / "agent.db"
    store = SQLiteStore(path, busy_timeout=0.2)
    effects: list[str] = []

    @tool(kind="write", attempts=1)
    def create(title: str) -> dict[str, str]:
        effects.append(title)
        return {"id": title}

    @tool(kind="write", attempts=1)
    async def acreate(title: str) -> dict[str, str]:
        effects.append(title)
        return {"id": title}

    async def main() -> None:
        run = start_run(store, "r1")
        with run:
            with run.step(1):
                assert create("t1") == {"id": "t1"}
                assert await acreate("t2") == {"id": "t2"}
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                with run.step(1):
                    assert create("t1") == {"id": "t1"}
                    assert await acreate("t2") == {"id": "t2"}
                    with pytest.raises(StoreUnavailableError):
                        await acreate("t3")
            finally:
                holder.execute("ROLLBACK")
                holder.close()

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert effects == ["t1", "t2"]
