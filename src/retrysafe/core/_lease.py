"""Leases and their renewal (SPEC §3 "Lease renewal", §5 "Crash safety", §7) as pure values.

A claim (an idempotency key, an outbox job, an agent write call) is held under a *lease*: if
its claimant stops renewing it, others may take the claim over once the lease ends. A live
claimant renews it every ``heartbeat`` seconds (fenced by its token), so however long the work
runs it is never taken over; the lease only bounds how long a *dead* claimant blocks its claim.
A claimant that is alive but wedged must not hold a claim forever either: renewal stops once the
work has run for ``max_run_time`` seconds, and the lease then runs out.

This module validates those three durations once, for every caller (the middleware, the
gateway, the outbox worker, agent write tools), and says whether renewal goes on. The drivers
that actually renew live in :mod:`retrysafe._heartbeat`. Sources: Temporal's activity
heartbeats, fastapi-idempotency's lease refresh, Kleppmann's fencing tokens.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from datetime import timedelta

from retrysafe._exceptions import ConfigurationError, RetrysafeWarning

__all__ = [
    "MAX_LEASE",
    "MAX_RUN_TIME",
    "MIN_HEARTBEAT",
    "LeaseTiming",
    "lease_timing",
]

#: Longest accepted lease, in seconds (one day): a longer lease is a typo or a misunderstanding
#: (a dead claimant would block its claim for that long). Live work renews; it needs no long lease.
MAX_LEASE = 86_400.0
#: Longest accepted maximum run time, in seconds (seven days).
MAX_RUN_TIME = 7 * 86_400.0
#: Shortest accepted heartbeat interval, in seconds: renewals are store writes.
MIN_HEARTBEAT = 0.05


def _duration(value: float | timedelta, option: str, *, upper: float) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigurationError(
            f"{option} must be seconds (float) or a timedelta, got {value!r}", option=option
        )
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{option} must be > 0 seconds, got {value!r}", option=option)
    if seconds > upper:
        raise ConfigurationError(
            f"{option} must be at most {upper:g} seconds, got {value!r}", option=option
        )
    return seconds


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """Validated lease timing; build it with :func:`lease_timing`. Seconds, floats.

    Attributes:
        lease: how long a claim holds without renewal (``0 < lease <= MAX_LEASE``).
        heartbeat: seconds between renewals (``MIN_HEARTBEAT <= heartbeat < lease``).
        max_run_time: seconds of work after which renewal stops and the lease runs out
            (``0 < max_run_time <= MAX_RUN_TIME``).
    """

    lease: float
    heartbeat: float
    max_run_time: float

    def keeps_renewing(self, started: float, now: float) -> bool:
        """Whether work that started at ``started`` is still renewed at ``now`` (one clock)."""
        return self.renewed_for(started, now) > 0

    def renewed_for(self, started: float, now: float) -> float:
        """Seconds work that started at ``started`` is still renewed for at ``now`` (one
        clock): ``max_run_time`` less its run so far; zero or less once renewal stopped."""
        return self.max_run_time - (now - started)


def lease_timing(
    lease: float | timedelta,
    *,
    heartbeat: float | timedelta | None = None,
    max_run_time: float | timedelta = 3600.0,
    prefix: str = "",
) -> LeaseTiming:
    """Validate a lease, its heartbeat interval and the maximum run time.

    Args:
        lease: seconds (or a timedelta) a claim holds without renewal.
        heartbeat: seconds between renewals; default ``lease / 3``, so two renewals may fail
            (a store hiccup) before the lease ends.
        max_run_time: seconds of work after which renewal stops (default one hour).
        prefix: prepended to option names in errors (``"worker "``).

    Returns:
        The validated :class:`LeaseTiming`.

    Raises:
        ConfigurationError: a value that is not a number or timedelta, not finite, zero or
            negative, larger than its upper bound (``MAX_LEASE``, ``MAX_RUN_TIME``), a
            heartbeat shorter than ``MIN_HEARTBEAT``, or a heartbeat not shorter than the lease
            (the lease would end before the first renewal).

    Warns:
        RetrysafeWarning: a heartbeat longer than half the lease (one late renewal loses it).
    """
    lease_s = _duration(lease, f"{prefix}lease", upper=MAX_LEASE)
    run_s = _duration(max_run_time, f"{prefix}max_run_time", upper=MAX_RUN_TIME)
    if heartbeat is None:
        beat = max(MIN_HEARTBEAT, lease_s / 3.0)
    else:
        beat = _duration(heartbeat, f"{prefix}heartbeat", upper=MAX_LEASE)
        if beat < MIN_HEARTBEAT:
            raise ConfigurationError(
                f"{prefix}heartbeat must be at least {MIN_HEARTBEAT} seconds (each renewal is a "
                f"store write), got {heartbeat!r}",
                option=f"{prefix}heartbeat",
            )
    if beat >= lease_s and heartbeat is None:  # only a lease within the shortest heartbeat
        raise ConfigurationError(
            f"{prefix}lease must be longer than {MIN_HEARTBEAT:g} seconds, the shortest "
            f"heartbeat (the default heartbeat is a third of the lease, at least "
            f"{MIN_HEARTBEAT:g} s): the lease would end before it is renewed, got {lease_s:g}",
            option=f"{prefix}lease",
        )
    if beat >= lease_s:
        raise ConfigurationError(
            f"{prefix}heartbeat ({beat:g} s) must be shorter than the {prefix}lease "
            f"({lease_s:g} s): the lease would end before it is renewed",
            option=f"{prefix}heartbeat",
        )
    if beat > lease_s / 2.0:
        warnings.warn(
            f"{prefix}heartbeat ({beat:g} s) is longer than half the {prefix}lease "
            f"({lease_s:g} s): one late renewal lets another claimant take over live work",
            RetrysafeWarning,
            stacklevel=3,
        )
    return LeaseTiming(lease_s, beat, run_s)
