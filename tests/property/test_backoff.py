"""SPEC §5, fuzzed: the backoff functions stay within [0, cap] and grow with the cap;
``Retry-After`` parsing never raises, and the wait it leads to stays within its cap."""

from __future__ import annotations

import math
import random
from datetime import datetime, timezone
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrysafe import ConfigurationError, RetryPolicy
from retrysafe.client import next_step
from retrysafe.core import (
    Backoff,
    Jitter,
    classify_response,
    decorrelated_jitter,
    equal_jitter,
    exponential,
    full_jitter,
    parse_retry_after,
)

attempts = st.one_of(st.integers(-5, 80), st.integers())
bases = st.floats(1e-6, 1e6)
seeds = st.integers(0, 2**32 - 1)
previous = st.one_of(
    st.floats(allow_nan=False), st.just(math.nan), st.just(math.inf), st.just(-math.inf)
)
NOW = 1_700_000_000.0


@st.composite
def base_and_cap(draw: st.DrawFn) -> tuple[float, float]:
    base = draw(bases)
    return base, base * draw(st.floats(1.0, 1e6))


@given(attempt=attempts, bc=base_and_cap(), seed=seeds)
def test_every_backoff_function_stays_within_zero_and_the_cap(
    attempt: int, bc: tuple[float, float], seed: int
) -> None:
    """exponential, full and equal jitter give a finite delay in [0, cap] for any attempt
    number (negative and huge ones too), exponential exactly ``min(cap, base · 2^n)``."""
    base, cap = bc
    e = exponential(attempt, base=base, cap=cap)
    assert 0 <= e <= cap and math.isfinite(e)
    assert e == min(cap, base * 2.0 ** min(max(attempt, 0), 64))
    for fn in (full_jitter, equal_jitter):
        d = fn(attempt, base=base, cap=cap, rng=random.Random(seed))
        assert 0 <= d <= e
    assert equal_jitter(attempt, base=base, cap=cap, rng=random.Random(seed)) >= e / 2


@given(prev=previous, bc=base_and_cap(), seed=seeds)
def test_decorrelated_jitter_stays_within_base_and_the_cap(
    prev: float, bc: tuple[float, float], seed: int
) -> None:
    """Whatever the previous delay (negative, NaN, infinite), decorrelated jitter gives a
    delay in [base, cap]."""
    base, cap = bc
    d = decorrelated_jitter(prev, base=base, cap=cap, rng=random.Random(seed))
    assert base <= d <= cap


@given(attempt=attempts, bc=base_and_cap(), more=st.floats(1.0, 1e3), seed=seeds, prev=previous)
def test_a_larger_cap_never_shortens_a_delay(
    attempt: int, bc: tuple[float, float], more: float, seed: int, prev: float
) -> None:
    """With the same random draw, raising the cap never lowers any strategy's delay."""
    base, cap = bc
    bigger = cap * more
    assert exponential(attempt, base=base, cap=cap) <= exponential(attempt, base=base, cap=bigger)
    for fn in (full_jitter, equal_jitter):
        low = fn(attempt, base=base, cap=cap, rng=random.Random(seed))
        assert low <= fn(attempt, base=base, cap=bigger, rng=random.Random(seed))
    low = decorrelated_jitter(prev, base=base, cap=cap, rng=random.Random(seed))
    assert low <= decorrelated_jitter(prev, base=base, cap=bigger, rng=random.Random(seed))


@given(a=attempts, b=attempts, bc=base_and_cap())
def test_the_exponential_never_shrinks_with_more_attempts(
    a: int, b: int, bc: tuple[float, float]
) -> None:
    """A later retry never has a smaller capped exponential than an earlier one."""
    base, cap = bc
    lo, hi = sorted((a, b))
    assert exponential(lo, base=base, cap=cap) <= exponential(hi, base=base, cap=cap)


@given(
    attempt=attempts,
    bc=base_and_cap(),
    jitter=st.sampled_from(Jitter),
    prev=previous,
    seed=seeds,
)
def test_a_backoff_policy_delay_is_within_zero_and_its_cap(
    attempt: int, bc: tuple[float, float], jitter: Jitter, prev: float, seed: int
) -> None:
    """``Backoff.delay`` of every strategy is in [0, cap]."""
    base, cap = bc
    d = Backoff(base=base, cap=cap, jitter=jitter).delay(
        attempt, previous=prev, rng=random.Random(seed)
    )
    assert 0 <= d <= cap


@given(
    base=st.one_of(st.floats(), st.integers(), st.none(), st.text(max_size=3)),
    cap=st.one_of(st.floats(), st.integers(), st.none()),
)
def test_a_backoff_policy_is_valid_or_refused_with_a_configuration_error(
    base: object, cap: object
) -> None:
    """Any base and cap either make a Backoff with ``0 < base <= cap``, both finite, or are
    refused with ConfigurationError."""
    try:
        b = Backoff(base=base, cap=cap)  # type: ignore[arg-type]
    except ConfigurationError:
        return
    assert 0 < b.base <= b.cap and math.isfinite(b.cap)


def test_an_unknown_jitter_is_a_configuration_error() -> None:
    """A jitter name that is not full, equal or decorrelated is refused with
    ConfigurationError (option ``jitter``)."""
    with pytest.raises(ConfigurationError):
        Backoff(jitter="bogus")  # type: ignore[arg-type]


# ------------------------------------------------------------------------- Retry-After
http_dates = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(timezone.utc)
).map(lambda d: format_datetime(d, usegmt=True))
header_values = st.one_of(
    st.none(),
    st.text(),
    st.integers(-(10**6), 10**400).map(str),
    http_dates,
    st.text("0123456789 ,:-+GMTMonFriJan", max_size=40),
    st.from_regex(r"\A\s*\d{1,30}\s*\Z"),
)
nows = st.one_of(st.just(NOW), st.floats(-1e12, 1e12))


@given(value=header_values, now=nows)
def test_retry_after_parsing_never_raises(value: str | None, now: float) -> None:
    """Any header value gives None or a number of seconds >= 0 (never NaN); no exception."""
    got = parse_retry_after(value, now=now)
    assert got is None or got >= 0  # (NaN is not >= 0)


@given(seconds=st.integers(0, 10**12), pad=st.text(" \t", max_size=2))
def test_delay_seconds_are_read_exactly(seconds: int, pad: str) -> None:
    """``Retry-After: <digits>`` is that many seconds, whitespace around ignored."""
    assert parse_retry_after(f"{pad}{seconds}{pad}", now=NOW) == float(seconds)


@given(when=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9000, 1, 1)))
def test_an_http_date_is_the_seconds_until_it(when: datetime) -> None:
    """An HTTP-date is the seconds from ``now`` until it, or 0 once it has passed."""
    when = when.replace(microsecond=0, tzinfo=timezone.utc)
    got = parse_retry_after(format_datetime(when, usegmt=True), now=NOW)
    assert got == max(0.0, when.timestamp() - NOW)


@given(
    value=header_values,
    status=st.sampled_from([408, 409, 429, 500, 502, 503, 504]),
    cap=st.floats(0.0, 600.0),
    wait_max=st.floats(0.01, 600.0),
    attempts_before=st.integers(0, 3),
    polls=st.integers(0, 3),
    seed=seeds,
)
def test_the_wait_after_any_retry_after_stays_within_its_cap(
    value: str | None,
    status: int,
    cap: float,
    wait_max: float,
    attempts_before: int,
    polls: int,
    seed: int,
) -> None:
    """Whatever ``Retry-After`` an answer carries, the next attempt is due no later than the
    larger of the backoff cap and ``retry_after_max`` (a poll: of ``retry_after_max`` and
    the poll interval), and never in the past."""
    policy = RetryPolicy(
        attempts=10, wait_initial=min(0.01, wait_max), wait_max=wait_max, retry_after_max=cap
    )
    step = next_step(
        classify_response(status),
        policy=policy,
        attempts=attempts_before,
        polls=polls,
        now=NOW,
        deadline_at=None,
        previous_delay=0.0,
        retry_after=parse_retry_after(value, now=NOW),
        rng=random.Random(seed),
    )
    bound = max(cap, policy.poll_interval_s if status == 409 else wait_max)
    assert 0 <= step.delay <= bound
    assert step.due_at == NOW + step.delay


def test_a_huge_delay_seconds_value_is_capped_not_ignored() -> None:
    """``Retry-After`` with more digits than a float holds still means "wait the longest
    allowed" (callers cap it), never "no header"."""
    assert parse_retry_after("9" * 400, now=NOW) is not None
