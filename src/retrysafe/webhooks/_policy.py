"""Webhook delivery policy: the SPEC §6 additions on top of the §5 classification, pure.

* Schedules: :data:`DEFAULT` (base 1 s × 2ⁿ plus up to 1000 ms of jitter, 6 attempts) and
  :data:`SVIX` (immediately, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h — the schedule
  Svix documents for its retries), or your own :class:`Schedule`.
* :func:`decide`: after an attempt, what happens to the delivery: the core classification
  (:func:`retrysafe.core.classify_response`) decides succeed / retry / reject; the schedule
  decides when and how often; ``Retry-After`` raises a delay (capped); a delivery to an
  endpoint disabled meanwhile is parked (CANCELLED, replayable) instead of retried.
* :func:`disables_endpoint` (410 Gone) and :func:`should_auto_disable` (a run of failures
  over a window) decide when an endpoint stops receiving.

No I/O, no clock: ``now`` and ``rng`` are passed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from retrysafe._exceptions import ConfigurationError
from retrysafe.client._models import JobState
from retrysafe.client._policy import Step, retry_step
from retrysafe.core import Action, Classification

__all__ = [
    "DEFAULT",
    "SCHEDULES",
    "SVIX",
    "Schedule",
    "WebhookPolicy",
    "decide",
    "disables_endpoint",
    "rate_gate",
    "should_auto_disable",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """When a delivery's attempts happen.

    Either exponential — retry ``n`` (0-based) waits ``base · 2ⁿ`` seconds (capped at
    ``cap``) plus a uniform jitter in ``[0, jitter)`` rounded to whole milliseconds — or
    explicit ``delays`` (the wait before each retry, in order).

    Attributes:
        name: the name stored with an endpoint (``"default"``, ``"svix"``, …).
        attempts: attempts in all, the first included (``len(delays) + 1`` for explicit
            delays).
        base: seconds, the first retry's wait (exponential).
        cap: seconds, the longest wait (exponential).
        jitter: seconds of jitter added to each wait (default 1.0: up to 1000 ms).
        delays: explicit waits in seconds, or None for exponential.

    Raises:
        ConfigurationError: attempts < 1, a negative or non-finite duration.
    """

    name: str
    attempts: int = 6
    base: float = 1.0
    cap: float = 24 * 3600.0
    jitter: float = 1.0
    delays: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.delays is not None:
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))
            object.__setattr__(self, "attempts", len(self.delays) + 1)
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise ConfigurationError("attempts must be an integer >= 1", option="attempts")
        if self.attempts < 1:
            raise ConfigurationError("attempts must be an integer >= 1", option="attempts")
        for value in (self.base, self.cap, self.jitter, *(self.delays or ())):
            if not math.isfinite(value) or value < 0:
                raise ConfigurationError(
                    f"schedule {self.name!r}: durations must be finite and >= 0",
                    option="schedule",
                )

    def delay(self, retry: int, /, rng: random.Random, *, previous: float = 0.0) -> float:
        """Seconds to wait before retry number ``retry`` (0-based); ``previous`` is unused
        (a :class:`~retrysafe.client._policy.DelayPolicy`)."""
        if self.delays is not None:
            base = self.delays[min(retry, len(self.delays) - 1)] if self.delays else 0.0
        else:
            base = min(self.cap, self.base * math.ldexp(1.0, min(max(retry, 0), 64)))
        jitter = round(rng.uniform(0.0, self.jitter), 3) if self.jitter > 0 else 0.0
        return base + jitter


#: 1 s × 2ⁿ plus up to 1000 ms of jitter; 6 attempts (waits ≈ 1, 2, 4, 8, 16 s).
DEFAULT = Schedule(name="default", attempts=6, base=1.0, jitter=1.0)
#: Svix's documented schedule: immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h.
SVIX = Schedule(
    name="svix",
    delays=(5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0),
    jitter=1.0,
)
#: The schedules an endpoint can name.
SCHEDULES: dict[str, Schedule] = {DEFAULT.name: DEFAULT, SVIX.name: SVIX}


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookPolicy:
    """Delivery rules shared by every endpoint (SPEC §6). Frozen; durations in seconds.

    Attributes:
        schedules: the schedules endpoints may name (default :data:`SCHEDULES`).
        default_schedule: the schedule of an endpoint that names none (``"default"``).
        timeout: total seconds one attempt may take (default 15).
        retry_after_max: the largest ``Retry-After`` honoured (default 3600 s).
        disable_after: consecutive failed attempts that disable an endpoint (default 50),
            provided they span at least ``disable_window``; None never auto-disables.
        disable_window: seconds the failure run must span (default 0: the count alone).

    Raises:
        ConfigurationError: an unknown default schedule or an impossible value.
    """

    schedules: tuple[Schedule, ...] = (DEFAULT, SVIX)
    default_schedule: str = "default"
    timeout: float = 15.0
    retry_after_max: float = 3600.0
    disable_after: int | None = 50
    disable_window: float = 0.0

    def __post_init__(self) -> None:
        names = {s.name for s in self.schedules}
        if self.default_schedule not in names:
            raise ConfigurationError(
                f"default_schedule {self.default_schedule!r} is not one of {sorted(names)}",
                option="default_schedule",
            )
        if self.disable_after is not None and (
            isinstance(self.disable_after, bool) or self.disable_after < 1
        ):
            raise ConfigurationError("disable_after must be >= 1 or None", option="disable_after")
        for name in ("timeout", "retry_after_max", "disable_window"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "timeout" and value == 0):
                raise ConfigurationError(f"{name} has an impossible value", option=name)

    def schedule(self, name: str | None) -> Schedule:
        """The schedule called ``name`` (the default one for None or an unknown name)."""
        for s in self.schedules:
            if s.name == name:
                return s
        return self.schedule(self.default_schedule) if name != self.default_schedule else DEFAULT

    def has_schedule(self, name: str) -> bool:
        return any(s.name == name for s in self.schedules)


def decide(
    classification: Classification,
    *,
    schedule: Schedule,
    attempts: int,
    now: float,
    retry_after: float | None,
    retry_after_max: float,
    endpoint_enabled: bool,
    default: Step,
    rng: random.Random,
    deadline_at: float | None = None,
) -> Step:
    """The delivery's next step after one attempt (SPEC §5 classification + §6 schedule).

    The one retry rule (:func:`retrysafe.client._policy.retry_step`) with the endpoint's
    schedule as its delay policy, plus one §6 rule: a delivery to an endpoint disabled
    meanwhile is parked (CANCELLED, replayable) instead of retried.

    Args:
        classification: the attempt's classification.
        schedule: the endpoint's schedule.
        attempts: counted attempts before this one.
        now: Unix seconds when the attempt ended.
        retry_after: the parsed ``Retry-After`` (seconds) or None.
        retry_after_max: cap for ``retry_after``.
        endpoint_enabled: False when the endpoint was disabled meanwhile.
        default: the outbox's own step (kept for 409 polls).
        rng: jitter source.
        deadline_at: the delivery job's deadline (Unix seconds) or None: a retry due at or
            after it ends the delivery UNKNOWN (the DLQ).

    Returns:
        SUCCEEDED (2xx), REJECTED (other 4xx: never retried), PENDING with the schedule's
        wait (5xx, 408, 429, transport errors), UNKNOWN when the schedule or the deadline is
        exhausted (the DLQ), or CANCELLED when the endpoint is disabled (kept, replayable).
    """
    if classification.action is Action.POLL:
        step = default
    else:
        step = retry_step(
            classification,
            delays=schedule,
            limit=schedule.attempts,
            attempts=attempts,
            now=now,
            deadline_at=deadline_at,
            previous_delay=0.0,
            retry_after=retry_after,
            retry_after_max=retry_after_max,
            rng=rng,
        )
    if step.state is JobState.PENDING and not endpoint_enabled:
        return Step(JobState.CANCELLED, now, 0.0, step.counted, "endpoint disabled")
    return step


def disables_endpoint(status: int | None) -> bool:
    """410 Gone: the receiver says the endpoint no longer exists (SPEC §6)."""
    return status == 410


def should_auto_disable(
    failures: int,
    first_failure_at: float | None,
    now: float,
    *,
    disable_after: int | None,
    disable_window: float,
) -> bool:
    """True when a run of ``failures`` consecutive failed attempts, the first at
    ``first_failure_at``, should disable the endpoint (SPEC §6 "repeated failure over a
    window")."""
    if disable_after is None or failures < disable_after:
        return False
    return first_failure_at is not None and now - first_failure_at >= disable_window


def rate_gate(tat: float, now: float, *, rate: float) -> tuple[float, float]:
    """One slot of a per-endpoint rate limit (GCRA, no burst): attempts are spaced
    ``1 / rate`` seconds apart.

    Args:
        tat: the endpoint's theoretical arrival time (Unix seconds; 0 when new).
        now: Unix seconds.
        rate: attempts per second (> 0).

    Returns:
        ``(wait, new_tat)``: the seconds until this attempt's reserved slot (0: go now) and
        the endpoint's next theoretical arrival time. Every call reserves a slot, so a
        deferred attempt must not call again when it comes back.
    """
    start = max(tat, now)
    return max(0.0, start - now), start + 1.0 / rate
