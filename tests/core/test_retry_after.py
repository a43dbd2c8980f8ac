"""SPEC §5: Retry-After in seconds or HTTP-date; malformed values are ignored, never fatal."""

from __future__ import annotations

from email.utils import formatdate

import pytest

from retrysafe.core import parse_retry_after

NOW = 1_800_000_000.0


def test_delay_seconds() -> None:
    """An integer is a delay in seconds."""
    assert parse_retry_after("120", now=NOW) == 120.0


def test_http_date_in_the_future() -> None:
    """An HTTP-date gives the seconds until then."""
    assert parse_retry_after(formatdate(NOW + 30, usegmt=True), now=NOW) == pytest.approx(30)


def test_http_date_in_the_past_is_zero() -> None:
    """A date in the past means no extra wait."""
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=NOW) == 0.0


def test_huge_value_is_returned_for_the_caller_to_cap() -> None:
    """A huge number parses without overflow; capping is the caller's policy."""
    assert parse_retry_after("9" * 40, now=NOW) == float(int("9" * 40))


@pytest.mark.parametrize(
    "value", [None, "", "1m0s", "-5", "1.5", "soon", "Mon, 99 Foo 2020", "\x00"]
)
def test_malformed_values_are_ignored(value: str | None) -> None:
    """Go-style durations, negatives, fractions and garbage give None."""
    assert parse_retry_after(value, now=NOW) is None
