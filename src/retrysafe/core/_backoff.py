"""Capped exponential backoff with jitter, and ``Retry-After`` parsing (SPEC §5).

The three jitter strategies follow Marc Brooker, "Exponential Backoff And Jitter" (AWS
Architecture Blog, 2015) and the AWS Builders' Library article "Timeouts, retries, and backoff
with jitter". ``attempt`` counts retries from 0: the wait before the first retry uses ``attempt=0``.
All functions are pure: the random source is passed in.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from retrysafe._exceptions import ConfigurationError

__all__ = [
    "Backoff",
    "Jitter",
    "decorrelated_jitter",
    "equal_jitter",
    "exponential",
    "full_jitter",
    "parse_retry_after",
]

# 2**64 * any positive base is beyond every sensible cap; clamping the exponent keeps the
# arithmetic finite for absurd attempt numbers.
_MAX_EXPONENT = 64


def exponential(attempt: int, *, base: float, cap: float) -> float:
    """``min(cap, base · 2^attempt)`` in seconds, never overflowing."""
    return min(cap, base * math.ldexp(1.0, min(max(attempt, 0), _MAX_EXPONENT)))


def full_jitter(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """``uniform(0, min(cap, base · 2^attempt))``. Mean: half the capped exponential."""
    return rng.uniform(0.0, exponential(attempt, base=base, cap=cap))


def equal_jitter(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """``t/2 + uniform(0, t/2)`` with ``t = min(cap, base · 2^attempt)``. Mean: ``3t/4``."""
    t = exponential(attempt, base=base, cap=cap)
    return t / 2 + rng.uniform(0.0, t / 2)


def decorrelated_jitter(
    previous: float, *, base: float, cap: float, rng: random.Random
) -> float:
    """``min(cap, uniform(base, 3 · previous))``.

    ``previous`` is the last delay in seconds (``base`` before the first retry).
    """
    upper = max(base, 3.0 * max(previous, base))
    return min(cap, rng.uniform(base, upper))


class Jitter(str, enum.Enum):
    """Which jitter strategy :class:`Backoff` uses."""

    FULL = "full"
    EQUAL = "equal"
    DECORRELATED = "decorrelated"


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """A capped exponential backoff policy.

    Attributes:
        base: seconds; the first retry waits up to ``base`` (default 1 s, SPEC §5).
        cap: seconds; no wait exceeds it (default 30 s).
        jitter: full (default), equal or decorrelated.

    Raises:
        ConfigurationError: ``base`` or ``cap`` is not a positive finite number, or ``cap < base``.
    """

    base: float = 1.0
    cap: float = 30.0
    jitter: Jitter = Jitter.FULL

    def __post_init__(self) -> None:
        for name in ("base", "cap"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigurationError(f"backoff {name} must be > 0 seconds", option=name)
        if self.cap < self.base:
            raise ConfigurationError("backoff cap must be >= base", option="cap")
        try:
            jitter = Jitter(self.jitter)
        except ValueError:
            names = ", ".join(j.value for j in Jitter)
            raise ConfigurationError(
                f"backoff jitter {self.jitter!r} is not one of {names}", option="jitter"
            ) from None
        object.__setattr__(self, "jitter", jitter)

    def delay(self, attempt: int, *, previous: float, rng: random.Random) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based).

        Args:
            attempt: retries already scheduled before this one (0 for the first retry).
            previous: the previous delay in seconds (used by decorrelated jitter only).
            rng: the random source (seed it in tests).
        """
        if self.jitter is Jitter.FULL:
            return full_jitter(attempt, base=self.base, cap=self.cap, rng=rng)
        if self.jitter is Jitter.EQUAL:
            return equal_jitter(attempt, base=self.base, cap=self.cap, rng=rng)
        return decorrelated_jitter(previous, base=self.base, cap=self.cap, rng=rng)


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Parse a ``Retry-After`` header (RFC 9110 §10.2.3) into seconds from ``now``.

    Args:
        value: the header value: delay-seconds (``"120"``) or an HTTP-date.
        now: current Unix time in seconds (for HTTP-dates).

    Returns:
        Seconds to wait (``0.0`` for a date in the past), or None when the value is absent or
        malformed (``"1m0s"``, ``"-5"``, garbage). Never raises; callers cap huge values.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isdigit() and text.isascii():
        if len(text) > 300:  # more digits than a float holds: "very long", capped by callers
            return 1e300  # finite, so it stays valid JSON wherever it is logged
        return float(int(text))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    try:
        return max(0.0, when.timestamp() - now)
    except (OverflowError, OSError, ValueError):
        return None
