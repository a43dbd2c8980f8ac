"""The client's retry policy and its one pure scheduling function (SPEC §5).

Given how an attempt was classified (:func:`retrysafe.core.classify_response` /
:func:`~retrysafe.core.classify_transport_error`), :func:`next_step` decides the job's next
state and due time. UNKNOWN on exhaustion and 409 polling on its own schedule live here and
nowhere else. No I/O, no clock: ``now`` and ``rng`` are passed in.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, TypeVar

from retrysafe._exceptions import ConfigurationError, RetrysafeWarning
from retrysafe.client._models import JobState
from retrysafe.core import Action, Backoff, Classification, Jitter

__all__ = [
    "MAX_CONCURRENCY",
    "DelayPolicy",
    "RetryPolicy",
    "Step",
    "concurrency_of",
    "count",
    "deadline_passed",
    "next_step",
    "reconcile_step",
    "retry_step",
    "seconds",
    "whole_number",
]

_P = TypeVar("_P")


def policy_or_default(value: object, kind: type[_P], option: str = "policy") -> _P:
    """``value`` when it is a ``kind``; a default ``kind()`` when it is None.

    Raises:
        ConfigurationError: anything else (``option``), e.g. a ``WebhookPolicy`` given to an
            ``Outbox`` or a ``RetryPolicy`` to ``Webhooks``: each would fail later, at the
            first job or endpoint, with an ``AttributeError`` far from its cause.
    """
    if value is None:
        return kind()
    if not isinstance(value, kind):
        if isinstance(value, type):
            got = f"the class {value.__name__}"
            if issubclass(value, kind):
                got += f" (pass an instance, e.g. {value.__name__}())"
        else:
            got = type(value).__name__
        raise ConfigurationError(
            f"{option} must be a {kind.__name__} or None, got {got}", option=option
        )
    return value


def count(value: object, option: str) -> int:
    """``value`` as an integer >= 1 (a concurrency, a limit).

    Raises:
        ConfigurationError: not an integer (bools are refused), or < 1.
    """
    return whole_number(value, option)


#: The most attempts in flight at once (a worker's or ``reconcile``'s ``concurrency``, its
#: ``max_per_destination``; the CLI's ``--concurrency``, the demo's and the proof's). Each
#: attempt may hold a connection, and a process may open 1,024 files by default (``ulimit
#: -n``); the API took 10**9 (a typo for 10 went unnoticed until the sockets ran out).
MAX_CONCURRENCY = 1024


def concurrency_of(value: object, option: str = "concurrency") -> int:
    """``value`` as a number of attempts in flight, 1 to :data:`MAX_CONCURRENCY`.

    Raises:
        ConfigurationError: not an integer (bools are refused), or out of that range.
    """
    return whole_number(value, option, high=MAX_CONCURRENCY)


def whole_number(value: object, option: str, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as an integer from ``low`` to ``high`` (both included; no upper bound when
    ``high`` is None): the one check of the whole-number options of the API, so an option
    told as a string, a float or a bool is refused with the range that holds, as the CLI
    refuses it, instead of failing later with a ``TypeError``.

    Raises:
        ConfigurationError: not an ``int`` (bools are refused), or out of range; ``option``
            names the option.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
        high is not None and value > high
    ):
        want = f">= {low}" if high is None else f"from {low} to {high:,}"
        raise ConfigurationError(
            f"{option} must be an integer {want}, got {value!r}", option=option
        )
    return value


#: The longest duration any option of the API takes, in seconds (about 31 years; the CLI's
#: durations stop there too): RetryPolicy(timeout=1e10) was taken where WebhookPolicy and
#: the command line refused it.
MAX_SECONDS = 1e9


def seconds(
    value: float | timedelta,
    option: str,
    *,
    allow_zero: bool = False,
    high: float | None = MAX_SECONDS,
) -> float:
    """``value`` as positive finite float seconds, at most ``high`` (default
    :data:`MAX_SECONDS`; None: no bound).

    Raises:
        ConfigurationError: not a number/timedelta, not finite, <= 0 (< 0 with
            ``allow_zero``), or above ``high``.
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{option} must be seconds (float) or a timedelta", option=option)
    number = float(value) if abs(value) <= 1e308 else math.inf  # 10**400 overflows float()
    if (
        not math.isfinite(number)
        or number < 0
        or (number == 0 and not allow_zero)
        or (high is not None and number > high)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        if high is not None:
            bound += f" and <= {high:g}"
        raise ConfigurationError(
            f"{option} must be {bound} seconds, got {value!r:.40}", option=option
        )
    return number


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How the outbox worker retries one job (SPEC §5). Frozen; durations in seconds.

    Attributes:
        attempts: counted attempts before the job is parked as UNKNOWN (default 5). 409 polls
            do not count.
        wait_initial: backoff base: the first retry waits up to this (default 1 s).
        wait_max: backoff cap: no retry waits longer (default 30 s).
        jitter: ``Jitter.FULL`` (default), ``EQUAL`` or ``DECORRELATED`` (AWS Builders'
            Library, "Timeouts, retries, and backoff with jitter").
        deadline: default per-job deadline from submission (None: none). No attempt starts
            after it; the job becomes UNKNOWN.
        timeout: total seconds one attempt may take, connect to last body byte (default 10).
        connect_timeout: seconds to connect (default ``min(timeout, 5)``).
        retry_after_max: the largest ``Retry-After`` honoured (default 120 s); larger values
            are capped, malformed ones ignored.
        poll_interval: wait between 409 request-in-progress polls when the server sends no
            ``Retry-After`` (default 1 s).
        polls: 409 polls before the job is parked as UNKNOWN (default 60).

    Raises:
        ConfigurationError: a value that cannot work (timeout <= 0, attempts < 1, …).
    """

    attempts: int = 5
    wait_initial: float | timedelta = 1.0
    wait_max: float | timedelta = 30.0
    jitter: Jitter | str = Jitter.FULL
    deadline: float | timedelta | None = None
    timeout: float | timedelta = 10.0
    connect_timeout: float | timedelta | None = None
    retry_after_max: float | timedelta = 120.0
    poll_interval: float | timedelta = 1.0
    polls: int = 60
    #: The backoff of wait_initial, wait_max and jitter, built once (next_step asks per job).
    _backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("attempts", "polls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be an integer >= 1", option=name)
        for name in ("wait_initial", "wait_max", "timeout", "poll_interval"):
            object.__setattr__(self, name, seconds(getattr(self, name), name))
        object.__setattr__(
            self,
            "retry_after_max",
            seconds(self.retry_after_max, "retry_after_max", allow_zero=True),
        )
        if self.deadline is not None:
            object.__setattr__(self, "deadline", seconds(self.deadline, "deadline"))
        if self.connect_timeout is None:
            object.__setattr__(self, "connect_timeout", min(float(self.timeout_s), 5.0))
        else:
            ct = seconds(self.connect_timeout, "connect_timeout")
            if ct > self.timeout_s:
                warnings.warn(
                    f"connect_timeout {ct} s is longer than the total timeout {self.timeout_s} s",
                    RetrysafeWarning,
                    stacklevel=3,
                )
            object.__setattr__(self, "connect_timeout", ct)
        try:
            jitter = Jitter(self.jitter)
        except ValueError:
            raise ConfigurationError(
                f"jitter must be one of {[j.value for j in Jitter]}, got {self.jitter!r}",
                option="jitter",
            ) from None
        object.__setattr__(self, "jitter", jitter)
        try:
            backoff = Backoff(base=self.wait_initial_s, cap=self.wait_max_s, jitter=jitter)
        except ConfigurationError as exc:  # the backoff's rule, told in this policy's names
            named = {"base": "wait_initial", "cap": "wait_max"}.get(exc.option or "")
            if named is None:
                raise
            raise ConfigurationError(
                f"{exc} (wait_initial {self.wait_initial_s:g} s is the backoff's base, "
                f"wait_max {self.wait_max_s:g} s its cap)",
                option=named,
            ) from None
        object.__setattr__(self, "_backoff", backoff)

    # Normalised views (the constructor converted every duration to float seconds).
    @property
    def wait_initial_s(self) -> float:
        return float(self.wait_initial)  # type: ignore[arg-type]

    @property
    def wait_max_s(self) -> float:
        return float(self.wait_max)  # type: ignore[arg-type]

    @property
    def timeout_s(self) -> float:
        return float(self.timeout)  # type: ignore[arg-type]

    @property
    def connect_timeout_s(self) -> float:
        return float(self.connect_timeout)  # type: ignore[arg-type]

    @property
    def deadline_s(self) -> float | None:
        return None if self.deadline is None else float(self.deadline)  # type: ignore[arg-type]

    @property
    def retry_after_max_s(self) -> float:
        return float(self.retry_after_max)  # type: ignore[arg-type]

    @property
    def poll_interval_s(self) -> float:
        return float(self.poll_interval)  # type: ignore[arg-type]

    @property
    def backoff(self) -> Backoff:
        return self._backoff


@dataclass(frozen=True, slots=True)
class Step:
    """What happens to a job after one attempt.

    Attributes:
        state: PENDING (retry or poll), SUCCEEDED, REJECTED or UNKNOWN.
        due_at: Unix seconds of the next attempt (``now`` for terminal states).
        delay: the chosen wait in seconds (0 for terminal states).
        counted: whether the attempt counts against ``attempts`` (409 polls do not).
        reason: a short explanation for logs (``"retry"``, ``"attempts exhausted"``, …).
    """

    state: JobState
    due_at: float
    delay: float
    counted: bool
    reason: str


def deadline_passed(deadline_at: float | None, now: float) -> bool:
    """True when a job's deadline has passed and no attempt may start."""
    return deadline_at is not None and now >= deadline_at


def next_step(
    classification: Classification,
    *,
    policy: RetryPolicy,
    attempts: int,
    polls: int,
    now: float,
    deadline_at: float | None,
    previous_delay: float,
    retry_after: float | None,
    rng: random.Random,
) -> Step:
    """Decide the job's next state after an attempt (SPEC §5 table).

    Args:
        classification: the attempt's classification.
        policy: the retry policy.
        attempts: counted attempts before this one.
        polls: consecutive 409 polls before this one.
        now: Unix seconds when the attempt ended.
        deadline_at: the job's deadline (Unix seconds) or None.
        previous_delay: the previous backoff delay (decorrelated jitter), 0 if none.
        retry_after: the parsed ``Retry-After`` in seconds (:func:`parse_retry_after`), or
            None when absent or malformed; capped at ``policy.retry_after_max`` here.
        rng: the random source for jitter.

    Returns:
        The :class:`Step`. Exhausted attempts, polls or deadline give UNKNOWN, never a
        silent failure.
    """
    if classification.action is Action.POLL:
        # 409 request-in-progress: the operation runs elsewhere. Poll on its own schedule,
        # never counted as a failure, same key.
        if polls + 1 >= policy.polls:
            return Step(JobState.UNKNOWN, now, 0.0, False, "still in progress after polls")
        capped = None if retry_after is None else min(retry_after, policy.retry_after_max_s)
        delay = capped if capped is not None else policy.poll_interval_s
        return _schedule(delay, now, deadline_at, counted=False, reason="poll")
    return retry_step(
        classification,
        delays=policy.backoff,
        limit=policy.attempts,
        attempts=attempts,
        now=now,
        deadline_at=deadline_at,
        previous_delay=previous_delay,
        retry_after=retry_after,
        retry_after_max=policy.retry_after_max_s,
        rng=rng,
    )


class DelayPolicy(Protocol):
    """How long to wait before a retry: :class:`~retrysafe.core.Backoff` (the outbox) or a
    webhook :class:`~retrysafe.webhooks.Schedule` (SPEC §6)."""

    def delay(self, attempt: int, /, *, previous: float, rng: random.Random) -> float:
        """Seconds before retry number ``attempt`` (0-based); ``previous``: the last wait."""
        ...


def retry_step(
    classification: Classification,
    *,
    delays: DelayPolicy,
    limit: int,
    attempts: int,
    now: float,
    deadline_at: float | None,
    previous_delay: float,
    retry_after: float | None,
    retry_after_max: float,
    rng: random.Random,
) -> Step:
    """The job's next state after an attempt that is not a 409 poll (SPEC §5 table): the one
    rule for succeed / reject / retry-with-backoff / exhausted, whatever the delay policy.

    Args:
        classification: the attempt's classification (its action is not ``POLL``).
        delays: the delay policy (the outbox's backoff, a webhook schedule).
        limit: counted attempts in all, the first included.
        attempts: counted attempts before this one.
        now: Unix seconds when the attempt ended.
        deadline_at: the job's deadline (Unix seconds) or None: a retry due at or after it
            ends the job UNKNOWN instead.
        previous_delay: the previous wait (decorrelated jitter), 0 if none.
        retry_after: the parsed ``Retry-After`` in seconds, or None; it raises the wait
            (capped at ``retry_after_max``) where the classification honours it.
        rng: the random source for jitter.

    Returns:
        The :class:`Step`; exhausted attempts or deadline give UNKNOWN, never a silent failure.
    """
    action = classification.action
    if action is Action.SUCCEED:
        return Step(JobState.SUCCEEDED, now, 0.0, True, "succeeded")
    if action is Action.REJECT:
        return Step(JobState.REJECTED, now, 0.0, True, "rejected")
    if attempts + 1 >= limit:
        return Step(JobState.UNKNOWN, now, 0.0, True, "attempts exhausted")
    delay = delays.delay(attempts, previous=previous_delay or 0.0, rng=rng)
    if classification.honour_retry_after and retry_after is not None:
        delay = max(delay, min(retry_after, retry_after_max))
    return _schedule(delay, now, deadline_at, counted=True, reason="retry")


def _schedule(
    delay: float, now: float, deadline_at: float | None, *, counted: bool, reason: str
) -> Step:
    due = now + delay
    if deadline_at is not None and due >= deadline_at:
        return Step(JobState.UNKNOWN, now, 0.0, counted, "deadline exhausted")
    return Step(JobState.PENDING, due, delay, counted, reason)


def reconcile_step(classification: Classification) -> JobState:
    """The state of an UNKNOWN job after one reconciliation attempt with the same key:
    SUCCEEDED or REJECTED from a definitive (usually replayed) answer, else still UNKNOWN."""
    if classification.action is Action.SUCCEED:
        return JobState.SUCCEEDED
    if classification.action is Action.REJECT:
        return JobState.REJECTED
    return JobState.UNKNOWN
