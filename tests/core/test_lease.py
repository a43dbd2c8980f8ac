"""Lease timing (SPEC §3 "Lease renewal") and the two heartbeat drivers that apply it."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest

from retrysafe import ConfigurationError, RetrysafeWarning
from retrysafe._heartbeat import AsyncHeartbeat, Heartbeat
from retrysafe.core import MAX_LEASE, MIN_HEARTBEAT, LeaseTiming, lease_timing
from retrysafe.server import IdempotencyConfig


def test_heartbeat_defaults_to_a_third_of_the_lease() -> None:
    """Two renewals may fail before the lease ends."""
    assert lease_timing(9) == LeaseTiming(9.0, 3.0, 3600.0)


def test_timedeltas_are_accepted() -> None:
    """Every duration takes a timedelta too."""
    timing = lease_timing(
        timedelta(seconds=6), heartbeat=timedelta(seconds=1), max_run_time=timedelta(minutes=2)
    )
    assert timing == LeaseTiming(6.0, 1.0, 120.0)


@pytest.mark.parametrize(
    ("lease", "heartbeat", "max_run_time", "option"),
    [
        (0, None, 60, "lease"),
        (-1, None, 60, "lease"),
        (math.nan, None, 60, "lease"),
        (math.inf, None, 60, "lease"),
        (MAX_LEASE * 2, None, 60, "lease"),
        (True, None, 60, "lease"),
        ("10", None, 60, "lease"),
        (10, 0, 60, "heartbeat"),
        (10, -2, 60, "heartbeat"),
        (10, math.nan, 60, "heartbeat"),
        (10, MIN_HEARTBEAT / 10, 60, "heartbeat"),
        (10, 10, 60, "heartbeat"),
        (2, 5, 60, "heartbeat"),
        (10, None, 0, "max_run_time"),
        (10, None, -5, "max_run_time"),
        (10, None, math.inf, "max_run_time"),
        (10, None, 1e12, "max_run_time"),
    ],
)
def test_bad_timing_is_a_configuration_error(
    lease: float, heartbeat: float | None, max_run_time: float, option: str
) -> None:
    """Zero, negative, NaN, infinite, absurdly large values and a heartbeat not shorter than
    the lease are refused, naming the option."""
    with pytest.raises(ConfigurationError) as info:
        lease_timing(lease, heartbeat=heartbeat, max_run_time=max_run_time)
    assert info.value.option == option


def test_a_lease_too_short_for_its_default_heartbeat_is_refused() -> None:
    """A lease so short that even the shortest heartbeat cannot renew it is an error that
    blames the lease and names the shortest heartbeat (a fresh user's `--lease 0.01` was
    told about a heartbeat of 0.05 s it never set)."""
    for lease in (MIN_HEARTBEAT, 0.01):
        with pytest.raises(ConfigurationError, match=r"lease must be longer than 0\.05") as info:
            lease_timing(lease)
        assert info.value.option == "lease" and "must be shorter" not in str(info.value)


def test_a_heartbeat_past_half_the_lease_warns() -> None:
    """One late renewal would lose such a lease: a RetrysafeWarning."""
    with pytest.warns(RetrysafeWarning, match="half"):
        lease_timing(10, heartbeat=6)


def test_renewal_stops_after_max_run_time() -> None:
    """Work is renewed while it has run less than max_run_time."""
    timing = lease_timing(3, max_run_time=10)
    assert timing.keeps_renewing(100.0, 109.9)
    assert not timing.keeps_renewing(100.0, 110.0)


def test_middleware_config_validates_through_lease_timing() -> None:
    """IdempotencyConfig refuses a heartbeat that is not shorter than its lease."""
    with pytest.raises(ConfigurationError) as info:
        IdempotencyConfig(lease=2, heartbeat=2)
    assert info.value.option == "heartbeat"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert IdempotencyConfig(lease=2).heartbeat == pytest.approx(2 / 3)


# ---------------------------------------------------------------------- the drivers
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counting(calls: list[float], result: bool = True) -> Callable[[], bool]:
    """A renew() that notes each call's monotonic time and returns ``result``."""

    def renew() -> bool:
        calls.append(time.monotonic())
        return result

    return renew


def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.005)


def _two_more_intervals(timing: LeaseTiming) -> None:
    """Return once a fresh heartbeat of the same interval renewed twice: the renewing thread
    has run for two more intervals, so a beat it should still renew would have been (a
    fixed sleep would pass even if that thread never ran meanwhile)."""
    calls: list[float] = []
    witness = Heartbeat(_counting(calls), timing).start()
    _wait(lambda: len(calls) >= 2)
    witness.stop()


async def _two_more_async_intervals(timing: LeaseTiming) -> None:
    """:func:`_two_more_intervals` on the event loop."""
    renewed: list[int] = []
    second = asyncio.Event()

    async def renew() -> bool:
        renewed.append(1)
        if len(renewed) == 2:
            second.set()
        return True

    witness = AsyncHeartbeat(renew, timing).start()
    await asyncio.wait_for(second.wait(), 5)
    witness.stop()


def test_thread_heartbeat_renews_until_stopped() -> None:
    """The thread driver calls renew every interval, and never after stop()."""
    calls: list[float] = []
    beat = Heartbeat(_counting(calls), lease_timing(0.3)).start()
    _wait(lambda: len(calls) >= 3)
    beat.stop()
    seen = len(calls)
    _two_more_intervals(lease_timing(0.3))
    assert len(calls) <= seen + 1  # at most one renewal already in flight
    assert beat.renewals >= 3


def test_thread_heartbeat_reports_a_lost_claim_once_and_stops() -> None:
    """renew() returning False calls on_lost once; renewal stops."""
    calls: list[float] = []
    lost: list[int] = []
    Heartbeat(
        _counting(calls, False), lease_timing(0.2), on_lost=lambda: lost.append(1)
    ).start()
    _wait(lambda: lost)
    _two_more_intervals(lease_timing(0.2))
    assert (len(calls), lost) == (1, [1])


def test_thread_heartbeat_keeps_renewing_through_errors() -> None:
    """A renewal that raises is reported to on_error and renewal goes on."""
    errors: list[BaseException] = []
    calls: list[int] = []

    def renew() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("store hiccup")
        return True

    beat = Heartbeat(renew, lease_timing(0.2), on_error=errors.append).start()
    _wait(lambda: len(calls) >= 3)
    beat.stop()
    assert [str(e) for e in errors] == ["store hiccup"]


def test_thread_heartbeat_stops_after_max_run_time() -> None:
    """Past max_run_time (on the injected clock) renewal stops and on_expired runs once."""
    clock = _Clock()
    calls: list[float] = []
    expired = threading.Event()
    Heartbeat(
        _counting(calls),
        lease_timing(0.2, max_run_time=60),
        clock=clock,
        on_expired=expired.set,
    ).start()
    _wait(lambda: calls)
    clock.now += 61
    assert expired.wait(5)
    seen = len(calls)
    _two_more_intervals(lease_timing(0.2))
    assert len(calls) == seen


def test_unbounded_heartbeat_ignores_max_run_time() -> None:
    """bounded = False (the work is done, its record pending) renews past max_run_time."""
    clock = _Clock()
    calls: list[float] = []
    timing = lease_timing(0.2, max_run_time=1)
    beat = Heartbeat(_counting(calls), timing, clock=clock)
    beat.bounded = False
    beat.start()
    clock.now += 100
    _wait(lambda: len(calls) >= 2)
    beat.stop()


def test_time_waiting_for_the_client_is_not_counted() -> None:
    """A wait for the client (wait_begins .. wait_ends: a send held back by a slow reader)
    is left out of max_run_time, the one in progress too: renewal goes on past max_run_time
    from the start while the waits last, and stops once the work's own time passes it."""
    clock = _Clock()
    calls: list[float] = []
    expired = threading.Event()
    beat = Heartbeat(
        _counting(calls), lease_timing(0.2, max_run_time=60), clock=clock, on_expired=expired.set
    ).start()
    for _ in range(3):  # 10 s of work, then a 40-s wait, three times: 150 s from the start
        clock.now += 10
        beat.wait_begins()
        clock.now += 40
        beat.wait_ends()
    beat.wait_begins()  # a client that pauses for longer than max_run_time in one wait
    clock.now += 500
    seen = len(calls)
    _wait(lambda: len(calls) >= seen + 2)
    assert not expired.is_set()
    beat.wait_ends()
    clock.now += 31  # the work's own time reaches 61 s
    assert expired.wait(5)
    seen = len(calls)
    _two_more_intervals(lease_timing(0.2))
    assert len(calls) == seen


@pytest.mark.anyio
async def test_async_heartbeat_renews_on_the_loop_until_stopped() -> None:
    """The event-loop driver renews every interval and stops on stop()."""
    calls: list[int] = []
    third = asyncio.Event()

    async def renew() -> bool:
        calls.append(1)
        if len(calls) == 3:
            third.set()
        return True

    beat = AsyncHeartbeat(renew, lease_timing(0.3)).start()
    await asyncio.wait_for(third.wait(), 5)
    beat.stop()
    seen = len(calls)
    await _two_more_async_intervals(lease_timing(0.3))
    assert len(calls) == seen


@pytest.mark.anyio
async def test_async_heartbeat_ignores_a_result_that_lands_after_stop() -> None:
    """A renewal in flight when stop() is called is ignored: no on_lost for a finished claim."""
    started = asyncio.Event()
    release = asyncio.Event()
    lost: list[int] = []

    async def renew() -> bool:
        started.set()
        await release.wait()
        return False  # e.g. the key completed meanwhile

    beat = AsyncHeartbeat(renew, lease_timing(0.15), on_lost=lambda: lost.append(1)).start()
    await asyncio.wait_for(started.wait(), 5)
    beat.stop()
    release.set()
    await _two_more_async_intervals(lease_timing(0.15))  # the late answer has landed
    assert lost == []


@pytest.mark.anyio
async def test_async_heartbeat_stops_after_max_run_time() -> None:
    """Past max_run_time the event-loop driver stops renewing and says so once."""
    clock = _Clock()
    expired = asyncio.Event()
    renewed = asyncio.Event()
    calls: list[int] = []

    async def renew() -> bool:
        calls.append(1)
        renewed.set()
        return True

    timing = lease_timing(0.15, max_run_time=5)
    AsyncHeartbeat(renew, timing, clock=clock, on_expired=expired.set).start()
    await asyncio.wait_for(renewed.wait(), 5)
    clock.now += 10
    await asyncio.wait_for(expired.wait(), 5)
    seen = len(calls)
    await _two_more_async_intervals(lease_timing(0.15))
    assert len(calls) == seen


def test_a_shorter_heartbeat_wakes_the_sleeping_thread_sweeper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim with a shorter heartbeat than the sweeper sleeps for is renewed on its own
    interval: the sweeper does not finish a long lease's tick first (a 0.3 s lease added while
    the sweeper slept for a 30 s lease's tick ran out before its first renewal)."""
    from retrysafe import _heartbeat

    sweeper = _heartbeat._ThreadSweeper(idle_tick=60.0)
    monkeypatch.setattr(_heartbeat, "_THREAD_SWEEPER", sweeper)
    long_calls: list[float] = []
    long = Heartbeat(_counting(long_calls), lease_timing(120.0)).start()  # ticks of 10 s
    time.sleep(0.05)  # the sweeper is asleep for its first tick
    calls: list[float] = []
    short = Heartbeat(_counting(calls), lease_timing(0.3)).start()
    _wait(lambda: len(calls) >= 2, timeout=5.0)
    short.stop()
    long.stop()
    assert long_calls == []


def test_the_thread_sweeper_tick_grows_back_when_short_claims_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the short-lease claims are gone the sweeper wakes at the longer claims' pace again,
    not at the shortest pace it ever served."""
    from retrysafe import _heartbeat

    sweeper = _heartbeat._ThreadSweeper(idle_tick=1.0)
    monkeypatch.setattr(_heartbeat, "_THREAD_SWEEPER", sweeper)
    long = Heartbeat(_counting([]), lease_timing(12.0)).start()
    calls: list[float] = []
    short = Heartbeat(_counting(calls), lease_timing(0.3)).start()
    _wait(lambda: len(calls) >= 1)
    assert sweeper._tick == pytest.approx(0.1 / 4)
    short.stop()
    _wait(lambda: sweeper._tick == pytest.approx(1.0))
    long.stop()


@pytest.mark.anyio
async def test_a_shorter_heartbeat_wakes_the_sleeping_loop_sweeper() -> None:
    """The event-loop driver likewise: a short lease started while the loop's sweeper sleeps
    for a long lease's tick is renewed on its own interval."""
    long_calls: list[int] = []

    async def long_renew() -> bool:
        long_calls.append(1)
        return True

    renewed = asyncio.Event()

    async def renew() -> bool:
        renewed.set()
        return True

    long = AsyncHeartbeat(long_renew, lease_timing(120.0)).start()  # ticks of 10 s
    await asyncio.sleep(0.05)
    short = AsyncHeartbeat(renew, lease_timing(0.3)).start()
    await asyncio.wait_for(renewed.wait(), 5)
    short.stop()
    long.stop()
    assert long_calls == []


@pytest.mark.anyio
async def test_async_heartbeat_renews_again_at_once_after_a_renewal_that_waited() -> None:
    """A renewal that took over half an interval (it waited for a lock) wrote a lease end
    computed before it waited; the heartbeat renews again in the same beat, not an interval
    later (a fresh user's check: the late end let a retry take the work over)."""
    seen: list[int] = []
    second = asyncio.Event()
    holder: list[AsyncHeartbeat] = []

    async def renew() -> bool:
        seen.append(holder[0].renewals)  # beats completed before this call
        if len(seen) == 1:
            await asyncio.sleep(0.15)  # over half the 0.2 s interval
        else:
            second.set()
        return True

    beat = AsyncHeartbeat(renew, lease_timing(0.6))
    holder.append(beat)
    beat.start()
    await asyncio.wait_for(second.wait(), 5)
    beat.stop()
    assert seen[:2] == [0, 0]  # the second call came in the first beat


def test_thread_heartbeat_renews_again_at_once_after_a_renewal_that_waited() -> None:
    """:func:`test_async_heartbeat_renews_again_at_once_after_a_renewal_that_waited` for
    the thread driver; a store slow every time gets two more renewals at most, then waits
    for the next beat."""
    seen: list[int] = []
    holder: list[Heartbeat] = []

    def renew() -> bool:
        seen.append(holder[0].renewals)
        time.sleep(0.15)  # every renewal slow
        return True

    beat = Heartbeat(renew, lease_timing(0.6))
    holder.append(beat)
    beat.start()
    _wait(lambda: len(seen) >= 4)
    beat.stop()
    assert seen[:4] == [0, 0, 0, 1]
