"""Webhook delivery policy: the SPEC §6 additions on top of the §5 classification, pure.

* Schedules: :data:`DEFAULT` (base 1 s × 2ⁿ plus up to 1000 ms of jitter, 6 attempts) and
  :data:`SVIX` (immediately, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h — the schedule
  Svix documents for its retries), or your own :class:`Schedule`.
* :func:`decide`: after an attempt, what happens to the delivery: the core classification
  (:func:`retrysafe.core.classify_response`) decides succeed / retry / reject; the schedule
  decides when and how often; ``Retry-After`` raises a delay (capped); a delivery to an
  endpoint disabled meanwhile is parked (CANCELLED, replayable) instead of retried.
* :func:`disables_endpoint` (410 Gone: at once) and :func:`should_auto_disable` (a run of
  failures that is both long enough and old enough: :data:`DISABLE_AFTER` failed attempts
  over :data:`DISABLE_WINDOW`, 5 days by default) decide when an endpoint stops receiving.

No I/O, no clock: ``now`` and ``rng`` are passed in.
"""

from __future__ import annotations

import math
import random
import re
import warnings
from dataclasses import dataclass
from datetime import timedelta

from retrysafe._exceptions import ConfigurationError, RetrysafeWarning
from retrysafe.client._models import JobState
from retrysafe.client._policy import MAX_SECONDS, Step, count, retry_step, seconds, whole_number
from retrysafe.core import Action, AttemptOutcome, Classification

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


#: The longest duration a schedule may hold, in seconds: every duration option's bound
#: (:data:`~retrysafe.client._policy.MAX_SECONDS`); a wait of 1e300 s was accepted, and its
#: delivery waited for ever.
MAX_SCHEDULE_SECONDS = MAX_SECONDS
#: A schedule's name: it is stored with endpoints and typed on command lines.
_SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: A schedule's attempts when it says none (explicit delays make their own number).
_DEFAULT_ATTEMPTS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """When a delivery's attempts happen.

    Either exponential — retry ``n`` (0-based) waits ``base · 2ⁿ`` seconds (capped at
    ``cap``) plus a uniform jitter in ``[0, jitter)`` rounded to whole milliseconds — or
    explicit ``delays`` (the wait before each retry, in order).

    Attributes:
        name: the name stored with an endpoint (``"default"``, ``"svix"``, …): 1–64
            characters of ``A-Z a-z 0-9 _ . -``.
        attempts: attempts in all, the first included (``len(delays) + 1`` for explicit
            delays: leave it out, or give that number).
        base: seconds, the first retry's wait (exponential).
        cap: seconds, the longest wait (exponential).
        jitter: seconds of jitter added to each wait (default 1.0: up to 1000 ms).
        delays: explicit waits in seconds, or None for exponential.

    Raises:
        ConfigurationError: a name that is no such token, attempts < 1 (or, with ``delays``,
            another number than theirs), a duration that is no number (a bool, a string), is
            negative or non-finite, or past :data:`MAX_SCHEDULE_SECONDS`.
    """

    name: str
    attempts: int = _DEFAULT_ATTEMPTS
    base: float = 1.0
    cap: float = 24 * 3600.0
    jitter: float = 1.0
    delays: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SCHEDULE_NAME.fullmatch(self.name):
            raise ConfigurationError(
                "a schedule's name (what endpoints call it by) is 1–64 characters of "
                f"A-Z a-z 0-9 _ . -, got {self.name!r}",
                option="schedule",
            )
        whole_number(self.attempts, "attempts")
        if self.delays is not None:
            delays = tuple(self.delays)
            if self.attempts not in (_DEFAULT_ATTEMPTS, len(delays) + 1):
                raise ConfigurationError(
                    f"schedule {self.name!r}: {len(delays)} delays make {len(delays) + 1} "
                    f"attempts, not {self.attempts} (leave attempts out)",
                    option="attempts",
                )
            object.__setattr__(self, "delays", delays)
            object.__setattr__(self, "attempts", len(delays) + 1)
        what = f"schedule {self.name!r}: a duration"
        for name in ("base", "cap", "jitter"):
            value = seconds(getattr(self, name), what, allow_zero=True)
            object.__setattr__(self, name, value)
        if self.delays is not None:
            delays = tuple(
                seconds(d, what, allow_zero=True) for d in self.delays
            )
            object.__setattr__(self, "delays", delays)

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


#: The largest event payload ``send`` records by default, in bytes (1 MiB): the default
#: ``max_body_size`` of retrysafe's own receiver (:class:`~retrysafe.webhooks.WebhookMiddleware`),
#: so what a sender sends by default a receiver takes. A payload is stored once for the event
#: and once per delivery, and each attempt holds it a few times over while it is signed and
#: sent: 60 MB payloads took a worker to 476 MB for one delivery.
DEFAULT_MAX_PAYLOAD = 1024 * 1024
#: How ``send``'s over-limit error says the limit is raised (the CLI names its option instead).
MAX_PAYLOAD_HINT = "WebhookPolicy(max_payload=…) raises it"

#: Consecutive failed attempts an auto-disable needs at least (with :data:`DISABLE_WINDOW`).
DISABLE_AFTER = 50
#: Seconds a failure run must span before it can disable its endpoint: 5 days, Svix's rule
#: ("If all attempts to a specific endpoint fail for a period of 5 days, the endpoint will be
#: disabled", https://docs.svix.com/retries). Far longer than the longest built-in schedule
#: (:data:`SVIX`: ≈ 27.6 h from the first attempt to the last), so every delivery of an outage
#: runs its whole schedule (then waits in the dead-letter queue, replayable) before its
#: endpoint can be disabled, and an endpoint down for a long weekend is not.
DISABLE_WINDOW = 5 * 86400.0
#: Windows shorter than this work but warn: an outage of minutes could disable an endpoint.
SHORT_DISABLE_WINDOW = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookPolicy:
    """Delivery rules shared by every endpoint (SPEC §6). Frozen; durations in seconds.

    Auto-disable (SPEC §6 "repeated failure over a window") needs both a count and a span:
    the endpoint is disabled by a failed attempt that makes its run of consecutive failed
    attempts (any non-2xx answer or transport error; a success ends the run) at least
    ``disable_after`` long *and* at least ``disable_window`` old (its first failure that many
    seconds ago or more). A burst of failures — 50 events refused by one short outage — never
    disables an endpoint nor parks its deliveries: they are retried on their schedule.
    410 Gone disables at once (:func:`disables_endpoint`).

    Attributes:
        schedules: the schedules endpoints may name (default :data:`SCHEDULES`).
        default_schedule: the schedule of an endpoint that names none (``"default"``).
        timeout: total seconds one attempt may take (default 15).
        retry_after_max: the largest ``Retry-After`` honoured (default 3600 s).
        disable_after: the fewest consecutive failed attempts that disable an endpoint
            (default :data:`DISABLE_AFTER`, 50; an integer >= 1), or None: never auto-disable.
        disable_window: seconds (or a timedelta) the failure run must span, from its first
            failure to the one that disables (default :data:`DISABLE_WINDOW`, 5 days, the
            span Svix uses); > 0. Read it as float seconds from :attr:`disable_window_s`.
        max_payload: the largest event payload ``send`` records, in bytes of its JSON
            (default :data:`DEFAULT_MAX_PAYLOAD`, 1 MiB, what retrysafe's receiver reads by
            default); a positive integer.

    Raises:
        ConfigurationError: an unknown default schedule or an impossible value (a count that
            is not an integer >= 1, a window that is not finite and > 0), naming the option.

    Warns:
        RetrysafeWarning: a ``disable_window`` under an hour (:data:`SHORT_DISABLE_WINDOW`):
            an outage that short could disable an endpoint.
    """

    schedules: tuple[Schedule, ...] = (DEFAULT, SVIX)
    default_schedule: str = "default"
    timeout: float = 15.0
    retry_after_max: float = 3600.0
    disable_after: int | None = DISABLE_AFTER
    disable_window: float | timedelta = DISABLE_WINDOW
    max_payload: int = DEFAULT_MAX_PAYLOAD

    def __post_init__(self) -> None:
        names = {s.name for s in self.schedules}
        if len(names) != len(self.schedules):
            raise ConfigurationError(
                "two schedules share a name: an endpoint could not say which it means",
                option="schedules",
            )
        if self.default_schedule not in names:
            raise ConfigurationError(
                f"default_schedule {self.default_schedule!r} is not one of {sorted(names)}",
                option="default_schedule",
            )
        after = self.disable_after
        if after is not None and (
            isinstance(after, bool) or not isinstance(after, int) or after < 1
        ):
            raise ConfigurationError(
                f"disable_after must be an integer >= 1 or None, got {after!r}",
                option="disable_after",
            )
        window = seconds(self.disable_window, "disable_window")
        object.__setattr__(self, "disable_window", window)
        if after is not None and window < SHORT_DISABLE_WINDOW:
            warnings.warn(
                f"disable_window ({window} s) is shorter than an hour: an outage that short "
                f"can disable an endpoint after {after} failed attempts and park its "
                "deliveries",
                RetrysafeWarning,
                stacklevel=3,
            )
        count(self.max_payload, "max_payload")
        seconds(self.timeout, "timeout")
        seconds(self.retry_after_max, "retry_after_max", allow_zero=True)

    @property
    def disable_window_s(self) -> float:
        """``disable_window`` as float seconds."""
        window = self.disable_window
        return window.total_seconds() if isinstance(window, timedelta) else float(window)

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


def ends_failure_run(outcome: str) -> bool:
    """A delivered attempt (a 2xx: outcome ``"success"``) ends its endpoint's run of
    consecutive failures (SPEC §6)."""
    return outcome == AttemptOutcome.SUCCESS.value


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
    """Whether the failed attempt at ``now`` disables its endpoint (SPEC §6 "repeated
    failure over a window"): the endpoint's run of consecutive failed attempts, now
    ``failures`` long and begun at ``first_failure_at``, is at least ``disable_after`` long
    *and* spans at least ``disable_window`` seconds. Both are needed: a burst of failures in
    a short outage is long but not old, one failure days ago is old but not long.

    Args:
        failures: failed attempts in the run, this one included.
        first_failure_at: Unix seconds of the run's first failure (None: no run).
        now: Unix seconds of this failure.
        disable_after: the fewest failures that disable, or None: never.
        disable_window: the shortest span (seconds) that disables; the boundary counts.
    """
    if disable_after is None or failures < disable_after or first_failure_at is None:
        return False
    return now - first_failure_at >= disable_window


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
