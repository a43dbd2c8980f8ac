"""The pure rules of the client: backoff statistics, next_step (SPEC §5), the retry budget."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from retrysafe import ConfigurationError
from retrysafe.client import JobState, RetryBudget, RetryPolicy, next_step, reconcile_step
from retrysafe.client._policy import deadline_passed
from retrysafe.core import (
    Jitter,
    classify_response,
    classify_transport_error,
    decorrelated_jitter,
    equal_jitter,
    exponential,
    full_jitter,
    parse_retry_after,
)

N = 20_000
BASE, CAP = 1.0, 30.0
NOW = 1_700_000_000.0


@pytest.mark.parametrize("attempt", [0, 1, 3, 4, 5, 10])
def test_full_jitter_stays_in_bounds_and_mean_is_half_the_capped_exponential(attempt: int) -> None:
    """Full jitter: every delay in [0, min(cap, base·2ⁿ)], mean ≈ half of it (seeded)."""
    rng = random.Random(1234 + attempt)
    t = exponential(attempt, base=BASE, cap=CAP)
    delays = [full_jitter(attempt, base=BASE, cap=CAP, rng=rng) for _ in range(N)]
    assert all(0.0 <= d <= t <= CAP for d in delays)
    assert statistics.fmean(delays) == pytest.approx(t / 2, rel=0.03)


@pytest.mark.parametrize("attempt", [0, 2, 4, 8])
def test_equal_jitter_stays_in_bounds_and_mean_is_three_quarters(attempt: int) -> None:
    """Equal jitter: every delay in [t/2, t] ⊂ [0, cap], mean ≈ 3t/4 (seeded)."""
    rng = random.Random(99 + attempt)
    t = exponential(attempt, base=BASE, cap=CAP)
    delays = [equal_jitter(attempt, base=BASE, cap=CAP, rng=rng) for _ in range(N)]
    assert all(t / 2 <= d <= t <= CAP for d in delays)
    assert statistics.fmean(delays) == pytest.approx(0.75 * t, rel=0.03)


def test_decorrelated_jitter_stays_within_base_and_cap() -> None:
    """Decorrelated jitter: a chain of delays stays within [base, cap] (seeded)."""
    rng = random.Random(7)
    previous = BASE
    for _ in range(N):
        previous = decorrelated_jitter(previous, base=BASE, cap=CAP, rng=rng)
        assert BASE <= previous <= CAP


@pytest.mark.parametrize("jitter", list(Jitter))
def test_policy_retry_delays_stay_within_zero_and_cap(jitter: Jitter) -> None:
    """Through next_step, every scheduled retry is due within [now, now + wait_max]."""
    policy = RetryPolicy(attempts=50, wait_initial=0.5, wait_max=4.0, jitter=jitter)
    rng = random.Random(5)
    previous = 0.0
    for attempts in range(40):
        step = next_step(
            classify_response(503),
            policy=policy,
            attempts=attempts,
            polls=0,
            now=NOW,
            deadline_at=None,
            previous_delay=previous,
            retry_after=None,
            rng=rng,
        )
        assert step.state is JobState.PENDING
        assert 0.0 <= step.delay <= 4.0
        assert step.due_at == NOW + step.delay
        previous = step.delay


def test_policy_mean_follows_the_full_jitter_formula() -> None:
    """Default full jitter through next_step: mean delay of retry n ≈ min(cap, base·2ⁿ)/2."""
    policy = RetryPolicy(attempts=10, wait_initial=1.0, wait_max=30.0)
    rng = random.Random(42)
    for n in (0, 2, 5):
        delays = [
            next_step(
                classify_transport_error(sent=True),
                policy=policy,
                attempts=n,
                polls=0,
                now=NOW,
                deadline_at=None,
                previous_delay=0.0,
                retry_after=None,
                rng=rng,
            ).delay
            for _ in range(N)
        ]
        assert statistics.fmean(delays) == pytest.approx(min(30.0, 2.0**n) / 2, rel=0.03)


def _step(status: int | None, **kw: object) -> object:
    cls = classify_transport_error(sent=True) if status is None else classify_response(status)
    args: dict[str, object] = dict(
        policy=RetryPolicy(attempts=3, wait_initial=1.0, wait_max=10.0),
        attempts=0,
        polls=0,
        now=NOW,
        deadline_at=None,
        previous_delay=0.0,
        retry_after=None,
        rng=random.Random(1),
    )
    args.update(kw)
    return next_step(cls, **args)  # type: ignore[arg-type]


def test_success_stops_succeeded() -> None:
    """2xx → SUCCEEDED."""
    assert _step(201).state is JobState.SUCCEEDED  # type: ignore[attr-defined]


def test_client_error_stops_rejected() -> None:
    """Other 4xx → REJECTED, counted, no retry."""
    assert _step(400).state is JobState.REJECTED  # type: ignore[attr-defined]


def test_exhausted_attempts_become_unknown_not_failed() -> None:
    """The last allowed attempt without a definitive answer parks the job as UNKNOWN."""
    step = _step(None, attempts=2)
    assert step.state is JobState.UNKNOWN  # type: ignore[attr-defined]


def test_deadline_before_next_attempt_becomes_unknown() -> None:
    """A retry that would start after the deadline parks the job as UNKNOWN instead."""
    step = _step(503, deadline_at=NOW + 0.001, retry_after=5.0)
    assert step.state is JobState.UNKNOWN  # type: ignore[attr-defined]
    assert deadline_passed(NOW, NOW) and not deadline_passed(None, NOW)


def test_409_polls_on_its_own_schedule_and_is_not_counted() -> None:
    """409: PENDING after Retry-After (or poll_interval), not counted, even past `attempts`."""
    step = _step(409, attempts=2, retry_after=3.0)
    assert step.state is JobState.PENDING  # type: ignore[attr-defined]
    assert not step.counted  # type: ignore[attr-defined]
    assert step.delay == 3.0  # type: ignore[attr-defined]
    assert _step(409).delay == 1.0  # type: ignore[attr-defined]


def test_409_polls_have_their_own_limit() -> None:
    """Past `polls` 409 answers the job is UNKNOWN (still in progress somewhere)."""
    policy = RetryPolicy(polls=3)
    assert _step(409, policy=policy, polls=2).state is JobState.UNKNOWN  # type: ignore[attr-defined]


def test_429_waits_at_least_retry_after_capped() -> None:
    """429 with Retry-After: the delay is at least Retry-After, never above retry_after_max."""
    policy = RetryPolicy(attempts=3, wait_initial=0.01, wait_max=0.02, retry_after_max=60)
    assert _step(429, policy=policy, retry_after=7.0).delay == 7.0  # type: ignore[attr-defined]
    huge = parse_retry_after("9" * 400, now=NOW)
    assert huge is None or _step(429, policy=policy, retry_after=huge).delay == 60.0  # type: ignore[attr-defined]
    assert _step(429, policy=policy, retry_after=10.0**12).delay == 60.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("header", "expected"),
    [("1m0s", None), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("-5", None), ("soon", None)],
)
def test_retry_after_malformed_or_past_never_raises(header: str, expected: float | None) -> None:
    """`1m0s` and garbage are ignored; an HTTP-date in the past means 0 s."""
    assert parse_retry_after(header, now=NOW) == expected
    step = _step(503, retry_after=parse_retry_after(header, now=NOW))
    assert step.state is JobState.PENDING  # type: ignore[attr-defined]
    assert 0.0 <= step.delay <= 1.0  # type: ignore[attr-defined]


def test_reconcile_maps_replay_to_definitive_states() -> None:
    """Reconcile: 2xx → SUCCEEDED, rejecting 4xx → REJECTED, anything else stays UNKNOWN."""
    assert reconcile_step(classify_response(200)) is JobState.SUCCEEDED
    assert reconcile_step(classify_response(404)) is JobState.REJECTED
    assert reconcile_step(classify_response(409)) is JobState.UNKNOWN
    assert reconcile_step(classify_response(503)) is JobState.UNKNOWN
    assert reconcile_step(classify_transport_error(sent=True)) is JobState.UNKNOWN


def test_budget_allows_a_burst_then_defers_until_refill() -> None:
    """Retries spend tokens; an empty bucket answers 'wait' with the time to the next token."""
    budget = RetryBudget(capacity=3, refill_per_second=2.0)
    state = budget.full(NOW)
    for _ in range(3):
        allowed, _, state = budget.spend(state, NOW)
        assert allowed
    allowed, wait, state = budget.spend(state, NOW)
    assert not allowed
    assert wait == pytest.approx(0.5)
    allowed, _, state = budget.spend(state, NOW + 0.5)
    assert allowed


def test_budget_successes_refill() -> None:
    """A success puts tokens back (never above capacity)."""
    budget = RetryBudget(capacity=2, refill_per_second=0.0, success_credit=1.0)
    state = budget.full(NOW)
    _, _, state = budget.spend(state, NOW)
    _, _, state = budget.spend(state, NOW)
    assert not budget.spend(state, NOW)[0]
    state = budget.credit(state, NOW)
    assert budget.spend(state, NOW)[0]
    assert budget.credit(budget.credit(state, NOW), NOW).tokens == 2.0


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"capacity": math.nan}, "capacity must be a finite number"),
        ({"refill_per_second": math.nan}, "refill_per_second must be a finite number"),
        ({"refill_per_second": math.inf}, "refill_per_second must be a finite number"),
        ({"retry_cost": math.nan}, "retry_cost must be a finite number"),
        ({"success_credit": -math.inf}, "success_credit must be a finite number"),
        ({"capacity": True}, "capacity must be a number"),
        ({"retry_cost": "1"}, "retry_cost must be a number"),
        ({"refill_per_second": 1e-9}, "refills one retry"),
        ({"refill_per_second": 0.0, "success_credit": 0.0}, "never refills"),
        ({"capacity": 10**400}, "capacity must be a finite number"),
    ],
)
def test_budget_refuses_what_would_turn_it_off_or_stall_it(
    settings: dict[str, object], said: str
) -> None:
    """NaN compared false everywhere, so a NaN refill let every retry through (the budget was
    off without a word); a refill of 1e-9 per second deferred a retry for decades (the worker
    never became idle). Both, and infinities and non-numbers, are refused by name."""
    with pytest.raises(ConfigurationError, match=said):
        RetryBudget(**settings)  # type: ignore[arg-type]
    # The slowest refill allowed pays for one retry within a day.
    RetryBudget(refill_per_second=1 / 86_400)
