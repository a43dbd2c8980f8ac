"""Kill the agent process mid-call (SIGKILL), resume the run in a new process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from retrysafe.agents import AgentCallState, agent_store

from .conftest import StoreSpec, Tickets

CHILD = str(Path(__file__).with_name("agent_child.py"))


def _wait_for(cond: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def _kill_mid_call(args: list[str], tickets: Tickets, env: dict[str, str] | None = None) -> float:
    """Start the child, SIGKILL it once the service committed but before it answered.
    Returns when it was killed (Unix seconds)."""
    child = subprocess.Popen(
        [sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        # generous: the child imports first, seconds on a loaded 2-core machine
        _wait_for(lambda: tickets.created() >= 1, timeout=60)
        assert not tickets.answered
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
    killed_at = time.time()
    _wait_for(lambda: bool(tickets.answered))  # the service finished its request
    return killed_at


def _run(args: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, CHILD, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    result: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("mode", "expected"), [("naive", 2), ("guarded", 1)])
def test_killed_mid_call_then_resumed(
    mode: str, expected: int, slow_tickets: Tickets, agent_store_spec: StoreSpec
) -> None:
    """Killed after the service committed, resumed in a new process: the naive agent creates
    two tickets, the guarded one creates one and gets its answer."""
    spec = agent_store_spec
    args = [mode, spec.url, slow_tickets.url, "run-kill"]
    schema = [] if spec.schema is None else [spec.schema]
    _kill_mid_call([*args, "start", *schema], slow_tickets)
    if mode == "guarded":
        with spec.open() as store:
            (call,) = agent_store(store).list_agent_calls("run-kill")
            assert call.state is AgentCallState.RUNNING  # recorded before the attempt
    result = _run([*args, "resume", *schema])
    assert result["title"] == "kill me"
    assert slow_tickets.created("kill me") == expected
    if mode == "guarded":
        with spec.open() as store:
            (call,) = agent_store(store).list_agent_calls("run-kill")
        assert call.state is AgentCallState.SUCCEEDED
        assert set(slow_tickets.keys) == {call.key}
        assert result["id"] == "T-1"


def test_killed_mid_call_is_taken_over_once_its_short_lease_ends(
    slow_tickets: Tickets, agent_store_spec: StoreSpec
) -> None:
    """Killed mid-call while renewing a 2 s lease: another process of the same run (joined,
    not resumed: nothing is interrupted) waits until that lease ends, then takes the call over
    and re-sends it with the same key: one ticket, and the first answer."""
    spec = agent_store_spec
    args = ["guarded", spec.url, slow_tickets.url, "run-join"]
    schema = [] if spec.schema is None else [spec.schema]
    env = {**os.environ, "AGENT_CHILD_LEASE": "2"}
    killed_at = _kill_mid_call([*args, "start", *schema], slow_tickets, env)
    with spec.open() as store:
        (killed,) = agent_store(store).list_agent_calls("run-join")
    assert killed.state is AgentCallState.RUNNING
    assert killed.lease_expires_at > killed_at  # renewed up to the kill: a duplicate must wait
    result = _run([*args, "join", *schema], env)
    with spec.open() as store:
        (call,) = agent_store(store).list_agent_calls("run-join")
    assert (call.state, call.fencing_token) == (AgentCallState.SUCCEEDED, 2)
    assert call.finished_at is not None
    assert killed.lease_expires_at <= call.finished_at < killed.lease_expires_at + 5
    assert slow_tickets.created("kill me") == 1
    assert set(slow_tickets.keys) == {call.key}
    assert result == {"id": "T-1", "title": "kill me"}
