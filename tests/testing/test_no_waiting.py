"""retrysafe.testing: the switch that makes retrysafe's own retry waits take no time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import retrysafe.agents._tools as tools_module
from retrysafe import testing
from retrysafe.agents import tool
from retrysafe.core import InProgress
from retrysafe.server._engine import claim_key
from retrysafe.stores import MemoryStore

H, FP, NOW = "k" * 64, "f" * 64, 1_000_000.0


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    """Every test leaves the switch as it found it, whatever it does to it."""
    with testing.set_testing(testing.is_testing()):
        yield


def test_testing_is_off_in_a_fresh_process() -> None:
    """A process that imports retrysafe waits for real until someone switches testing on."""
    code = "import retrysafe.testing as t; print(t.is_testing(), t.waited(1.5))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1.5"]


def test_no_waiting_switches_on_and_restores_on_exit() -> None:
    """Inside ``no_waiting()`` waits are 0 s; after it, the previous setting is back."""
    testing.set_testing(False)
    with testing.no_waiting():
        assert testing.is_testing() and testing.waited(30.0) == 0.0
    assert not testing.is_testing() and testing.waited(30.0) == 30.0


def test_nested_switches_restore_in_order() -> None:
    """Nested ``with`` blocks each put back what was there before them."""
    testing.set_testing(False)
    with testing.no_waiting():
        with testing.set_testing(False):
            assert not testing.is_testing()
            with testing.no_waiting():
                assert testing.is_testing()
            assert not testing.is_testing()
        assert testing.is_testing()
    assert not testing.is_testing()


def test_the_switch_restores_even_when_the_block_raises() -> None:
    """An exception leaving the block does not leave testing mode on."""
    testing.set_testing(False)
    with pytest.raises(KeyError), testing.no_waiting():
        raise KeyError("boom")
    assert not testing.is_testing()


def test_set_testing_without_with_keeps_the_setting() -> None:
    """``set_testing(True)`` alone holds until ``set_testing(False)``."""
    testing.set_testing(True)
    assert testing.is_testing()
    testing.set_testing(False)
    assert not testing.is_testing()


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_set_testing_takes_only_a_bool(value: Any) -> None:
    """Anything but True or False is a TypeError, and the setting does not change."""
    before = testing.is_testing()
    with pytest.raises(TypeError, match="True or False"):
        testing.set_testing(value)
    assert testing.is_testing() is before


@given(seconds=st.floats(allow_infinity=False), on=st.booleans())
def test_waited_is_the_wait_or_nothing(seconds: float, on: bool) -> None:
    """``waited(s)`` is ``s`` for a positive ``s`` with testing off, else 0 (negative and NaN
    waits are no waits)."""
    with testing.set_testing(on):
        got = testing.waited(seconds)
    assert got == (seconds if seconds > 0 and not on else 0.0)


def test_threads_see_the_switch() -> None:
    """The switch is process-wide: a thread (a sync tool's worker) sees it too."""
    seen: list[bool] = []
    with testing.no_waiting():
        t = threading.Thread(target=lambda: seen.append(testing.is_testing()))
        t.start()
        t.join(10)
    assert seen == [True]


# ----------------------------------------------------------------------- the call sites
class _Sleeps:
    """A stand-in for the ``time`` module as one module sees it: every sleep is recorded and
    returns at once; everything else is the real module's."""

    def __init__(self, real: types.ModuleType) -> None:
        self._real = real
        self.slept: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


class _AsyncSleeps(_Sleeps):
    """The same for the ``asyncio`` module: ``await asyncio.sleep(s)`` is recorded."""

    async def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.slept.append(seconds)


def _flaky(fails: int) -> Any:
    calls = [0]

    @tool(attempts=fails + 1, wait_initial=30.0, wait_max=60.0)
    def lookup() -> int:
        calls[0] += 1
        if calls[0] <= fails:
            raise ConnectionError("connection reset")
        return calls[0]

    return lookup


def test_a_tool_retry_backs_off_for_real_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the switch a retried tool sleeps its backoff (up to ``wait_max``)."""
    fake = _Sleeps(time)
    monkeypatch.setattr(tools_module, "time", fake)
    testing.set_testing(False)
    assert _flaky(2)() == 3
    assert len(fake.slept) == 2 and all(0 <= s <= 60.0 for s in fake.slept)
    assert sum(fake.slept) > 0


def test_a_tool_retry_does_not_sleep_under_no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``no_waiting()`` a tool that fails twice retries at once: every backoff is 0 s."""
    fake = _Sleeps(time)
    monkeypatch.setattr(tools_module, "time", fake)
    with testing.no_waiting():
        assert _flaky(2)() == 3
    assert fake.slept == [0.0, 0.0]


def test_an_async_tool_retry_does_not_sleep_under_no_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The async face of a tool consults the same switch."""
    fake = _AsyncSleeps(asyncio)
    monkeypatch.setattr(tools_module, "asyncio", fake)
    calls = [0]

    @tool(attempts=3, wait_initial=30.0, wait_max=60.0)
    async def lookup() -> int:
        calls[0] += 1
        if calls[0] <= 2:
            raise ConnectionError("connection reset")
        return calls[0]

    with testing.no_waiting():
        assert asyncio.run(lookup()) == 3
    assert fake.slept == [0.0, 0.0]


def _in_progress_ops(wait: float) -> tuple[list[str], object]:
    """Run the middleware's claim conversation for a key another request holds, with an
    in-progress wait of ``wait`` s; sleeps are recorded, not slept. Stops at the first
    sleep (the poll would otherwise run until its wall-clock deadline)."""
    store = MemoryStore()
    store.claim(H, FP, now=NOW, lease=30.0, retention=3600.0)  # the original is running
    gen = claim_key(H, FP, clock=lambda: NOW, lease=30.0, retention=3600.0, wait=wait)
    ops: list[str] = []
    try:
        name, args, kwargs = next(gen)
        while True:
            ops.append(name)
            if name == "sleep":
                gen.close()
                return ops, None
            name, args, kwargs = gen.send(getattr(store, name)(*args, **kwargs))
    except StopIteration as stop:
        return ops, stop.value


def test_the_in_progress_wait_polls_by_default() -> None:
    """Without the switch a repeat of a running request polls (sleeps) before answering."""
    testing.set_testing(False)
    ops, _ = _in_progress_ops(wait=5.0)
    assert ops == ["claim", "sleep"]


def test_the_in_progress_wait_answers_at_once_under_no_waiting() -> None:
    """Under ``no_waiting()`` the repeat gets its 409 (in progress) without a single sleep."""
    with testing.no_waiting():
        ops, outcome = _in_progress_ops(wait=5.0)
    assert ops == ["claim"]
    assert isinstance(outcome, InProgress)
