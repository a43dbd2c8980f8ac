"""Lease renewal of agent calls (SPEC §3 "Lease renewal", §7): a live call keeps its short
lease however long the tool runs, a dead or wedged one loses it, and a claimant that lost its
call writes nothing and is told so with the key."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from retrysafe import ConfigurationError, RetrysafeWarning
from retrysafe.agents import (
    AgentCallState,
    AgentError,
    AgentStore,
    current_call_key,
    start_run,
    tool,
)


def _wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_slow_write_keeps_its_lease_while_duplicates_are_retried(
    agent_store: AgentStore,
) -> None:
    """A write tool with lease=2 that runs 5 s, duplicated every 0.5 s from other threads:
    one effect; every duplicate waits for it (in progress) and gets its result; a repeat
    afterwards returns the stored result."""
    effects: list[float] = []

    @tool(kind="write", lease=2)
    def send(text: str) -> dict[str, Any]:
        effects.append(time.time())
        time.sleep(5.0)
        return {"sent": text, "effects": len(effects)}

    def timed_send() -> tuple[dict[str, Any], float]:
        result = send("hi")
        return result, time.time()

    with start_run(agent_store) as run, run.step(1), ThreadPoolExecutor(16) as pool:
        first = pool.submit(contextvars.copy_context().run, timed_send)
        _wait_for(lambda: bool(effects))
        duplicates: list[Future[tuple[dict[str, Any], float]]] = []
        samples: list[tuple[AgentCallState, int, float, float]] = []
        while not first.done():
            time.sleep(0.5)
            duplicates.append(pool.submit(contextvars.copy_context().run, timed_send))
            (row,) = run.calls()
            samples.append((row.state, row.fencing_token, row.lease_expires_at, time.time()))
        result, finished_at = first.result()
        answers = [d.result(timeout=5) for d in duplicates]
        assert send("hi") == result  # a repeat afterwards: the stored result
    assert len(effects) == 1
    assert result == {"sent": "hi", "effects": 1}
    assert len(duplicates) >= 8  # retried for longer than twice the lease
    # The call is recorded SUCCEEDED just before it returns, so the last samples (one, or
    # two on a loaded host) may see it finished; before them, every one saw it running.
    running = list(samples)
    while running and running[-1][0] is AgentCallState.SUCCEEDED:
        running.pop()
    assert len(samples) - len(running) <= 2 and len(running) >= 6, samples
    for state, token, lease_end, seen in running:
        assert (state, token) == (AgentCallState.RUNNING, 1)
        assert lease_end > seen  # renewed: never expired while the tool ran
    for answer, returned_at in answers:
        assert answer == result
        assert returned_at >= finished_at - 0.05  # waited for the first call (in progress)
    (row,) = run.calls()
    assert (row.state, row.fencing_token, row.attempts) == (AgentCallState.SUCCEEDED, 1, 1)


def test_slow_async_write_keeps_its_lease_on_the_event_loop(agent_store: AgentStore) -> None:
    """An async write tool that runs for almost three leases, with concurrent duplicate
    tasks polling it: renewed on the event loop, one effect, one result for all."""
    effects: list[str] = []

    @tool(kind="write", lease=0.3)
    async def send(text: str) -> str:
        effects.append(text)
        await asyncio.sleep(0.8)
        return text

    async def main() -> list[str]:
        async with start_run(agent_store) as run:
            with run.step(1):
                first = asyncio.create_task(send("hi"))
                await asyncio.sleep(0.05)
                return [*await asyncio.gather(*(send("hi") for _ in range(3))), await first]

    assert asyncio.run(main()) == ["hi"] * 4
    assert effects == ["hi"]


def test_renewal_stops_after_max_run_time(agent_store: AgentStore) -> None:
    """A call still running past max_run_time stops renewing: a duplicate takes it over
    once the lease ends, and the wedged claimant is refused its late result."""
    effects: list[str] = []
    release = threading.Event()

    @tool(kind="write", lease=0.3, max_run_time=0.2)
    def send(text: str) -> str:
        effects.append(text)
        if len(effects) == 1:
            release.wait(5)
        return f"{text} #{len(effects)}"

    with start_run(agent_store) as run, run.step(1), ThreadPoolExecutor(1) as pool:
        wedged = pool.submit(contextvars.copy_context().run, send, "hi")
        _wait_for(lambda: bool(effects))
        assert send("hi") == "hi #2"  # waited for the lease to end, then took over
        release.set()
        with pytest.raises(AgentError, match="taken over") as info:
            wedged.result(timeout=5)
    (row,) = run.calls()
    assert info.value.key == row.key
    assert (row.state, row.fencing_token, row.result) == (AgentCallState.SUCCEEDED, 2, "hi #2")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.seen.set()


def _steal(store: AgentStore) -> None:
    """Take the running call over as another claimant would after its lease ended."""
    key = current_call_key()
    assert key is not None
    row = store.get_agent_call(key)
    assert row is not None
    far = time.time() + 3600  # on the thief's clock the lease has long expired
    token = store.take_over_agent_call(
        key,
        row.fencing_token,
        owner="thief",
        lease_expires_at=far + 60,
        now=far,
        allow_unknown=False,
    )
    assert token == row.fencing_token + 1


def test_lost_lease_is_logged_and_the_late_result_is_not_recorded(
    agent_store: AgentStore,
) -> None:
    """A renewal that finds the call taken over is logged at ERROR with run and key; the
    tool's late result is not written and the caller gets AgentError with the key."""
    handler = _Records()
    logging.getLogger("retrysafe.agents").addHandler(handler)

    @tool(kind="write", lease=0.3)
    def send(text: str) -> str:
        _steal(agent_store)
        assert handler.seen.wait(5)  # the next renewal noticed
        return text

    try:
        with start_run(agent_store) as run, run.step(1), pytest.raises(AgentError) as info:
            send("hi")
    finally:
        logging.getLogger("retrysafe.agents").removeHandler(handler)
    (row,) = run.calls()
    assert info.value.key == row.key and info.value.run_id == run.id
    assert "taken over" in str(info.value) and "not recorded" in str(info.value)
    (record,) = handler.records
    assert row.key in record.getMessage() and run.id in record.getMessage()
    assert (record.key, record.run_id) == (row.key, run.id)  # type: ignore[attr-defined]
    assert (row.state, row.owner, row.result_json) == (AgentCallState.RUNNING, "thief", None)


def test_fenced_finish_is_reported_even_before_a_renewal_noticed(
    agent_store: AgentStore,
) -> None:
    """Taken over between two renewals: the fenced finish refuses the result, and the caller
    is told with the key (nothing is silently dropped)."""

    @tool(kind="write", lease=30)
    def send(text: str) -> str:
        _steal(agent_store)
        return text

    with start_run(agent_store) as run, run.step(1), pytest.raises(AgentError) as info:
        send("hi")
    (row,) = run.calls()
    assert info.value.key == row.key
    assert (row.state, row.fencing_token, row.result_json) == (AgentCallState.RUNNING, 2, None)


def test_an_error_after_losing_the_call_is_not_recorded(agent_store: AgentStore) -> None:
    """A tool that fails after its call was taken over records nothing; the caller gets
    AgentError (taken over) chained to the tool's error."""

    @tool(kind="write", lease=30)
    def send(text: str) -> str:
        _steal(agent_store)
        raise ValueError("boom")

    with start_run(agent_store) as run, run.step(1), pytest.raises(AgentError) as info:
        send("hi")
    assert isinstance(info.value.__cause__, ValueError)
    (row,) = run.calls()
    assert (row.state, row.error) == (AgentCallState.RUNNING, None)


def test_default_lease_is_short_and_renewed() -> None:
    """By default a call holds 30 s without renewal and renews every 10 s for up to an hour."""

    @tool(kind="write")
    def send() -> None: ...

    timing = send.__retrysafe_tool__.timing  # type: ignore[attr-defined]
    assert (timing.lease, timing.heartbeat, timing.max_run_time) == (30.0, 10.0, 3600.0)


def test_timedelta_options_are_accepted() -> None:
    """lease, heartbeat and max_run_time take timedeltas as well as float seconds."""

    @tool(
        kind="write",
        lease=timedelta(seconds=20),
        heartbeat=timedelta(seconds=5),
        max_run_time=timedelta(minutes=10),
    )
    def send() -> None: ...

    timing = send.__retrysafe_tool__.timing  # type: ignore[attr-defined]
    assert (timing.lease, timing.heartbeat, timing.max_run_time) == (20.0, 5.0, 600.0)


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"lease": 0}, "lease"),
        ({"lease": -1.0}, "lease"),
        ({"lease": math.nan}, "lease"),
        ({"lease": math.inf}, "lease"),
        ({"lease": 10 * 86_400.0}, "lease"),
        ({"lease": "30"}, "lease"),
        ({"heartbeat": 0}, "heartbeat"),
        ({"heartbeat": -5.0}, "heartbeat"),
        ({"heartbeat": math.nan}, "heartbeat"),
        ({"heartbeat": math.inf}, "heartbeat"),
        ({"heartbeat": 0.001}, "heartbeat"),
        ({"heartbeat": 30.0}, "heartbeat"),
        ({"lease": 5.0, "heartbeat": 10.0}, "heartbeat"),
        ({"max_run_time": 0}, "max_run_time"),
        ({"max_run_time": -1.0}, "max_run_time"),
        ({"max_run_time": math.nan}, "max_run_time"),
        ({"max_run_time": math.inf}, "max_run_time"),
        ({"max_run_time": 365 * 86_400.0}, "max_run_time"),
        ({"max_run_time": True}, "max_run_time"),
    ],
)
def test_bad_lease_options_are_refused(options: dict[str, Any], option: str) -> None:
    """Zero, negative, NaN, infinite, absurdly large or non-numeric durations, and a
    heartbeat not shorter than the lease, raise ConfigurationError naming the option."""
    with pytest.raises(ConfigurationError) as info:
        tool(kind="write", **options)
    assert info.value.option == option


def test_heartbeat_over_half_the_lease_warns() -> None:
    """A heartbeat longer than half the lease works but warns, pointing at the declaration."""
    with pytest.warns(RetrysafeWarning, match="half") as record:
        tool(kind="write", lease=10, heartbeat=6)
    assert record[0].filename == __file__
