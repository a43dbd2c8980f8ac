"""The adaptive per-destination limit of attempts in flight (client/_limits.py), pure."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrysafe.client._limits import (
    QUICK_AGAIN,
    SLOW,
    TIMED_OUT,
    DestinationLimits,
    congested,
)

A, B = "http://a:80", "http://b:80"


def down(limits: DestinationLimits, destination: str) -> None:
    """Time out attempts to ``destination`` until its limit is 1."""
    while limits.limit(destination) > 1:
        limits.answered(destination, congested=True)


def known(limits: DestinationLimits, *destinations: str) -> None:
    """An attempt to each of ``destinations`` ended quickly (the worker's took): known, so
    no probe."""
    for destination in destinations:
        limits.took(destination, 0.01)


def test_a_new_destination_gets_one_probe_then_the_cap() -> None:
    """Nothing known of a destination: one attempt in flight (its probe) until that attempt
    ends; then the cap at once (no slow start: a healthy destination whose attempts take
    long keeps every slot)."""
    limits = DestinationLimits(4)
    assert limits.limit(A) == 4 and limits.allowance(A) == 1
    assert [limits.start(A, now=0.0) for _ in range(2)] == [True, False]
    assert limits.full() == [A]
    limits.took(A, 0.02)  # the probe's answer
    assert limits.answered(A, congested=False) is None
    assert limits.full() == [] and limits.allowance(A) == 3
    assert [limits.start(A) for _ in range(4)] == [True] * 3 + [False]
    for _ in range(4):
        limits.end(A)
    assert limits.full() == []
    assert limits._limit == {} and limits._probes == {}  # nothing kept of a healthy one


def test_a_probe_in_flight_a_second_makes_its_destination_slow() -> None:
    """A probe that has not ended after SLOW seconds: the destination is slow (its attempts
    take a second or more) and known, so it may take its fair share, not one; a probe
    given back before it ended (the job released unstarted) leaves it on probation."""
    limits = DestinationLimits(8, 8)
    assert limits.start(A, now=10.0)
    limits.age_probes(10.0 + SLOW / 2)
    assert limits.slow() == [] and limits.allowance(A) == 0
    limits.age_probes(10.0 + SLOW)
    assert limits.slow() == [A] and limits.allowance(A) == 7
    limits.took(A, 30.0)  # the probe timed out after all: still slow
    assert limits.slow() == [A]
    assert limits.start(B, now=0.0)
    limits.end(B)  # given back unstarted
    limits.age_probes(100.0)
    assert limits.slow() == [A] and limits.allowance(B) == 1
    assert limits.start(B)  # no time given: its probe ends only with its attempt
    limits.age_probes(1e9)
    assert limits.allowance(B) == 0


def test_a_grouped_backlog_of_new_endpoints_that_never_answer_takes_one_slot_each() -> None:
    """The fresh user's case: 16 new endpoints that never answer, their jobs due first and
    grouped by endpoint, concurrency 8. Without the probe the first endpoint took every
    slot for a timeout, then the next one; with it each takes one, so the first claim
    starts eight of them at once and a slot is left for others as soon as those are
    known."""
    limits = DestinationLimits(8, 8)
    dead = [f"http://d{i}:80" for i in range(16)]
    backlog = [d for d in dead for _ in range(10)]  # grouped: d0 ×10, d1 ×10, …
    started = [d for d in backlog if limits.start(d, now=0.0)]
    assert started == dead  # one each (the worker stops at its 8 free slots)


def test_each_congested_attempt_halves_the_limit_down_to_one() -> None:
    limits = DestinationLimits(32)
    seen = []
    for _ in range(7):
        limits.answered(A, congested=True)
        seen.append(limits.limit(A))
    assert seen == [32, 16, 8, 4, 2, 1, 1]  # the first alone changes nothing
    assert limits.limit(B) == 32  # another destination is untouched


def test_after_congestion_the_limit_grows_by_one_per_round_trip() -> None:
    """Additive increase: from 4, four attempts that end well make 5, five more make 6."""
    limits = DestinationLimits(32)
    for _ in range(4):
        limits.answered(A, congested=True)
    assert limits.limit(A) == 4
    answers = 0
    while limits.limit(A) < 6:
        limits.answered(A, congested=False)
        answers += 1
    assert 8 <= answers <= 10  # about 4 + 5: one per attempt in flight, per step


def test_a_destination_hanging_one_attempt_in_ten_keeps_a_fraction_of_the_slots() -> None:
    """One attempt in ten ends congested (at random): often enough that another of the last
    eight did too, so the limit settles well below the cap."""
    rng = random.Random(5)
    limits = DestinationLimits(32)
    seen = []
    for _ in range(5000):
        limits.answered(A, congested=rng.random() < 0.1)
        seen.append(limits.limit(A))
    assert statistics.mean(seen[1000:]) <= 10


def test_one_destination_hanging_every_other_attempt_keeps_one_or_two_slots() -> None:
    limits = DestinationLimits(8)
    seen = []
    for i in range(400):
        limits.answered(A, congested=i % 2 == 1)
        seen.append(limits.limit(A))
    assert max(seen[50:]) <= 2


def test_a_lone_lost_answer_now_and_then_changes_nothing() -> None:
    """The demo's chaos proxy holds one answer in 500 past the timeout: a healthy destination
    keeps every slot (halving on each took a third of them away and slowed the demo 47 %)."""
    limits = DestinationLimits(64)
    for i in range(10_000):
        limits.answered(A, congested=i % 500 == 499)
        assert limits.limit(A) == 64


def test_a_lowered_limit_holds_back_new_attempts_until_enough_end() -> None:
    limits = DestinationLimits(8)
    known(limits, A)
    assert [limits.start(A) for _ in range(8)] == [True] * 8
    for _ in range(4):
        limits.answered(A, congested=True)
    assert limits.limit(A) == 1
    for _ in range(7):
        limits.end(A)
        assert limits.full() == [A]
        assert not limits.start(A)
    limits.end(A)
    assert limits.full() == []
    assert limits.start(A)
    assert not limits.start(A)


def test_throttled_destinations_share_half_the_slots() -> None:
    """Eight destinations that never answer, concurrency 8: together they may hold 4."""
    limits = DestinationLimits(8, 8)
    known(limits, A)
    hanging = [f"http://h{i}:80" for i in range(8)]
    for d in hanging:
        down(limits, d)
    assert all(limits.limit(d) == 1 for d in hanging)
    started = [d for d in hanging if limits.start(d)]
    assert len(started) == 4
    assert set(limits.full()) == set(hanging)
    assert limits.start(A)  # a healthy destination still starts
    limits.end(started[0])
    assert set(limits.full()) == set(started[1:])
    assert limits.allowance(hanging[-1]) == 1


def test_a_destination_that_recovers_is_no_longer_throttled() -> None:
    limits = DestinationLimits(8, 8)
    down(limits, A)
    assert limits.allowance(A) == 1
    for _ in range(10):
        limits.answered(A, congested=False)
    assert limits.limit(A) >= 3
    assert A not in limits._throttled


def test_the_transitions_a_worker_logs() -> None:
    limits = DestinationLimits(4)
    assert limits.answered(A, congested=True) is None  # alone: stays 4
    assert limits.answered(A, congested=True) is None  # 4 -> 2
    assert limits.answered(A, congested=True) == "down"  # 2 -> 1
    assert limits.answered(A, congested=True) is None  # stays 1: said once
    changes = [limits.answered(A, congested=False) for _ in range(10)]
    assert changes.count("up") == 1 and changes[-1] is None
    assert limits.limit(A) == 4


def test_answers_lost_at_the_end_of_a_drain_leave_a_healthy_destination_its_slots() -> None:
    """The end of a drain: 1,600 answers a second for 10 s, one in 500 lost (held until the
    2 s timeout); when the backlog runs out, the eight answers lost in its last seconds end
    one after the other, with nothing between them. Each had another congested one in its
    last eight: without the share, the limit fell 64 -> 1 and the destination was logged
    as timing out just as the drain ended (seen at the end of 100,000-job demos)."""
    limits = DestinationLimits(64)
    now, changes = 0.0, []
    for i in range(16_000):
        now = i / 1600
        changes.append(limits.answered(A, congested=i % 500 == 499, now=now, window=2.0))
    for _ in range(8):  # the last lost answers, 0.25 s apart, nothing else in flight
        now += 0.25
        changes.append(limits.answered(A, congested=True, now=now, window=2.0))
    assert limits.limit(A) >= 32  # one halving at most
    assert "down" not in changes


def test_a_destination_that_stops_answering_still_goes_down_to_one() -> None:
    """The share does not slow the reaction to an endpoint that stops answering after a busy
    while: its first timeouts end a timeout after the last answers, which weigh a third by
    then, and every ending after is congested."""
    limits = DestinationLimits(64)
    for i in range(3200):  # 1,600 answers a second for 2 s
        limits.answered(A, congested=False, now=i / 1600, window=2.0)
    changes = [
        limits.answered(A, congested=True, now=4.0 + k / 1000, window=2.0) for k in range(64)
    ]
    assert limits.limit(A) == 1
    assert changes.count("down") == 1


@pytest.mark.parametrize("rate", [0.1, 0.03])
def test_a_destination_hanging_often_keeps_a_fraction_of_its_slots_with_the_share_too(
    rate: float,
) -> None:
    """One attempt in ten (or in 33) hangs until the 2 s timeout among 1,000 endings a
    second: well above the share, so the limit settles well below the cap, as without it."""
    rng = random.Random(5)
    limits = DestinationLimits(32)
    seen = []
    for i in range(20_000):
        limits.answered(A, congested=rng.random() < rate, now=i / 1000, window=2.0)
        seen.append(limits.limit(A))
    assert statistics.mean(seen[5000:]) <= (10 if rate == 0.1 else 20)


def test_an_ending_at_a_time_that_is_no_number_or_goes_back_weighs_nothing_down() -> None:
    limits = DestinationLimits(8)
    for now in (5.0, 1.0, math.nan, math.inf, -math.inf, 6.0):
        limits.answered(A, congested=False, now=now, window=2.0)
        limits.answered(A, congested=True, now=now, window=math.nan)
    assert 1 <= limits.limit(A) <= 8
    assert all(math.isfinite(x) or math.isnan(x) for x in limits._recent[A][:2])


def test_memory_stays_bounded_over_many_destinations_with_times() -> None:
    limits = DestinationLimits(4)
    for i in range(20_000):
        limits.answered(f"http://h{i}:80", congested=False, now=float(i), window=2.0)
    assert len(limits._recent) <= 4096


def test_with_a_cap_of_one_a_destination_that_times_out_is_still_reported() -> None:
    limits = DestinationLimits(1)
    assert limits.answered(A, congested=True) is None  # alone
    assert limits.answered(A, congested=True) == "down"
    assert limits.answered(A, congested=True) is None
    assert limits.answered(A, congested=False) == "up"


def test_only_timeouts_count_as_timeouts() -> None:
    """Refused, reset and truncated answers end fast: they are congested only when slow
    (the worker's rule), never by their kind."""
    assert {"ConnectTimeout", "ReadTimeout", "WriteTimeout", "AttemptTimeout"} == TIMED_OUT
    assert not {"ConnectError", "ReadError", "RemoteProtocolError", "PoolTimeout"} & TIMED_OUT


def test_which_endings_are_congested() -> None:
    """Timeouts always; failures (no answer, 429, 5xx) only after half the timeout (a gateway
    giving up just before the client); successes and definitive 4xx never, however slow."""
    t = 2.0
    assert congested("ReadTimeout", None, 2.0, t)
    assert congested("ConnectTimeout", None, 0.1, t)
    assert congested("RemoteProtocolError", None, 1.0, t)  # reset after half the timeout
    assert not congested("RemoteProtocolError", None, 0.9, t)  # a fast reset
    assert not congested("ConnectError", None, 0.01, t)  # refused at once
    assert congested(None, 504, 1.9, t) and congested(None, 429, 1.5, t)
    assert not congested(None, 503, 0.2, t) and not congested(None, 429, 0.1, t)
    assert not congested(None, 200, 1.99, t)  # a slow success
    assert not congested(None, 400, 1.99, t) and not congested(None, 409, 1.99, t)


def test_memory_stays_bounded_over_many_destinations() -> None:
    limits = DestinationLimits(8)
    for i in range(20_000):
        down(limits, f"http://h{i}:80")
    assert len(limits._limit) <= 4096
    assert len(limits._throttled) <= 4096 and len(limits._down) <= 4096
    assert limits.limit("http://h19999:80") == 1  # the latest are the ones kept
    assert limits.limit("http://h0:80") == 8  # the oldest start afresh


def test_a_destination_with_attempts_in_flight_is_never_forgotten() -> None:
    limits = DestinationLimits(8)
    limits.start(A)
    down(limits, A)
    for i in range(10_000):
        limits.answered(f"http://h{i}:80", congested=True)
    assert limits.limit(A) == 1
    assert A in limits.full()


def test_a_destination_is_slow_while_the_average_of_its_attempts_is_a_second_or_more() -> None:
    """Slow: the moving average of its attempt durations is SLOW seconds or more. A
    destination known to answer quickly is not slow at one answer held to the timeout (a
    lost answer), only after about three slow attempts in a row; a new destination whose
    first attempt is slow is slow at once."""
    limits = DestinationLimits(8)
    for _ in range(100):
        limits.took(A, 0.01)
    limits.took(A, 2 * SLOW)  # one lost answer held to a 2 s timeout
    limits.took(A, 2 * SLOW)
    assert limits.slow() == []
    limits.took(A, 2 * SLOW)
    assert limits.slow() == [A]
    limits.took(A, 0.01)  # 0.25 of the way down: still slow (QUICK_AGAIN)
    limits.took(A, 0.01)
    assert limits.slow() == [A]
    limits.took(A, 0.01)  # under half a second: quick again
    assert limits.slow() == [] and limits._means[A] < QUICK_AGAIN
    limits.took(B, 1.6 * SLOW)  # a new destination: its first attempt is its average
    assert limits.slow() == [B]
    limits.took(B, math.nan)  # not counted
    limits.took(B, -1.0)  # a clock that went back: not counted
    assert limits.slow() == [B] and limits._means[B] == 1.6 * SLOW
    limits.took("http://c:80", math.inf)  # counted as two seconds
    assert limits.slow() == [B, "http://c:80"] and limits._means["http://c:80"] == 2 * SLOW


@pytest.mark.parametrize("timeout", [4.0, 10.0, 30.0])
def test_one_answer_held_to_the_timeout_does_not_make_a_quick_destination_slow(
    timeout: float,
) -> None:
    """An attempt counts for at most two seconds in the average: one lost answer held to a
    10 s timeout made a 10 ms destination slow at once (an average of 2.5 s), and the quick
    answers beside it quick again milliseconds later, a pair of log lines per lost answer
    (69 lines in 38 s for one request in 150 lost). Three in a row still make it slow."""
    limits = DestinationLimits(8)
    for _ in range(50):
        limits.took(A, 0.01)
    limits.took(A, timeout)
    assert limits.slow() == []
    for _ in range(20):
        limits.took(A, 0.01)
    for _ in range(3):
        limits.took(A, timeout)
    assert limits.slow() == [A]


def test_a_probe_aged_into_slow_is_not_made_quick_by_one_quick_answer() -> None:
    """A new destination's first request hangs: at a second it is slow. Quick answers to
    requests started beside it (after the probe) do not flip it back at the first one and
    slow again at the probe's timeout (three log lines in a second): it stays slow until its
    average is under QUICK_AGAIN, and the probe's own end does not make it slow again."""
    limits = DestinationLimits(8, slots=16)
    limits.start(A, now=0.0)
    limits.age_probes(1.0)
    assert limits.slow() == [A]
    limits.took(A, 0.06)
    assert limits.slow() == [A]
    limits.took(A, 30.0)  # the hanging probe times out
    assert limits.slow() == [A]
    for _ in range(3):  # the 30 s answer counts for two seconds
        limits.took(A, 0.06)
    assert limits.slow() == [] and limits._means[A] < QUICK_AGAIN
    limits.took(A, 0.9)  # answers just under a second: not slow
    limits.took(A, 0.9)
    assert limits.slow() == []
    # The order a fresh user saw: the quick answers beside the probe first (quick again),
    # then the probe ends at its 5 s: not slow again (it was, the probe counted twice).
    limits.start(B, now=0.0)
    limits.age_probes(1.0)
    for _ in range(3):
        limits.took(B, 0.05)
    assert B not in limits.slow()
    limits.took(B, 5.0)
    assert B not in limits.slow()


def test_the_slow_destinations_share_half_the_slots_together() -> None:
    """The fair share of the slow destinations is half the worker's slots (at least one),
    however many of them there are; quick destinations' attempts do not count against it."""
    limits = DestinationLimits(8, 8)
    assert limits.slow_room() == 4
    limits.took(A, SLOW)
    limits.took(B, 2 * SLOW)
    for _ in range(3):
        limits.start(A)
    assert limits.slow_room() == 1
    limits.start(B)
    assert limits.slow_room() == 0
    limits.start(B)
    assert limits.slow_room() == 0  # more only when nobody else waits
    for _ in range(3):
        limits.start("http://quick:80")
    limits.end(A)
    limits.end(B)
    limits.end(B)
    assert limits.slow_room() == 2
    assert DestinationLimits(1, 1).slow_room() == 1  # one slot: at least one


def test_memory_stays_bounded_over_many_slow_destinations() -> None:
    limits = DestinationLimits(8)
    limits.start(A)
    limits.took(A, SLOW)
    for i in range(20_000):
        limits.took(f"http://h{i}:80", SLOW)
    assert len(limits._means) <= 4096 and len(limits._slow) <= 4096
    assert A in limits.slow()  # in flight: kept
    assert "http://h19999:80" in limits.slow()


@given(
    st.integers(1, 16),
    st.integers(1, 32),
    st.lists(
        st.tuples(
            st.sampled_from([A, B, "http://c:80"]),
            st.sampled_from(["start", "end", "ok", "congested"]),
        ),
        max_size=200,
    ),
)
def test_invariants_under_any_sequence(cap: int, slots: int, steps: list[tuple[str, str]]) -> None:
    """Whatever happens: 1 <= limit <= cap; a start never takes a destination over its
    limit, nor the throttled ones over their share; full() is exactly the destinations that
    may start nothing."""
    limits = DestinationLimits(cap, slots)
    running = {A: 0, B: 0, "http://c:80": 0}
    for destination, step in steps:
        if step == "start":
            if limits.start(destination):
                running[destination] += 1
                assert running[destination] <= limits.limit(destination)
        elif step == "end":
            if running[destination]:
                limits.end(destination)
                running[destination] -= 1
        else:
            limits.answered(destination, congested=step == "congested")
        throttled = sum(running[d] for d in limits._throttled)
        for d, n in running.items():
            assert 1 <= limits.limit(d) <= cap
            assert limits.in_flight(d) == n
        started_while_throttled = step == "start" and destination in limits._throttled
        if started_while_throttled:
            assert throttled <= limits.share
        assert limits.full() == sorted(d for d in running if limits.allowance(d) == 0)


def test_a_destination_is_stored_bare_and_shown_with_ipv6_in_brackets() -> None:
    """The unit of the limit (and of the retry budget), stored as the console's host filter
    reads it; the log lines show an IPv6 host in brackets, as the URL it came from."""
    from retrysafe.client._jobs import destination_of, shown_destination

    assert destination_of("http://[::1]:8080/x") == "http://::1:8080"
    assert shown_destination("http://::1:8080") == "http://[::1]:8080"
    assert destination_of("https://API.example.com/v1") == "https://api.example.com:443"
    assert shown_destination("https://api.example.com:443") == "https://api.example.com:443"
    assert shown_destination("http://127.0.0.1:80") == "http://127.0.0.1:80"


def test_reconcile_slots_go_to_the_first_job_whose_destination_may_start() -> None:
    """Reconcile's slots (every claimed job waits at once): a freed slot goes to the first
    waiting job whose destination may start, ahead of earlier jobs to a full destination;
    a slot never idles while a job waits (a full destination's job takes it when nothing
    else can); a waiter cancelled after it was handed a slot gives the slot back."""
    from retrysafe.client._worker import _DestinationSlots

    async def go() -> None:
        slots = _DestinationSlots(2, DestinationLimits(1, 2))  # one in flight per destination
        order: list[str] = []
        done: dict[str, asyncio.Event] = {}

        async def job(name: str, destination: str) -> None:
            done[name] = asyncio.Event()
            await slots.acquire(destination)
            order.append(name)
            await done[name].wait()
            slots.release(destination)

        async def step() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(job(n, d)) for n, d in (("a1", "a"), ("a2", "a"))]
        await step()
        assert order == ["a1", "a2"]  # nobody else waits: both slots used, limit or not
        tasks += [asyncio.create_task(job(n, d)) for n, d in (("a3", "a"), ("b", "b"))]
        await step()
        done["a1"].set()
        await step()
        assert order == ["a1", "a2", "b"]  # b's destination may start, a's may not
        done["a2"].set()
        await step()
        assert order == ["a1", "a2", "b", "a3"]
        late = asyncio.create_task(job("c", "c"))
        await step()
        done["b"].set()
        await asyncio.sleep(0)  # b's slot is handed to c ...
        late.cancel()  # ... which is cancelled before it runs: the slot comes back
        await asyncio.gather(late, return_exceptions=True)
        done["a3"].set()
        await asyncio.gather(*tasks)
        assert (slots.free, slots.waiting) == (2, [])

    asyncio.run(go())
