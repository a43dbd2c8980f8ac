"""Argument types the benchmarks share: a count or a duration that must be positive, refused
by argparse with a usage message (exit 2) instead of a traceback, a division by zero or a
negative rate later."""

from __future__ import annotations

import argparse
import math


def _at_least(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be at least {lowest}, not {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _at_least(text, 0)


def positive_seconds(text: str) -> int:
    """Whole seconds >= 1 (wrk's ``-d`` takes whole seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, not {text}")
    return int(value)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, a rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, not {text}")
    return value
