"""The outbox worker: claim due jobs, send one attempt each, record it, schedule the next.

A thin async driver around the pure rules: :func:`~retrysafe.core.classify_response` and
:func:`~retrysafe.core.classify_transport_error` (what an attempt saw), :func:`next_step`
(what happens next), :class:`RetryBudget` (may this retry go now) and
:class:`~retrysafe.core.LeaseTiming` (how often a held job's lease is renewed). The store
leases jobs atomically, so any number of workers, in any number of processes, can share one
store; while a worker holds a job it renews the job's lease (SPEC §5 "Crash safety").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import signal
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from retrysafe._batch import Batcher
from retrysafe._exceptions import (
    ConfigurationError,
    RetrysafeWarning,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe._heartbeat import AsyncHeartbeat
from retrysafe._wire import check_transport, total_timeout
from retrysafe.client._budget import BudgetState, RetryBudget
from retrysafe.client._jobs import DEFAULT_QUEUE, check_queue, on_submit, shown_destination
from retrysafe.client._limits import DestinationLimits, congested
from retrysafe.client._models import AsyncOutboxStore, Attempt, Finish, Job, JobState
from retrysafe.client._policy import (
    RetryPolicy,
    Step,
    concurrency_of,
    count,
    deadline_passed,
    next_step,
    policy_or_default,
    reconcile_step,
    seconds,
)
from retrysafe.client._sender import SendResult, make_engine, send_attempt
from retrysafe.client._store import StoreArg, open_outbox_store, parked_by
from retrysafe.core import (
    MAX_RUN_TIME,
    Action,
    AttemptOutcome,
    LeaseTiming,
    equal_jitter,
    lease_timing,
)
from retrysafe.observability._telemetry import Telemetry, telemetry_of
from retrysafe.observability._timed import store_kind, timed_store

if TYPE_CHECKING:
    import httpx

    from retrysafe._wire import AddressGuard, Engine

__all__ = [
    "AttemptHooks",
    "AttemptHooksFactory",
    "ReconcileReport",
    "Worker",
    "WorkerStats",
    "areconcile",
    "reconcile",
]

logger = logging.getLogger("retrysafe.client")

AttemptHook = Callable[[Job, Attempt, Step], None]
_T = TypeVar("_T")


class AttemptHooks(Protocol):
    """The hooks of one attempt, awaited on the worker's event loop (so they may use a
    store's async face): created by :meth:`AttemptHooksFactory.attempt` when the attempt
    starts and dropped when it ends, whatever the outcome, so one attempt's state never
    outlives it (like a per-request responder)."""

    # A StoreUnavailableError from gate, headers or decide is ridden out like the worker's
    # own store calls (tried again until the store is back or the lease ends); attempted
    # runs once the attempt is recorded, so it must handle its own.

    async def gate(self, now: float) -> float:
        """Seconds to wait before the attempt may start (0: now). A positive wait defers the
        job like the retry budget does: PENDING, not an attempt, not counted (per-destination
        rate limits)."""
        ...

    async def headers(self) -> Sequence[tuple[str, str]]:
        """Headers to send with this attempt only (they replace same-named stored headers),
        e.g. a fresh webhook signature. An exception releases the job."""
        ...

    async def decide(self, job: Job, result: SendResult, step: Step) -> Step:
        """The step to record instead of the :func:`next_step` default (another schedule,
        another stop rule)."""
        ...

    async def attempted(self, job: Job, attempt: Attempt, step: Step) -> None:
        """After the attempt was recorded (before ``on_attempt``); an exception here is a
        worker error, so a store that is unavailable must be handled here (the attempt is
        recorded already)."""
        ...


class AttemptHooksFactory(Protocol):
    """Makes each attempt's :class:`AttemptHooks`; closed when :meth:`Worker.serve` ends."""

    def attempt(self, job: Job) -> AttemptHooks: ...

    async def aclose(self) -> None: ...


#: The longest wait between two tries of a store that is unavailable (seconds).
STORE_WAIT_MAX = 5.0
#: How many times in a row one job may fail inside the worker (a bug: an exception that is no
#: network or store trouble) before it is parked UNKNOWN instead of released PENDING again;
#: each release waits twice as long as the one before (from the policy's first wait, at most
#: its longest). Without a bound such a job was sent again forever, its attempts never
#: recorded. Counted per worker process.
WORKER_ERRORS_MAX = 3
#: The most jobs whose worker errors are counted at once (the oldest count is dropped).
_WORKER_ERRORS_KEPT = 10_000
#: The longest span (seconds) of one destination's deferred retries (:meth:`_Budgets.defer`):
#: while it stays down each is claimed again about once per span; a deferred retry that no
#: success brings forward (its worker restarted during the outage) waits at most this long
#: past its token. Half the policy's default longest backoff.
DEFERRAL_SPAN_MAX = 15.0
#: How many deferred retries per destination a worker remembers, to make them due early once
#: the destination succeeds again (:meth:`_Budgets.credit`); the others wait for their slot.
_DEFERRED_KEPT = 10_000
#: A deferred retry due within this many seconds is left to come due by itself.
_EARLY_MARGIN = 0.05
#: How long (seconds) a worker run with ``until_idle`` waits for a store that stays unavailable
#: before it gives up with :class:`~retrysafe.StoreUnavailableError` (``store_outage_limit``).
DEFAULT_STORE_OUTAGE_LIMIT = 60.0
#: The worker's default job lease (seconds), whatever the request timeout: a live worker
#: renews the lease of every job it is sending, so the lease only bounds how long the jobs of
#: a dead worker wait before another worker sends them again (SPEC §5 "Crash safety").
DEFAULT_LEASE = 10.0
#: Seconds a graceful stop waits beyond the attempt timeout by default: for the answer's
#: record (and the webhook worker's reads around it) once the attempt itself has ended.
GRACE_MARGIN = 5.0
#: The shortest default ``max_run_time`` (seconds); the default is at least twice the timeout.
DEFAULT_MAX_RUN_TIME = 3600.0


@dataclass
class WorkerStats:
    """Counters since the worker started. ``deferred`` counts retries the retry budget
    postponed and attempts a ``gate`` hook postponed (neither is an attempt); ``held_back``
    counts jobs claimed while their destination was at its limit of attempts in flight and
    given back unstarted (not attempts); ``released`` counts jobs handed back on
    cancel/shutdown, ``unreleased`` those the store could not take back then (locked,
    down: they wait out their lease, then are sent again with the same key);
    ``lease_lost`` counts attempts whose outcome could not be recorded under the job's lease
    (another worker took the job over, or the store stayed unavailable until the lease
    expired: the job is re-sent with the same key); ``store_outages`` counts the times the
    store became unavailable (:class:`~retrysafe.StoreUnavailableError`) and was waited out."""

    claimed: int = 0
    attempts: int = 0
    succeeded: int = 0
    rejected: int = 0
    unknown: int = 0
    retries_scheduled: int = 0
    polls: int = 0
    deferred: int = 0
    held_back: int = 0
    released: int = 0
    unreleased: int = 0
    lease_lost: int = 0
    store_outages: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Budgets:
    """The per-destination buckets (mutable holder around the pure :class:`RetryBudget`), when
    each deferred retry comes due (:meth:`defer`), and which come due early once the
    destination succeeds again (:meth:`credit`)."""

    def __init__(self, budget: RetryBudget) -> None:
        self.budget = budget
        self._state: dict[str, BudgetState] = {}
        #: Per destination whose bucket ran dry: its next deferred retry's slot.
        self._slot: dict[str, float] = {}
        #: Per destination: the retries this worker deferred, as (due at, job id, released at),
        #: oldest first.
        self._deferred: dict[str, collections.deque[tuple[float, str, float]]] = {}
        #: Seconds between two deferred retries' slots: the refill of one retry; by successes
        #: only, a bucketful of retries in the second that was waited before.
        if budget.refill_per_second > 0:
            self.step = budget.retry_cost / budget.refill_per_second
        elif budget.retry_cost > 0:
            self.step = 1.0 / max(1.0, budget.capacity / budget.retry_cost)
        else:  # retries cost nothing: none is ever deferred
            self.step = 1.0
        #: The longest span of one destination's slots (see :meth:`defer`).
        self.span_max = max(DEFERRAL_SPAN_MAX, self.step)

    def spend(self, destination: str, now: float) -> tuple[bool, float]:
        state = self._state.get(destination) or self.budget.full(now)
        allowed, wait, new = self.budget.spend(state, now)
        self._state[destination] = new
        return allowed, wait

    def defer(self, destination: str, now: float, wait: float, rng: random.Random) -> float:
        """When a retry that :meth:`spend` refused (``wait`` seconds until a token) comes due
        (Unix seconds); :meth:`deferred` remembers it once the store has it.

        A destination's deferred retries take slots one refill of a retry apart (``step``)
        from ``now + wait`` on, so each finds the token the refill made for it, plus a jitter
        of up to one step; they come due earlier when the destination succeeds again
        (:meth:`credit`). The slots span at most :data:`DEFERRAL_SPAN_MAX`; past that they
        start again from the front, so a retry that nobody brings forward (its worker
        stopped) comes due within that span, and each is claimed again about once per span
        while the destination stays down. Before, every deferred retry came due within
        ``2 * wait`` (a tenth of a second by default): while a destination stayed down, the
        worker claimed and deferred each of them again each time one token refilled, 123,560
        deferrals in 10 s for 2,000 jobs to a failing destination, against 6,074 now (README,
        "Retry budget deferrals").
        """
        start = now + wait
        slot = self._slot.get(destination, start)
        if not start <= slot < start + self.span_max:  # the front again (NaN-proof)
            slot = start
        self._slot[destination] = slot + self.step
        return slot + rng.uniform(0, self.step)

    def deferred(self, destination: str, job_id: str, due: float, released: float) -> None:
        """Remember that the store holds ``job_id`` PENDING until ``due`` (:meth:`defer`), as
        released at ``released``, so that a success may bring it forward. Only once the store
        has it: a bring-forward that ran while the job was still leased matched nothing, and
        the job then waited for its slot."""
        deferred = self._deferred.get(destination)
        if deferred is None:
            deferred = self._deferred[destination] = collections.deque(maxlen=_DEFERRED_KEPT)
        deferred.append((due, job_id, released))  # one whose time passed is skipped by credit

    def credit(self, destination: str, now: float) -> list[tuple[str, float, float]]:
        """Put a success's credit in the destination's bucket; the (job id, due at, released
        at) of the
        deferred retries that the bucket's tokens now pay for and that were due later than
        :data:`_EARLY_MARGIN` from now, earliest remembered first: the worker makes them due
        now."""
        state = self._state.get(destination)
        if state is None:  # never spent, or refilled since: a full bucket gains nothing
            return []
        state = self.budget.credit(state, now)
        if state.tokens >= self.budget.capacity:
            del self._state[destination]  # full again: the same as never spent
            self._slot.pop(destination, None)
        else:
            self._state[destination] = state
        deferred = self._deferred.get(destination)
        if not deferred:
            return []
        early: list[tuple[str, float, float]] = []
        paid = math.floor(state.tokens / self.budget.retry_cost) if self.budget.retry_cost else 0
        later = now + _EARLY_MARGIN
        while deferred and len(early) < paid:
            due, job_id, released = deferred.popleft()
            if due > later:
                early.append((job_id, due, released))
        if not deferred:
            del self._deferred[destination]
        return early


class _StoreOutage:
    """Rides out a store that is unavailable for a while (locked past its busy timeout,
    restarting, disk full): operations are tried again with capped exponential backoff
    (equal jitter, never zero); one warning per outage, one line when the store is back.
    Other errors (:class:`~retrysafe.SchemaError`, bugs) are never retried."""

    def __init__(
        self,
        url: str,
        *,
        base: float,
        rng: random.Random,
        clock: Callable[[], float],
        stats: WorkerStats | None = None,
    ) -> None:
        self.url = url
        self.base = base
        self.cap = max(base, STORE_WAIT_MAX)
        self._rng = rng
        self._clock = clock
        self._stats = stats
        self.down_since: float | None = None
        #: The error of the current outage's latest failure (None: no outage).
        self.last_error: StoreUnavailableError | None = None

    def failed(self, exc: StoreUnavailableError, tries: int) -> float:
        """Note a failure; return how long to wait before try ``tries + 1``."""
        self.last_error = exc
        if self.down_since is None:
            self.down_since = self._clock()
            if self._stats is not None:
                self._stats.store_outages += 1
            logger.warning("store unavailable, retrying until it is back: %s", exc)
        return equal_jitter(tries, base=self.base, cap=self.cap, rng=self._rng)

    def outlasted(self, limit: float) -> float | None:
        """Seconds the current outage has lasted, if it reached ``limit``; else None."""
        if self.down_since is None:
            return None
        lasted = self._clock() - self.down_since
        return lasted if lasted >= limit else None

    def left(self, limit: float) -> float:
        """Seconds until the current outage reaches ``limit`` (``limit`` if none)."""
        if self.down_since is None:
            return limit
        return max(0.0, limit - (self._clock() - self.down_since))

    def succeeded(self) -> None:
        if self.down_since is not None:
            logger.warning(
                "store %s is available again after %.1f s",
                self.url,
                self._clock() - self.down_since,
            )
            self.down_since = None
            self.last_error = None

    async def call(
        self, op: Callable[[], Awaitable[_T]], *, until: float | Callable[[], float]
    ) -> _T:
        """``await op()``, tried again through an outage until the clock passes ``until``
        (Unix seconds, or a function returning them: a lease end that renewals move).

        Raises:
            StoreUnavailableError: still unavailable at ``until``.
        """
        tries = 0
        while True:
            try:
                result = await op()
            except StoreUnavailableError as exc:
                wait = self.failed(exc, tries)
                left = (until() if callable(until) else until) - self._clock()
                if left <= 0:
                    raise
                tries += 1
                await asyncio.sleep(min(wait, left))
                continue
            if tries:  # this operation failed in the outage and has now gone through: over
                self.succeeded()
            return result


#: Seconds a cancelled worker waits for a claim already sent, to give its jobs back.
_CLAIM_WAIT = 5.0


def adapt_limit(limits: DestinationLimits, job: Job, result: SendResult, timeout: float) -> None:
    """Adapt the limit of ``job``'s destination to how its attempt ended (its duration, and
    whether it was congested: :func:`~retrysafe.client._limits.congested`, ``timeout`` in
    seconds); log when the destination goes down to one attempt in flight or back up. The
    worker's rule, and reconcile's."""
    limits.took(job.destination, result.duration)
    change = limits.answered(
        job.destination,
        congested=congested(result.error_type, result.status, result.duration, timeout),
        now=time.monotonic(),
        window=timeout,
    )
    if change == "down":
        logger.warning(
            "destination %s: attempts time out (or fail after half the timeout); one "
            "attempt in flight to it until its attempts end in time",
            shown_destination(job.destination),
        )
    elif change == "up":
        logger.info(
            "destination %s answers in time again: up to %d attempts in flight to it",
            shown_destination(job.destination),
            limits.cap,
        )


class _DestinationSlots:
    """``concurrency`` slots shared by jobs that all wait at once (reconcile claims every job
    first), given out by their destinations' limits (:class:`DestinationLimits`): a slot
    that frees goes to the first waiting job whose destination may start one, so the jobs to
    an endpoint that never answers do not hold back the others (they waited behind it, one
    timeout after another, in claim order). Only when no waiting job's destination may
    start does a free slot go to the first waiting job anyway: a slot never idles while a
    job waits (a reconcile of jobs all to one hung endpoint takes as long as it used to).
    """

    def __init__(self, concurrency: int, limits: DestinationLimits) -> None:
        self.free = concurrency
        self.limits = limits
        self.waiting: list[tuple[str, asyncio.Future[None]]] = []

    async def acquire(self, destination: str) -> None:
        if self.free > 0 and not self.waiting:
            self.limits.start(destination, force=True)
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((destination, future))
        if self.free > 0:  # the jobs waiting before it may all be to full destinations
            self._hand_on()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # handed a slot, then cancelled
                self.release(destination)
            elif (destination, future) in self.waiting:
                self.waiting.remove((destination, future))
            raise

    def release(self, destination: str) -> None:
        self.limits.end(destination)
        self.free += 1
        self._hand_on()

    def _hand_on(self) -> None:
        """Give free slots to the first waiting jobs whose destinations may start, then any
        slot still free to the first waiting jobs."""
        for force in (False, True):
            kept: list[tuple[str, asyncio.Future[None]]] = []
            for destination, future in self.waiting:
                if future.done():
                    continue
                if self.free > 0 and self.limits.start(destination, force=force):
                    self.free -= 1
                    future.set_result(None)
                else:
                    kept.append((destination, future))
            self.waiting = kept
            if not self.free or not kept:
                return


#: With a backlog, a worker claims at once when at least this many slots are free (a quarter
#: of its concurrency, at least 1), not once per finished job: one claim statement for 8 jobs
#: costs SQLite about twice one for 1 job, not eight times (README, "What a claim costs"),
#: and each claim is a task and two wake-ups of the worker's loop.
_CLAIM_BATCH_MAX = 8
#: Seconds the first free slot waits for company, at most, before fewer are claimed; a
#: deadline from when it freed, which wakes (a stream of submits) never extend. It waits only
#: when the recent attempts (the last ``4 * claim_at`` to end) say a batch can gather: the
#: slots that keep ending attempts — their rate times their mean duration (Little's law) —
#: number at least a batch. Where a few slots are usable and the rest hang, the free slots
#: are claimed at once.
_CLAIM_DELAY = 0.005
#: After a claim that skipped destinations at their limit and found fewer jobs than free
#: slots, the next claim skipping the same ones waits this many times as long as that claim
#: took. The store walks past every due job of a skipped destination to find the others
#: (about 40 ms for 100,000 on SQLite), so a long backlog to a destination that never answers
#: costs at most a tenth of the worker's time; a claim after a skipped destination's slot
#: freed is not held.
_SKIP_SCAN_SHARE = 9.0
#: The ``last_error`` of a job whose attempt was cancelled (a stop's grace ran out, Ctrl-C): it
#: is not counted, but its request may have reached the server.
_CUT_OFF = (
    "cancelled during its attempt: the request may have been sent; it is sent again with the "
    "same key"
)


def _max_run_time(value: float | timedelta | None, policy: RetryPolicy) -> float | timedelta:
    """The worker's ``max_run_time``: the default (an hour, at least twice the timeout) or
    ``value``, which :func:`~retrysafe.core.lease_timing` then validates.

    Warns:
        RetrysafeWarning: ``value`` shorter than the request timeout (a slow attempt would
            stop renewing its lease and could be sent again while it still runs).
    """
    if value is None:
        return min(MAX_RUN_TIME, max(DEFAULT_MAX_RUN_TIME, 2.0 * policy.timeout_s))
    given = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(given, (int, float))
        and not isinstance(given, bool)
        and 0 < given < policy.timeout_s
    ):
        warnings.warn(
            f"max_run_time ({given:g} s) is shorter than the request timeout "
            f"({policy.timeout_s:g} s): an attempt slower than it stops renewing its lease, "
            "and another worker may send the job again while it still runs",
            RetrysafeWarning,
            stacklevel=3,
        )
    return value


class _JobLease:
    """The lease of one claimed job while this worker holds it (SPEC §5 "Crash safety").

    Made when the job's processing starts and dropped with it (``with`` stops the renewals),
    so nothing about the job outlives its attempt. Every ``timing.heartbeat`` seconds it
    renews the lease (fenced by the token): a slow attempt is never claimed by another worker
    while this one lives, and a dead worker's jobs wait at most one lease.

    Attributes:
        expires_at: the last known lease end (Unix seconds): writes of this job are retried
            through a store outage until then.
    """

    __slots__ = (
        "_astore",
        "_beat",
        "_clock",
        "_loop",
        "_lost",
        "_outage",
        "_settling",
        "expires_at",
        "job",
        "recording",
        "timing",
        "token",
    )

    def __init__(
        self,
        job: Job,
        *,
        astore: AsyncOutboxStore,
        timing: LeaseTiming,
        clock: Callable[[], float],
        outage: _StoreOutage,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.job = job
        self._loop = loop  # the running loop, if known (the heartbeat needs not look it up)
        self.token = job.lease_token or ""
        self.timing = timing
        self.expires_at = job.lease_expires_at or (clock() + timing.lease)
        self._lost = False
        self._settling = False
        #: While an answered attempt's outcome is being written: how to write it (the
        #: Finish, made with the current token), its result and step.
        self.recording: tuple[Callable[[], Finish], SendResult, Step] | None = None
        self._astore = astore
        self._clock = clock
        self._outage = outage
        self._beat = AsyncHeartbeat(
            self._renew,
            timing,
            clock=clock,
            on_lost=self._on_lost,
            on_expired=self._on_expired,
            on_error=self._on_error,
        )

    def __enter__(self) -> _JobLease:
        self._beat.start(self._loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._beat.stop()

    def until(self) -> float:
        return self.expires_at

    def adopt(self, claimed: Job) -> None:
        """This worker's own claim brought the job back (its lease ran out while the store
        was unavailable, and nobody else took it): the attempt goes on, and its outcome is
        written, under the new token (the old one no longer holds the job)."""
        self.token = claimed.lease_token or self.token
        self.expires_at = claimed.lease_expires_at or self.expires_at
        self._lost = False
        logger.debug("job=%s claimed again by its own worker: lease renewed", self.job.id)

    def is_lost(self) -> bool:
        """A renewal was refused: another claimant holds the job (or it was finished,
        released or deleted elsewhere). This worker must not record its outcome."""
        return self._lost

    def settle(self) -> None:
        """The attempt is over and its outcome (or a release) is being written: renewal goes
        on while that write is retried, no longer bounded by ``max_run_time``; the fenced
        write itself now says whether the job is still ours."""
        self._settling = True
        self._beat.bounded = False

    async def _renew(self) -> bool:
        at, token = self._clock(), self.token
        lease = self.timing.lease
        renewed = await self._astore.extend_job_lease(self.job.id, token, now=at, lease=lease)
        if renewed:
            self.expires_at = max(self.expires_at, at + lease)
        return renewed or self.token != token  # adopted meanwhile: the new token holds it

    def _on_lost(self) -> None:
        self._lost = True
        if self._settling:  # possibly our own write that just ended the lease
            return
        logger.error(
            "job=%s key=%s lease lost: a renewal was refused (another worker took the job "
            "over, or it was finished, released or deleted elsewhere); this worker will not "
            "record the outcome of its attempt",
            self.job.id,
            self.job.key,
        )

    def _on_expired(self) -> None:
        logger.warning(
            "job=%s key=%s has been processed for max_run_time (%g s): its lease is no longer "
            "renewed and ends within %g s; another worker may then send it again (same key)",
            self.job.id,
            self.job.key,
            self.timing.max_run_time,
            self.timing.lease,
        )

    def _on_error(self, exc: BaseException) -> None:
        if isinstance(exc, StoreUnavailableError):
            self._outage.failed(exc, 0)  # one warning per outage; retried at the next beat
            return
        logger.warning(
            "job=%s key=%s lease renewal failed (tried again at the next heartbeat): %r",
            self.job.id,
            self.job.key,
            exc,
        )


class Worker:
    """Delivers outbox jobs: at-least-once sends, one key per job, effects made exactly-once by
    the server's idempotency layer (SPEC §5).

    Args:
        store: a SQLite or PostgreSQL store, another outbox store, or a URL
            (``sqlite:///path.db``).
        policy: retries, backoff and timeouts (default :class:`RetryPolicy`).
        concurrency: attempts in flight at once, 1 to 1,024 (``MAX_CONCURRENCY``; default 8).
        max_per_destination: attempts in flight at once to one destination
            (``scheme://host:port``) at most (default: ``concurrency``). Below it each
            destination's limit adapts (AIMD, :mod:`retrysafe.client._limits`): an attempt
            that times out, or fails after half the timeout, halves it (down to 1) when
            another of the last eight did too; every other ending adds one per round trip; the
            throttled destinations share half the slots. So a destination that stops
            answering keeps one slot and the others keep flowing. A destination whose
            attempts take a second or more on average (slow successes) shares half the
            slots with the other slow ones before the others' due jobs are claimed, and
            what is left after them.
        lease: seconds a claimed job stays leased without renewal (default 10, whatever the
            request timeout). While the worker holds a job it renews the lease every
            ``heartbeat`` seconds (fenced by the lease token), so an attempt slower than the
            lease is never sent by a second worker at the same time; the lease only bounds how
            long the jobs of a worker that died (SIGKILL, power loss) wait before another
            worker sends them again with the same key. A short lease is therefore safe with a
            long timeout.
        heartbeat: seconds between renewals (default ``lease / 3``: two renewals may fail
            before the lease ends); must be shorter than the lease, and a warning above half
            of it.
        max_run_time: seconds after which a job's lease is no longer renewed while its attempt
            runs (a wedged worker must not hold a job forever); its outcome is still recorded
            if the lease holds. Default one hour, at least twice the timeout; a warning when
            shorter than the timeout.
        poll_interval: seconds between store polls when idle (default 0.2); in-process
            submissions wake the worker at once.
        budget: per-destination retry budget (default :class:`RetryBudget`); None disables.
        grace: seconds :meth:`stop` lets in-flight attempts finish before releasing them
            (default: the policy's attempt timeout plus :data:`GRACE_MARGIN`, so every
            attempt in flight ends by itself, answered or timed out, and is recorded). An
            attempt cut off by a shorter grace goes back to PENDING uncounted, same key, its
            ``last_error`` saying it may have been sent.
        transport: an ``httpx.AsyncBaseTransport`` to send through (tests, proxies, your
            own instrumentation); default: retrysafe's aiohttp engine (no retries, no
            redirects, connect and read timeouts from ``policy``; :mod:`retrysafe._wire`).
        address_guard: checks every destination before a connection is made (the webhook
            worker's SSRF guard, SPEC §6); applies to the default engine only (a
            ``transport`` is guarded by wrapping it, e.g. in
            :class:`~retrysafe.webhooks.PinnedTransport`).
        rng: random source for jitter (seed it in tests).
        clock: Unix-seconds clock.
        on_attempt: called after every recorded attempt with ``(job, attempt, step)``.
        attempt_hooks: makes one :class:`AttemptHooks` per attempt (gate, per-attempt
            headers, the step to record, after the record), awaited on the loop; the webhook
            worker signs, schedules and rate-limits each attempt this way.
        queue: the queue whose jobs it claims (default ``"default"``, the outbox's; the
            webhook worker uses ``"webhooks"``). Jobs of other queues in the same store are
            never claimed, and ``until_idle`` only waits for this queue.
        store_outage_limit: seconds a run with ``until_idle`` waits for a store that stays
            unavailable before :meth:`serve` gives up with
            :class:`~retrysafe.StoreUnavailableError` (default 60, on the worker's clock);
            None waits for ever. A run without ``until_idle`` always waits for the store.
        telemetry: a :class:`~retrysafe.observability.Prometheus`, an
            :class:`~retrysafe.observability.OpenTelemetry` or a list of both: every attempt
            (its span, its outcome and status class), retry-budget deferral and store
            operation is reported to it. Default None.

    Raises:
        ConfigurationError: bad concurrency/max_per_destination/poll interval/grace/queue
            name/store outage limit; a lease, heartbeat or max_run_time that is not finite,
            <= 0 or too large (see :func:`~retrysafe.core.lease_timing`), a heartbeat not
            shorter than the lease; a ``transport`` that is not an async httpx transport; or
            a store without an outbox.

    Warns:
        RetrysafeWarning: a heartbeat longer than half the lease; a max_run_time shorter
            than the request timeout.
    """

    def __init__(
        self,
        store: StoreArg,
        *,
        policy: RetryPolicy | None = None,
        concurrency: int = 8,
        max_per_destination: int | None = None,
        lease: float | timedelta | None = None,
        heartbeat: float | timedelta | None = None,
        max_run_time: float | timedelta | None = None,
        poll_interval: float | timedelta = 0.2,
        budget: RetryBudget | None = RetryBudget(),  # noqa: B008 - frozen value
        grace: float | timedelta | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        address_guard: AddressGuard | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
        on_attempt: AttemptHook | None = None,
        attempt_hooks: AttemptHooksFactory | None = None,
        queue: str = DEFAULT_QUEUE,
        store_outage_limit: float | timedelta | None = DEFAULT_STORE_OUTAGE_LIMIT,
        telemetry: Telemetry | Sequence[Telemetry] | None = None,
    ) -> None:
        self.queue = check_queue(queue)
        self._telemetry = telemetry_of(telemetry)
        self.store_outage_limit = (
            None
            if store_outage_limit is None
            else seconds(store_outage_limit, "store_outage_limit")
        )
        self.policy = policy_or_default(policy, RetryPolicy)
        if budget is not None:  # None: no budget; a dict or a number failed at the first retry
            budget = policy_or_default(budget, RetryBudget, "budget")
        self.concurrency = concurrency_of(concurrency)
        self.max_per_destination = min(
            self.concurrency,
            self.concurrency
            if max_per_destination is None
            else concurrency_of(max_per_destination, "max_per_destination"),
        )
        self._claim_at = max(1, min(_CLAIM_BATCH_MAX, self.concurrency // 4))
        self._reset_claims()
        self.timing = lease_timing(
            DEFAULT_LEASE if lease is None else lease,
            heartbeat=heartbeat,
            max_run_time=_max_run_time(max_run_time, self.policy),
        )
        self.lease = self.timing.lease
        self.poll_interval = seconds(poll_interval, "poll_interval")
        self.grace = (
            self.policy.timeout_s + GRACE_MARGIN
            if grace is None
            else seconds(grace, "grace", allow_zero=True)
        )
        check_transport(transport)
        self.store, self._owns_store = open_outbox_store(store)
        # The async face serve() runs on (closed when it returns; it reopens if run again).
        self._astore = timed_store(
            self.store.asyncio_outbox_store(), self._telemetry, store_kind(self.store)
        )
        self._budgets = None if budget is None else _Budgets(budget)
        self._early: set[asyncio.Task[None]] = set()  # see _bring_forward
        self._transport = transport
        self._guard = address_guard
        #: The attempt records, batched (see :mod:`retrysafe._batch`): every finish that
        #: arrives while the previous batch is being written goes to the store in one
        #: ``finish_attempts`` call, one transaction. Each is still fenced by its own lease
        #: token, and each caller gets its own result (or the batch's error, and retries alone).
        self._finishes: Batcher[Finish, Attempt | None] | None = None
        self._rng = rng or random.Random()
        self._clock = clock
        self._on_attempt = on_attempt
        self._attempt_hooks = attempt_hooks
        self._fatal: SchemaError | None = None
        #: Job id -> worker errors in a row (see WORKER_ERRORS_MAX).
        self._worker_errors: dict[str, int] = {}
        self.stats = WorkerStats()
        self._outage = _StoreOutage(
            self.store.url,
            base=min(self.poll_interval, 1.0),
            rng=self._rng,
            clock=clock,
            stats=self.stats,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._running = False

    def __repr__(self) -> str:
        return f"Worker({self.store!r}, queue={self.queue!r}, concurrency={self.concurrency})"

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """Graceful shutdown, from any thread or a signal handler: stop claiming, let in-flight
        attempts finish for up to ``grace`` seconds, release the rest (PENDING, same key)."""
        self._stopping = True
        self._wake_threadsafe()

    def _wake_threadsafe(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            if asyncio.get_running_loop() is loop:
                wake.set()
                return
        except RuntimeError:
            pass
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    def close(self) -> None:
        """Close the store if the worker opened it from a URL. Idempotent."""
        if self._owns_store:
            self.store.close()
            self._owns_store = False

    def run(self, *, until_idle: bool = False, handle_signals: bool = False) -> WorkerStats:
        """Run :meth:`serve` in a new event loop (blocking). See :meth:`serve`."""
        return asyncio.run(self.serve(until_idle=until_idle, handle_signals=handle_signals))

    def run_until_idle(self) -> WorkerStats:
        """Run until no job is PENDING or IN_FLIGHT (every job SUCCEEDED, REJECTED, UNKNOWN or
        CANCELLED), waiting for backoff delays in real time. Blocking."""
        return self.run(until_idle=True)

    # ------------------------------------------------------------------ main loop
    async def serve(self, *, until_idle: bool = False, handle_signals: bool = False) -> WorkerStats:
        """Claim and deliver jobs until :meth:`stop` (or, with ``until_idle``, until no job is
        PENDING or IN_FLIGHT).

        Cancelling the task running it (Ctrl-C) cancels in-flight attempts: they are not
        retried and not counted, and their jobs go back to PENDING with the same key.

        A store that is unavailable for a while (:class:`~retrysafe.StoreUnavailableError`:
        locked past its busy timeout, read-only, disk full, unreachable) does not stop the
        worker: claims and writes are tried again with capped backoff (up to
        ``STORE_WAIT_MAX`` seconds apart), with one warning per outage. An attempt's outcome is
        retried only while the job's lease is valid; after that the job is re-sent with the
        same key, which the server's replay makes safe. Without ``until_idle`` the worker waits
        for the store for ever; with it, it gives up once the store has been unavailable
        without a break for ``store_outage_limit`` seconds (one last try at that moment).

        Args:
            until_idle: return once every job of the worker's queue is terminal.
            handle_signals: install SIGTERM (graceful :meth:`stop`) on the running loop.

        Returns:
            The worker's :class:`WorkerStats`.

        Raises:
            SchemaError: the store has no (or a newer) retrysafe schema.
            StoreUnavailableError: (``until_idle`` only) the store stayed unavailable for
                ``store_outage_limit`` seconds; the message says for how long, and the last
                error is chained.
            StoreError: any other store failure that waiting cannot fix.
        """
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        self._stopping = False
        self._fatal = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        wake = self._wake = asyncio.Event()
        unsubscribe = on_submit(self.store.url, self._wake_threadsafe)
        if handle_signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGTERM, self.stop)
        tasks: set[asyncio.Task[None]] = set()
        forced = False
        self._finishes = Batcher(self._astore.finish_attempts, loop=loop)
        client = make_engine(
            self.policy,
            transport=self._transport,
            max_connections=max(self.concurrency, 1),
            guard=self._guard,
        )

        claim_at = self._claim_at
        self._reset_claims()
        ended, started = self._ended, self._started
        limits, destinations = self._limits, self._destinations

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            limits.end(destinations.pop(task))
            # With a backlog, wake for the first free slot (it may wait for company) and
            # from claim_at free slots on; in between the loop sleeps through.
            now = loop.time()
            ended.append((now, now - started.pop(task, now)))
            free = self.concurrency - len(tasks)
            if free == 1:
                self._first_free_at = now
            if free == 1 or free >= claim_at or not self._backlog:
                wake.set()

        failures = 0
        try:
            while not self._stopping:
                wake.clear()
                answered = self._answered_claims
                try:
                    timeout = await self._poll(client, tasks, done, until_idle)
                except StoreUnavailableError as exc:
                    timeout = self._outage.failed(exc, failures)
                    failures += 1
                    limit = self.store_outage_limit if until_idle else None
                    if limit is not None:
                        self._give_up_after(limit, exc)
                        timeout = min(timeout, self._outage.left(limit))
                else:
                    failures = 0
                    limit = self.store_outage_limit if until_idle else None
                    if self._answered_claims != answered:  # the store took a claim
                        self._outage.succeeded()
                    elif limit is not None and self._outage.last_error is not None:
                        # Every slot busy writing through the outage: its limit still holds.
                        self._give_up_after(limit, self._outage.last_error)
                        if timeout is not None:
                            timeout = min(timeout, self._outage.left(limit))
                if timeout is None:
                    break
                probe = self._limits.probe_wait(loop.time())
                if probe is not None and len(tasks) < self.concurrency:
                    # A probe that takes a second makes its destination slow: look again
                    # then, so the slots it holds back go to work (client/_limits.py).
                    timeout = min(timeout, probe + 0.001)
                if timeout > 0 and not wake.is_set():
                    # Not asyncio.wait_for: on 3.11 it drops a cancellation (Ctrl-C) that
                    # lands in the turn its inner wait finishes (a wake-up): the worker ran on.
                    with contextlib.suppress(asyncio.TimeoutError):
                        async with total_timeout(timeout, loop):
                            await wake.wait()
                else:
                    await asyncio.sleep(0)
            # Graceful stop: let in-flight attempts finish, then release the rest.
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=self.grace)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            if self._fatal is not None:
                raise self._fatal
        except BaseException:  # cancelled (Ctrl-C), or a store error waiting cannot fix
            for task in tasks:
                task.cancel()
            if tasks:
                try:
                    await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
                except asyncio.CancelledError:
                    # Cancelled again (a third Ctrl-C) while the jobs were given back: the
                    # give-backs are cut short, each counted unreleased; nothing else waits.
                    forced = True
                    cut = (*tasks, *self._holding)
                    for task in cut:
                        task.cancel()
                    await asyncio.gather(*cut, return_exceptions=True)
                    raise
            raise
        finally:
            unsubscribe()
            if handle_signals:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signal.SIGTERM)
            if self._holding and not forced:  # give-backs on their way: let them land
                with contextlib.suppress(Exception):
                    await asyncio.shield(asyncio.gather(*self._holding, return_exceptions=True))
            with contextlib.suppress(Exception):
                await asyncio.shield(client.aclose())
            with contextlib.suppress(Exception):
                await asyncio.shield(self._astore.aclose())
            if self._attempt_hooks is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._attempt_hooks.aclose())
            self._running = False
            self._loop = None
            self._wake = None
        return self.stats

    def _give_up_after(self, limit: float, exc: StoreUnavailableError) -> None:
        """Raise once the current store outage has lasted ``limit`` seconds."""
        lasted = self._outage.outlasted(limit)
        if lasted is None:
            return
        raise StoreUnavailableError(
            f"store {self.store.url} has been unavailable for {lasted:.1f} s "
            f"(store_outage_limit {limit:g} s); giving up: {exc}",
            store=exc.store or self.store.url,
        ) from exc

    def _reset_claims(self) -> None:
        """The claim batching's state, as at the start of :meth:`serve`."""
        #: Whether the last claim filled every free slot (there may be more due jobs).
        self._backlog = False
        #: Claims the store has answered: a poll that made none (every slot busy) says
        #: nothing about a store outage, so it does not end one.
        self._answered_claims = 0
        #: When the first slot freed since the last claim (loop time).
        self._first_free_at = -math.inf
        #: The last ``4 * _claim_at`` attempts to end: (loop time it ended, seconds it ran).
        self._ended: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=4 * self._claim_at
        )
        #: When each running attempt's job was claimed (loop time).
        self._started: dict[asyncio.Task[None], float] = {}
        #: Attempts in flight per destination, and each one's limit.
        self._limits: DestinationLimits = DestinationLimits(
            self.max_per_destination, self.concurrency
        )
        #: The destination of each running attempt's job.
        self._destinations: dict[asyncio.Task[None], str] = {}
        #: After a claim that skipped destinations and still found fewer jobs than slots:
        #: (loop time before which the same skips are not claimed with again, the skips).
        self._skipped_short: tuple[float, frozenset[str]] | None = None
        #: Destinations with more due jobs than they may start: claimed one at a time, each
        #: up to its allowance, the least recently served first (loop time it was served).
        self._backlogged: set[str] = set()
        self._served: dict[str, float] = {}
        #: The slow destinations (client/_limits.py, fair queuing) as last seen, and those of
        #: them believed to have due jobs: each is claimed on its own, its fair share first.
        #: One whose claim found fewer jobs than asked leaves the queue and is claimed with
        #: the others; a claim that brings its jobs puts it back.
        self._slow_seen: set[str] = set()
        self._slow_queued: set[str] = set()
        #: Give-backs of jobs claimed beyond their destination's limit, still running.
        self._holding: set[asyncio.Task[None]] = set()
        #: The lease of each job this worker is processing, by job id: a claim that brings
        #: one back (its lease ran out while the store was down) hands it the new token.
        self._leases: dict[str, _JobLease] = {}

    def _batch_gathers(self) -> bool:
        """Whether at least ``_claim_at`` slots keep ending attempts, judged by the attempts
        that ended last (see :data:`_CLAIM_DELAY`): else a batch could never gather."""
        ended = self._ended
        if len(ended) < (ended.maxlen or 2):  # too few ended yet to judge
            return False
        span = ended[-1][0] - ended[0][0]
        if span <= 0:
            return True
        rate = (len(ended) - 1) / span  # attempts ending per second
        busy = rate * sum(ran for _, ran in ended) / len(ended)  # slots ending attempts
        return busy >= self._claim_at

    async def _poll(
        self,
        client: Engine,
        tasks: set[asyncio.Task[None]],
        done: Callable[[asyncio.Task[None]], None],
        until_idle: bool,
    ) -> float | None:
        """Claim what is due and start it; return how long to wait (None: idle, stop).

        While the last claim found a backlog (it filled every free slot) and enough slots
        keep ending attempts (:meth:`_batch_gathers`), fewer than :attr:`_claim_at` free
        slots wait for company, until :data:`_CLAIM_DELAY` seconds after the first of them
        freed (until then the seconds left are returned)."""
        free = self.concurrency - len(tasks)
        loop = self._loop
        assert loop is not None
        if 0 < free < self._claim_at and self._backlog and tasks and self._batch_gathers():
            left = self._first_free_at + _CLAIM_DELAY - loop.time()
            if left > 0:
                return min(left, self.poll_interval)
        if free > 0:
            limits, backlogged, served = self._limits, self._backlogged, self._served
            for destination in [d for d in backlogged if limits.allowance(d) >= free]:
                backlogged.discard(destination)  # its allowance is no longer the bound
                served.pop(destination, None)
            # Slow destinations (their attempts take a second or more) with due jobs get
            # their fair share of the slots first, then the others' due jobs are claimed,
            # then the slow ones get what is left (retrysafe.client._limits: fair queuing).
            # None in the common case: then this costs one empty list.
            queued = self._slow_queued
            limits.age_probes(loop.time())  # a probe in flight a second is slow
            # One slot cannot be shared: it goes to due jobs first come first served.
            slow = limits.slow() if self.concurrency > 1 else []
            filled = False
            if slow or self._slow_seen:
                self._track_slow(slow)
                fair: list[tuple[str, int]] = []
                share = limits.slow_room()  # the slow destinations' half, together
                for destination in sorted(queued, key=lambda d: served.get(d, 0.0)):
                    n = min(limits.allowance(destination), share, free)
                    if n > 0:
                        fair.append((destination, n))
                        free -= n
                        share -= n
                if fair:
                    filled = await self._claim_each(client, fair, tasks, done)
                    free = self.concurrency - len(tasks)
            # Destinations that may start nothing, or fewer than a claim may bring (their
            # jobs are claimed one destination at a time, above and below): the claim leaves
            # their jobs.
            skipped = sorted(backlogged.union(limits.full(), queued))
            short = self._skipped_short
            wait = 0.0
            if free <= 0:
                wait = math.inf  # the fair shares took every free slot
            elif skipped and short is not None and short[1].issubset(skipped):
                # The last claim skipped the same destinations (or fewer: none of them may
                # start more now) and found every due job outside them; the store walks the
                # skipped jobs to look again, so wait.
                wait = short[0] - loop.time()
            # Whether the other destinations have no due job left to start: only then do
            # the slow ones get more than their share (slots that freed while the claim ran
            # go to the next claim, not to them).
            others_done = 0 < wait < math.inf
            if wait <= 0:
                asked_at = loop.time()
                claimed = await self._claim(
                    free, {"skip_destinations": skipped} if skipped else {}
                )
                self._start(client, claimed, tasks, done)
                self._skipped_short = None
                if skipped and len(claimed) < free:
                    took = loop.time() - asked_at
                    self._skipped_short = (
                        loop.time() + _SKIP_SCAN_SHARE * took,
                        frozenset(skipped),
                    )
                filled = filled or len(claimed) == free
                others_done = len(claimed) < free
            room = self.concurrency - len(tasks)
            asks: list[tuple[str, int]] = []
            extra = backlogged.union(queued) if others_done else backlogged
            # A backlogged destination that is slow (one whose probe made it backlogged, then
            # slow) keeps to the slow ones' share while other jobs are due.
            slow_left = limits.slow_room() if slow and not others_done else None
            for destination in sorted(extra, key=lambda d: served.get(d, 0.0)):
                n = min(limits.allowance(destination), room)
                if slow_left is not None and destination in slow:
                    n = min(n, slow_left)
                    slow_left -= max(n, 0)
                if n > 0:
                    asks.append((destination, n))
                    room -= n
            if asks and await self._claim_each(client, asks, tasks, done):
                filled = True
            self._backlog = filled
            if self.concurrency > len(tasks):  # slots freed while the claim ran
                self._first_free_at = loop.time()
            if filled:
                return 0.0  # there may be more due jobs
            if 0 < wait < math.inf:
                return min(wait, self.poll_interval)
        if until_idle and not tasks:
            counts = await self._astore.count_jobs(queue=self.queue)
            if counts[JobState.PENDING] + counts[JobState.IN_FLIGHT] == 0:
                return None
        timeout = self.poll_interval
        if not tasks:
            due = await self._astore.next_due(queue=self.queue)
            if due is not None:
                timeout = min(timeout, max(0.0, due - self._clock()))
        return timeout

    async def _claim_each(
        self,
        client: Engine,
        asks: list[tuple[str, int]],
        tasks: set[asyncio.Task[None]],
        done: Callable[[asyncio.Task[None]], None],
    ) -> bool:
        """Claim up to ``n`` jobs of each ``(destination, n)`` on its own, together, and start
        them; return whether any destination filled its ask (it may have more due jobs). A
        backlogged destination whose due jobs all fitted is claimed with the others again."""
        loop = self._loop
        assert loop is not None
        results = await asyncio.gather(
            *(self._claim(n, {"only_destination": d}) for d, n in asks)
        )
        filled = False
        for (destination, n), jobs in zip(asks, results, strict=True):
            self._served[destination] = loop.time()
            self._start(client, jobs, tasks, done)
            if len(jobs) < n:  # its due jobs all fit: claimed with the others again
                self._backlogged.discard(destination)
                self._slow_queued.discard(destination)
                if destination not in self._slow_seen:
                    self._served.pop(destination, None)
            else:
                filled = True
        return filled

    def _track_slow(self, slow: list[str]) -> None:
        """Keep :attr:`_slow_queued` (the slow destinations claimed on their own) up to date
        with the limits' ``slow`` list: a destination that became slow is queued (it may have
        due jobs: its first ask tells); one that is no longer slow is claimed with the others
        again."""
        seen, queued, served = self._slow_seen, self._slow_queued, self._served
        now_slow = set(slow)
        for gone in seen - now_slow:
            seen.discard(gone)
            queued.discard(gone)
            if gone not in self._backlogged:
                served.pop(gone, None)
            logger.info(
                "destination %s answers in under half a second again: claimed with the others",
                shown_destination(gone),
            )
        for new in now_slow - seen:
            seen.add(new)
            queued.add(new)
            logger.info(
                "destination %s is slow (attempts of a second or more): slow destinations "
                "share %d of %d slots while other jobs are due",
                shown_destination(new),
                self._limits.share,
                self.concurrency,
            )

    async def _claim(self, limit: int, filters: dict[str, Any]) -> list[Job]:
        """Lease up to ``limit`` due jobs (``filters``: the destinations to skip, or the only
        one to take), giving them back if cancelled while the claim was on its way. Jobs
        being given back (:meth:`_hold_back`) land first: still leased, a claim would pass
        them by and take the jobs behind them (a backlog's oldest jobs sent last)."""
        loop = self._loop
        assert loop is not None
        if self._holding:
            await asyncio.gather(*self._holding, return_exceptions=True)
        token, asked_at = uuid.uuid4().hex, self._clock()
        claim = loop.create_task(
            self._astore.claim_jobs(
                queue=self.queue,
                token=token,
                now=asked_at,
                lease=self.lease,
                limit=limit,
                **filters,
            )
        )
        try:
            claimed: list[Job] = await asyncio.shield(claim)
        except asyncio.CancelledError:
            await self._give_back_claim(claim)
            raise
        self._answered_claims += 1
        self.stats.unknown += len(parked_by(claimed))  # left UNKNOWN, never sent
        took = self._clock() - asked_at
        if claimed and took > self.lease / 4:
            return await self._renewed(claimed, token, took)
        return claimed

    async def _renewed(self, claimed: list[Job], token: str, took: float) -> list[Job]:
        """The jobs of a claim that took over a quarter of the lease, their leases renewed
        before any is sent; those whose renewal failed are left alone (not sent by this run).

        The store computes the lease end from the time the claim was asked for, so a claim
        that waited (another process held SQLite's write lock, a slow store) may land with
        its leases near or past their end, and another worker could claim the same jobs and
        send them while this one does (the middleware's claims had the same gap: a fresh
        user's check). A renewal that is refused means the job was taken over meanwhile; one
        that fails leaves the job to its lease, which runs out, and to the next claim."""
        now = self._clock()
        renewals = await asyncio.gather(
            *(
                self._astore.extend_job_lease(job.id, token, now=now, lease=self.lease)
                for job in claimed
            ),
            return_exceptions=True,
        )
        kept = [job for job, renewed in zip(claimed, renewals, strict=True) if renewed is True]
        if len(kept) < len(claimed):
            logger.warning(
                "%d of %d claimed jobs not sent by this run: the claim took %.1f s of a "
                "%.1f s lease and their renewal failed or found them taken over",
                len(claimed) - len(kept),
                len(claimed),
                took,
                self.lease,
            )
        return kept

    def _start(
        self,
        client: Engine,
        claimed: list[Job],
        tasks: set[asyncio.Task[None]],
        done: Callable[[asyncio.Task[None]], None],
    ) -> None:
        """Start an attempt for each claimed job whose destination may take one; give the
        others back unstarted, and claim their destination's jobs alone from now on."""
        loop = self._loop
        assert loop is not None
        now, started, destinations = loop.time(), self._started, self._destinations
        limits, over = self._limits, []
        slow, queued = self._slow_seen, self._slow_queued
        for job in claimed:
            held = self._leases.get(job.id)
            if held is not None:  # ours already: its lease ran out in a store outage
                held.adopt(job)
                continue
            self.stats.claimed += 1
            if slow and job.destination in slow:
                queued.add(job.destination)  # it has due jobs: claimed on its own again
            if not limits.start(job.destination, now=now) and not self._cannot_wait(job):
                over.append(job)
                self._backlogged.add(job.destination)
                continue
            task = loop.create_task(self._process(client, job))
            started[task] = now
            destinations[task] = job.destination
            tasks.add(task)
            task.add_done_callback(done)
        if over:
            task = loop.create_task(self._hold_back(over))
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)

    def _cannot_wait(self, job: Job) -> bool:
        """Whether ``job``, held back by its destination's probe, would see its deadline pass
        before the probe may end (:data:`~retrysafe.client._limits.SLOW` seconds): then it
        starts anyway (its slot taken beside the probe), as it would have without one."""
        if job.deadline_at is None:
            return False
        return self._limits.start_beside_probe(job.destination, job.deadline_at - self._clock())

    async def _hold_back(self, jobs: list[Job]) -> None:
        """Give back, unstarted, claimed jobs whose destination is at its limit of attempts in
        flight (one claim may bring several jobs to one destination): PENDING, due since
        their creation, so they keep their place near the front of the queue (the claim
        overwrote their due time with the lease's end; given back "due now" they went behind
        every job already due, and a probe's give-back sent a backlog's oldest jobs last),
        same key; not an attempt. One that cannot be given back waits for its lease to end."""
        now = self._clock()
        left = {job.id for job in jobs}  # not yet given back, nor refused

        async def one(job: Job) -> None:
            token = job.lease_token
            if token is None:  # pragma: no cover - a claimed job always has a token
                return
            try:
                await self._astore.release_job(
                    job.id,
                    token,
                    state=JobState.PENDING,
                    due_at=min(job.created_at, now),
                    error=None,
                    now=now,
                )
            except Exception as exc:
                logger.debug("job=%s not given back (%r); its lease will end", job.id, exc)
            finally:
                left.discard(job.id)

        try:
            await asyncio.shield(asyncio.gather(*(one(job) for job in jobs)))
        except asyncio.CancelledError:  # cut short by a third Ctrl-C: the rest keep a lease
            self.stats.unreleased += len(left)
            raise
        self.stats.held_back += len(jobs)
        logger.debug(
            "%d claimed job(s) given back unstarted: their destination is at its limit",
            len(jobs),
        )

    def _answered(self, job: Job, result: SendResult) -> None:
        """Adapt the limit of ``job``'s destination to how its attempt ended."""
        adapt_limit(self._limits, job, result, self.policy.timeout_s)

    # ------------------------------------------------------------------ one job
    async def _process(self, client: Engine, job: Job) -> None:
        """One claimed job, from its claim to its recorded outcome (or its release), under a
        lease that is renewed all along and dropped with it."""
        lease = _JobLease(
            job,
            astore=self._astore,
            timing=self.timing,
            clock=self._clock,
            outage=self._outage,
            loop=self._loop,
        )
        self._leases[job.id] = lease
        try:
            with lease:
                await self._attempt(client, lease)
        finally:
            if self._leases.get(job.id) is lease:
                del self._leases[job.id]

    def _bring_forward(self, deferred: list[tuple[str, float, float]], now: float) -> None:
        """Make the deferred retries ``deferred`` (job id, due at, released at) due now (a
        success paid for them, see :meth:`_Budgets.credit`), in the background, each only
        while the store still holds it PENDING until exactly that time, as its deferral left
        it: one claimed since, retried by an operator or rescheduled (a Retry-After) keeps its
        own time. A store without ``hasten_jobs`` (an own
        :class:`~retrysafe.client.AsyncOutboxStore`) leaves them to their slot; so does a
        failure, which is only logged."""
        hasten = getattr(self._astore, "hasten_jobs", None)
        if hasten is None or self._loop is None:
            return

        async def bring() -> None:
            try:
                await hasten(deferred, now=now)
            except StoreError as exc:
                logger.debug("deferred retries not brought forward: %s", exc)

        task = self._loop.create_task(bring())
        self._early.add(task)
        task.add_done_callback(self._early.discard)

    async def _give_back(
        self, lease: _JobLease, *, state: JobState, due_at: float, error: str | None, now: float
    ) -> bool:
        """End the lease without an attempt (deadline, retry budget, gate); False when the
        lease was no longer this worker's (nothing written)."""
        lease.settle()
        released: bool = await self._outage.call(
            lambda: self._astore.release_job(
                lease.job.id, lease.token, state=state, due_at=due_at, error=error, now=now
            ),
            until=lease.until,
        )
        return released

    async def _attempt(self, client: Engine, lease: _JobLease) -> None:
        job = lease.job
        hooks: AttemptHooks | None = None
        try:
            if self._attempt_hooks is not None:  # inside: a hook that fails is a worker error
                hooks = self._attempt_hooks.attempt(job)
            now = self._clock()
            if deadline_passed(job.deadline_at, now):
                await self._give_back(
                    lease,
                    state=JobState.UNKNOWN,
                    due_at=now,
                    error=(
                        "deadline passed before the next attempt"
                        if job.sends
                        else "deadline passed before its first attempt: never sent"
                    ),
                    now=now,
                )
                self.stats.unknown += 1
                logger.info("job=%s key=%s state=unknown reason=deadline", job.id, job.key)
                return
            is_retry = job.attempts > 0 and job.last_outcome != AttemptOutcome.IN_PROGRESS.value
            if is_retry and self._budgets is not None:
                allowed, wait = self._budgets.spend(job.destination, now)
                if not allowed:
                    # Deferred, not dropped, and not an attempt (SPEC §5 retry budget).
                    due_at = self._budgets.defer(job.destination, now, wait, self._rng)
                    if job.deadline_at is not None:  # the deadline parks it, not a far slot
                        due_at = min(due_at, max(job.deadline_at, now))
                    if await self._give_back(
                        lease, state=JobState.PENDING, due_at=due_at, error=None, now=now
                    ):
                        self._budgets.deferred(job.destination, job.id, due_at, now)
                    self.stats.deferred += 1
                    if self._telemetry is not None:
                        self._telemetry.budget_deferral(self.queue)
                    logger.debug(
                        "job=%s deferred by the retry budget of %s", job.id, job.destination
                    )
                    return
            if hooks is not None:
                gated = hooks
                wait = await self._outage.call(lambda: gated.gate(now), until=lease.until)
                if wait > 0:
                    await self._give_back(
                        lease, state=JobState.PENDING, due_at=now + wait, error=None, now=now
                    )
                    self.stats.deferred += 1
                    return
            extra = (
                () if hooks is None else await self._outage.call(hooks.headers, until=lease.until)
            )
            if lease.is_lost():  # taken over while the hooks ran: the new owner sends it
                self._not_recorded(job, "before its attempt started")
                return
            result = await send_attempt(
                client,
                job,
                timeout=self.policy.timeout_s,
                clock=self._clock,
                telemetry=self._telemetry,
                loop=self._loop,
                extra_headers=extra,
            )
            self._answered(job, result)
            lease.settle()
            if lease.is_lost():
                self._not_recorded(
                    job, f"during its attempt ({result.classification.outcome.value})"
                )
                return
            end = self._clock()
            step = next_step(
                result.classification,
                policy=self.policy,
                attempts=job.attempts,
                polls=job.polls,
                now=end,
                deadline_at=job.deadline_at,
                previous_delay=job.last_delay,
                retry_after=result.retry_after,
                rng=self._rng,
            )
            if hooks is not None:
                deciding, default = hooks, step
                step = await self._outage.call(
                    lambda: deciding.decide(job, result, default), until=lease.until
                )
            if self._budgets is not None and step.state is JobState.SUCCEEDED:
                early = self._budgets.credit(job.destination, end)
                if early:
                    self._bring_forward(early, end)
            await self._record(lease, result, step, end, hooks)
            if self._worker_errors:  # recorded: a run of worker errors is over
                self._worker_errors.pop(job.id, None)
        except asyncio.CancelledError:
            # Cancellation is never retried nor counted: back to PENDING, same key, now; an
            # answered attempt whose outcome was being written is recorded instead.
            if lease.recording is not None:
                await self._record_at_stop(lease)
            else:
                await self._release_now(job, lease.token, "cancelled")
            raise
        except StoreUnavailableError as exc:
            # Still unavailable when the lease ran out: the lease expires, and the job is
            # claimed again and re-sent with the same key (safe: the server replays).
            self.stats.lease_lost += 1
            logger.warning(
                "job=%s key=%s not recorded: the store stayed unavailable until the lease "
                "expired (%s); it will be sent again with the same key",
                job.id,
                job.key,
                exc,
            )
        except Exception as exc:  # a bug or a store failure: never leave the job stuck
            if isinstance(exc, SchemaError) and self._fatal is None:
                # A table is missing (dropped by hand, or a schema older than this release):
                # every attempt would be sent and then fail to record. Stop instead of
                # re-sending; serve() raises it.
                self._fatal = exc
                logger.error(
                    "job=%s not recorded: %s; stopping the worker (run `retrysafe migrate`)",
                    job.id,
                    exc,
                )
                self.stop()
                state, delay = JobState.PENDING, self.policy.wait_initial_s
            else:
                logger.exception("job=%s failed in the worker: %r", job.id, exc)
                state, delay = self._after_worker_error(job)
            released = False
            with contextlib.suppress(Exception):
                now = self._clock()
                parked = "; parked UNKNOWN" if state is JobState.UNKNOWN else ""
                released = await self._astore.release_job(
                    job.id,
                    lease.token,
                    state=state,
                    due_at=now + delay,
                    error=f"worker error: {exc!r}{parked}",
                    now=now,
                )
            if not released:  # no longer ours (recorded before the error, or taken over)
                self._worker_errors.pop(job.id, None)
            elif state is JobState.UNKNOWN:
                self.stats.unknown += 1
                logger.error(
                    "job=%s failed in the worker %d times in a row: parked UNKNOWN (reconcile "
                    "it with the same key once the cause is fixed)",
                    job.id,
                    WORKER_ERRORS_MAX,
                )

    def _after_worker_error(self, job: Job) -> tuple[JobState, float]:
        """The state and delay of a job released after a worker error: PENDING after a
        doubling delay, or UNKNOWN (a terminal state the dead-letter queue lists; reconcile
        it, same key, once the cause is fixed) at the :data:`WORKER_ERRORS_MAX`-th in a row:
        it may have been sent."""
        errors = self._worker_errors
        count = errors.pop(job.id, 0) + 1
        if count >= WORKER_ERRORS_MAX:
            return JobState.UNKNOWN, 0.0
        if len(errors) >= _WORKER_ERRORS_KEPT:
            del errors[next(iter(errors))]
        errors[job.id] = count
        policy = self.policy
        return JobState.PENDING, min(policy.wait_initial_s * 2 ** (count - 1), policy.wait_max_s)

    async def _give_back_claim(self, claim: asyncio.Future[list[Job]]) -> None:
        """Cancelled (Ctrl-C) while a claim was on its way: the claim may have landed in the
        store all the same. Wait for it (up to :data:`_CLAIM_WAIT` seconds) and release what
        it took, PENDING with the same key, instead of leaving it IN_FLIGHT until its lease
        ends."""
        held = [(j, j.lease_token) for j in await _claimed_anyway(claim) if j.lease_token]
        for n, (job, token) in enumerate(held, 1):
            try:
                await self._release_now(job, token, "cancelled before its attempt", before=True)
            except asyncio.CancelledError:  # cancelled again: the rest wait out their lease
                self.stats.unreleased += len(held) - n
                raise

    def _not_recorded(self, job: Job, when: str) -> None:
        self.stats.lease_lost += 1
        logger.warning(
            "job=%s key=%s not recorded: its lease was lost %s; whoever holds the job now "
            "(another worker, same key) records its own outcome",
            job.id,
            job.key,
            when,
        )

    async def _release_now(
        self, job: Job, token: str, why: str, *, before: bool = False
    ) -> None:
        """Give a cancelled job back at once: PENDING, due now, same key (``before``: its
        attempt had not started; else ``last_error`` says the request may have been sent).
        Shielded, so a second cancellation does not stop the release half-way."""
        try:
            now = self._clock()
            release = self._astore.release_job(
                job.id,
                token,
                state=JobState.PENDING,
                due_at=now,
                error=None if before else _CUT_OFF,
                now=now,
            )
            if await asyncio.shield(release):
                self.stats.released += 1
                logger.info("job=%s key=%s released (%s): pending, same key", job.id, job.key, why)
        except asyncio.CancelledError:  # cancelled again (a third Ctrl-C): the lease expires
            self.stats.unreleased += 1
            raise
        except StoreUnavailableError as exc:  # the lease will expire; another claim re-sends
            self.stats.unreleased += 1
            logger.warning("job=%s could not be released (%s); its lease will expire", job.id, exc)
        except Exception:
            self.stats.unreleased += 1
            logger.exception("job=%s could not be released; its lease will expire", job.id)

    async def _record(
        self,
        lease: _JobLease,
        result: SendResult,
        step: Step,
        end: float,
        hooks: AttemptHooks | None = None,
    ) -> None:
        """Write the attempt's outcome, fenced by the lease token, through a store outage of
        any length, past the lease's end too: while no one else has claimed the job, the
        token still holds it and the write lands (an outcome given up at the lease's end
        was sent again once the store was back, though nothing had taken the job over); once
        another worker has, the write changes nothing and says so. A run that must end
        (``until_idle`` past ``store_outage_limit``, a stop) cancels it."""
        job = lease.job
        attempt = _attempt_of(job, result, counted=step.counted)
        assert self._finishes is not None
        finishes = self._finishes

        def finish() -> Finish:
            return Finish(
                job_id=job.id,
                token=lease.token,  # this worker's latest claim of the job (adopt)
                attempt=attempt,
                state=step.state,
                due_at=step.due_at,
                last_delay=step.delay if step.state is JobState.PENDING else job.last_delay,
                error=None if step.state is JobState.SUCCEEDED else result.detail,
                now=end,
            )

        lease.recording = (finish, result, step)  # a stop meanwhile records it (_attempt)
        recorded = await self._outage.call(lambda: finishes.submit(finish()), until=math.inf)
        if recorded is None and await self._landed_before(job, end, attempt):
            recorded = attempt  # a write that landed, then failed to answer: tried again
        if recorded is None:
            self.stats.lease_lost += 1
            logger.warning(
                "job=%s key=%s not recorded: its lease was taken over, or the job was deleted "
                "(a webhook delivery with its endpoint), during the attempt",
                job.id,
                job.key,
            )
            return
        self._counted(job, recorded, result, step)
        if hooks is not None:
            await hooks.attempted(job, recorded, step)
        if self._on_attempt is not None:
            self._on_attempt(job, recorded, step)

    async def _landed_before(self, job: Job, end: float, attempt: Attempt) -> bool:
        """Whether the store already holds this worker's record of ``job``'s ``attempt``,
        which ended at ``end``: a write through an outage whose commit landed and whose
        answer was lost is tried again, and the retry, fenced by a token the first write
        cleared, changes nothing. It was counted as a lost lease, with a false warning (a
        fresh user's check: 8 of 4,000 deliveries behind a stalled connection). The job's
        send count is one more than at the claim, and its update time is the attempt's end
        to the bit; on a store that stamps updates with its own clock (PostgreSQL), where
        the time cannot tell, the attempt numbered that count is ours when it started when
        ours did, to the bit (its start is stored as the worker gave it)."""
        try:
            now = await self._astore.get_job(job.id)
            if now is None or now.lease_token is not None or now.sends != job.sends + 1:
                return False
            if now.updated_at == end:
                return True
            recorded = await asyncio.to_thread(self.store.list_attempts, job.id)
        except Exception:  # unreadable: as before, not counted as ours
            return False
        return any(
            a.number == now.sends and a.started_at == attempt.started_at and a.key == attempt.key
            for a in recorded
        )

    def _counted(self, job: Job, recorded: Attempt, result: SendResult, step: Step) -> None:
        """Count and log an attempt the store recorded."""
        s = self.stats
        s.attempts += 1
        s.outcomes[recorded.outcome] = s.outcomes.get(recorded.outcome, 0) + 1
        if step.state is JobState.SUCCEEDED:
            s.succeeded += 1
        elif step.state is JobState.REJECTED:
            s.rejected += 1
        elif step.state is JobState.UNKNOWN:
            s.unknown += 1
        elif result.classification.action is Action.POLL:
            s.polls += 1
        else:
            s.retries_scheduled += 1
        _log_attempt(recorded, step)
        if self._telemetry is not None:
            self._telemetry.attempt_recorded(self.queue, job.method, recorded, step.state.value)

    async def _record_at_stop(self, lease: _JobLease) -> None:
        """Cancelled (Ctrl-C, a stop's end) while the outcome of an answered attempt was
        being written: write it once more, alone, instead of giving the job back as if
        nothing had been sent (its answer was thrown away, and the job sent again: a fresh
        user's check, 7 of 8 jobs answered 200 during a store lock). Shielded like a
        release; if the store cannot take it either, the job is given back as on any
        cancellation."""
        assert lease.recording is not None
        finish, result, step = lease.recording
        job = lease.job
        try:
            (recorded,) = await asyncio.shield(self._astore.finish_attempts([finish()]))
        except asyncio.CancelledError:  # cancelled again (a third Ctrl-C): the lease expires
            self.stats.unreleased += 1
            raise
        except Exception as exc:
            logger.warning(
                "job=%s key=%s: its answered attempt could not be recorded at the stop (%s)",
                job.id,
                job.key,
                exc,
            )
            await self._release_now(job, lease.token, "cancelled")
            return
        if recorded is not None:  # else it is no longer ours (or the write before landed)
            self._counted(job, recorded, result, step)


def _attempt_of(job: Job, result: SendResult, *, counted: bool) -> Attempt:
    """The attempt record of ``result``, the job's next send (the store assigns the final
    number when it records it)."""
    return Attempt(
        job_id=job.id,
        key=job.key,
        number=job.sends + 1,
        started_at=result.started_at,
        duration=result.duration,
        outcome=result.classification.outcome.value,
        status=result.status,
        error_type=result.error_type,
        replayed=result.replayed,
        counted=counted,
    )


def _log_attempt(attempt: Attempt, step: Step) -> None:
    if not logger.isEnabledFor(logging.INFO):  # the hot path: build nothing for nobody
        return
    data = attempt.to_dict()
    data.update(next_state=step.state.value, next_in=round(step.delay, 3), reason=step.reason)
    logger.info(
        "attempt job=%s key=%s n=%d outcome=%s status=%s error=%s replayed=%s "
        "duration=%.3fs next=%s in=%.3fs",
        attempt.job_id,
        attempt.key,
        attempt.number,
        attempt.outcome,
        attempt.status,
        attempt.error_type,
        attempt.replayed,
        attempt.duration,
        step.state.value,
        step.delay,
        extra={"retrysafe": data},
    )


async def _claimed_anyway(claim: asyncio.Future[list[Job]]) -> list[Job]:
    """The jobs of a claim that was on its way when its caller was cancelled (it may have
    landed in the store all the same), once known within :data:`_CLAIM_WAIT` seconds; else
    none, and the claim is cancelled (what it took waits out its lease)."""
    try:
        return await asyncio.wait_for(asyncio.shield(claim), _CLAIM_WAIT)
    except BaseException:  # not known in time, failed, or cancelled again
        claim.cancel()
        return []


# ---------------------------------------------------------------------- reconcile
@dataclass(frozen=True)
class ReconcileReport:
    """What one reconciliation pass did: the jobs it re-sent, by resulting state."""

    succeeded: int
    rejected: int
    unknown: int
    jobs: tuple[Job, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "rejected": self.rejected,
            "unknown": self.unknown,
            "jobs": [j.to_dict() for j in self.jobs],
        }


async def areconcile(
    store: StoreArg,
    *,
    policy: RetryPolicy | None = None,
    ids: Sequence[str] | None = None,
    limit: int = 1000,
    concurrency: int = 8,
    transport: httpx.AsyncBaseTransport | None = None,
    address_guard: AddressGuard | None = None,
    clock: Callable[[], float] = time.time,
    queue: str = DEFAULT_QUEUE,
    telemetry: Telemetry | Sequence[Telemetry] | None = None,
) -> ReconcileReport:
    """Re-send the UNKNOWN jobs of one queue once each with their **same key** (SPEC §5).

    The server's replay answers definitively: 2xx → SUCCEEDED, a rejecting 4xx → REJECTED.
    Anything else (no answer, 5xx, 409 still in progress) leaves the job UNKNOWN; every
    attempt is recorded either way.

    Every claimed job's lease (``DEFAULT_LEASE``, 10 s) is renewed like the worker's, from
    the claim until its outcome is recorded: jobs waiting for one of the ``concurrency``
    slots and attempts slower than the lease are never taken by a worker meanwhile, and the
    jobs of a reconcile that died are free again one lease later.

    A store that is unavailable for a while is waited out like the worker does: the claim
    for up to ``3 × timeout`` seconds, each job's outcome while its lease is valid (after
    that the job is left to expire and be re-sent with the same key).

    Args:
        store: an outbox store, a SQL store or its URL.
        policy: timeouts (default :class:`RetryPolicy`).
        ids: only these job ids (default: every UNKNOWN job, oldest first, up to ``limit``);
            ids of another queue's jobs are left alone.
        limit: most jobs to reconcile in this pass (>= 1).
        concurrency: attempts in flight at once (>= 1).
        transport: an ``httpx.AsyncBaseTransport`` (tests, proxies); default: the aiohttp
            engine, as the worker's.
        address_guard: the SSRF guard, as the worker's.
        clock: Unix-seconds clock.
        queue: the queue whose UNKNOWN jobs are re-sent (default ``"default"``).
        telemetry: as the worker's: every reconcile attempt is traced (in its job's trace)
            and counted by the state it ended in.

    Raises:
        ConfigurationError: ``limit`` < 1, ``concurrency`` not from 1 to
            :data:`~retrysafe.client._policy.MAX_CONCURRENCY`, ``ids`` a lone string, a bad
            ``queue`` name, a ``transport`` that is not an async httpx transport, a
            ``policy`` that is no :class:`RetryPolicy`.
        StoreUnavailableError: the store stayed unavailable for the whole claim window.
    """
    policy = policy_or_default(policy, RetryPolicy)
    limit = count(limit, "limit")
    concurrency = concurrency_of(concurrency)
    check_transport(transport)
    queue = check_queue(queue)
    if isinstance(ids, str):
        raise ConfigurationError("ids must be a list of job ids, not a string", option="ids")
    tel = telemetry_of(telemetry)
    outbox_store, owned = open_outbox_store(store)
    astore = timed_store(outbox_store.asyncio_outbox_store(), tel, store_kind(outbox_store))
    timing = lease_timing(DEFAULT_LEASE, max_run_time=_max_run_time(None, policy))
    outage = _StoreOutage(outbox_store.url, base=0.05, rng=random.Random(), clock=clock)
    try:
        start = clock()
        claim = asyncio.ensure_future(
            outage.call(
                lambda: astore.claim_unknown_jobs(
                    queue=queue,
                    token=uuid.uuid4().hex,
                    now=clock(),
                    lease=timing.lease,
                    limit=limit,
                    ids=ids,
                ),
                until=start + 3.0 * policy.timeout_s,
            )
        )
        try:
            jobs: list[Job] = await asyncio.shield(claim)
        except asyncio.CancelledError:  # the claim may have landed: its jobs UNKNOWN again
            await _unknown_again(astore, await _claimed_anyway(claim), clock)
            raise
        # Claimed, and not yet taken up by their task: a cancellation before a task first
        # runs never enters it, so these are given back here.
        untouched = {job.id: job for job in jobs}
        slots = _DestinationSlots(concurrency, DestinationLimits(concurrency, concurrency))
        finals: list[Job] = []
        counts = dict.fromkeys(JobState, 0)
        client = make_engine(
            policy, transport=transport, max_connections=concurrency, guard=address_guard
        )
        try:

            async def one(job: Job) -> None:
                del untouched[job.id]
                held = _JobLease(job, astore=astore, timing=timing, clock=clock, outage=outage)
                with held:
                    await resend(held)

            async def resend(held: _JobLease) -> None:
                job, token = held.job, held.token
                try:
                    await slots.acquire(job.destination)
                    try:
                        result = await send_attempt(
                            client, job, timeout=policy.timeout_s, clock=clock, telemetry=tel
                        )
                        adapt_limit(slots.limits, job, result, policy.timeout_s)
                    finally:
                        slots.release(job.destination)
                except asyncio.CancelledError:
                    # Cancelled mid-attempt or still waiting for a slot (every job is claimed
                    # up front): either way the job goes back to UNKNOWN now, not IN_FLIGHT
                    # until some worker takes it over.
                    await _unknown_again(astore, [job], clock, token)
                    raise
                held.settle()
                if held.is_lost():
                    logger.warning(
                        "job=%s key=%s not recorded: its lease was lost during the reconcile "
                        "attempt; whoever holds the job now records its own outcome",
                        job.id,
                        job.key,
                    )
                    return
                state = reconcile_step(result.classification)
                end = clock()
                counted = result.classification.action is not Action.POLL
                attempt = _attempt_of(job, result, counted=counted)
                try:
                    recorded = await outage.call(
                        lambda: astore.finish_attempt(
                            job.id,
                            token,
                            attempt,
                            state=state,
                            due_at=end,
                            last_delay=job.last_delay,
                            error=None if state is JobState.SUCCEEDED else result.detail,
                            now=end,
                        ),
                        until=held.until,
                    )
                    final = await outage.call(
                        lambda: astore.get_job(job.id),
                        until=max(held.expires_at, clock() + policy.timeout_s),
                    )
                except StoreUnavailableError as exc:
                    logger.warning(
                        "job=%s key=%s not recorded: the store stayed unavailable until the "
                        "lease expired (%s); it will be sent again with the same key",
                        job.id,
                        job.key,
                        exc,
                    )
                    return
                if recorded is not None:
                    counts[state] += 1
                    _log_attempt(recorded, Step(state, end, 0.0, attempt.counted, "reconcile"))
                    if tel is not None:
                        tel.attempt_recorded(queue, job.method, recorded, state.value)
                        tel.reconciled(queue, state.value)
                if final is not None:
                    finals.append(final)

            # Not gather: cancelled, it returns as soon as one task has ended, while the
            # others still give their job back (a round trip each on PostgreSQL, where a
            # fresh user's interrupted reconciles left most jobs IN_FLIGHT): the store then
            # closed under them. Each task is cancelled once, and waited for (a second
            # cancellation stops the wait).
            tasks = [asyncio.ensure_future(one(j)) for j in jobs]
            if tasks:
                try:
                    await asyncio.wait(tasks)
                except asyncio.CancelledError:
                    for task in tasks:
                        task.cancel()
                    await asyncio.wait(tasks)
                    await _unknown_again(astore, list(untouched.values()), clock)
                    raise
            failures = [task.exception() for task in tasks]  # each read: none left unseen
            first = next((exc for exc in failures if exc is not None), None)
            if first is not None:
                raise first  # the first failure, as gather raised it
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(client.aclose())
        finals.sort(key=lambda j: j.created_at)
        return ReconcileReport(
            succeeded=counts[JobState.SUCCEEDED],
            rejected=counts[JobState.REJECTED],
            unknown=counts[JobState.UNKNOWN] + len(parked_by(jobs)),  # parked again: damaged
            jobs=tuple(finals),
        )
    finally:
        with contextlib.suppress(Exception):
            await asyncio.shield(astore.aclose())
        if owned:  # closing a pool may wait for its threads: not on the event loop
            await asyncio.to_thread(outbox_store.close)


async def _unknown_again(
    astore: AsyncOutboxStore,
    jobs: Sequence[Job],
    clock: Callable[[], float],
    token: str | None = None,
) -> None:
    """A cancelled reconcile's claimed ``jobs`` back to UNKNOWN at once (fenced by their
    lease token, or ``token``), not IN_FLIGHT until their lease ends; shielded from a second
    cancellation. A job the store could not release waits out its lease."""

    async def release(job: Job) -> None:
        held = token if token is not None else job.lease_token
        if held is None:
            return
        now = clock()
        await astore.release_job(
            job.id, held, state=JobState.UNKNOWN, due_at=now, error=None, now=now
        )

    if jobs:
        releases = asyncio.gather(*(release(job) for job in jobs), return_exceptions=True)
        for job, outcome in zip(jobs, await asyncio.shield(releases), strict=True):
            if isinstance(outcome, Exception):
                logger.warning(
                    "job=%s could not be given back as UNKNOWN (%s); it waits out its lease, "
                    "then a worker sends it again with the same key",
                    job.id,
                    outcome,
                )


def reconcile(store: StoreArg, **options: Any) -> ReconcileReport:
    """Blocking :func:`areconcile` (runs its own event loop)."""
    return asyncio.run(areconcile(store, **options))
