"""The webhook worker's side of one attempt (SPEC §6): rate-limit it, sign it, decide what
follows it, log it and keep the endpoint's failure run.

:class:`WebhookAttempts` belongs to one worker: the policy, the clock, the async face of the
webhook store and what outlives an attempt on purpose (each endpoint's rate-limit slots).
Nothing about an endpoint's failure run is cached in a process: the run lives in the store,
shared by every worker; a failed attempt reads it afresh, and a success ends it with a write the
store applies only where a run exists (so a run another worker recorded ends too).
:class:`DeliveryAttempt` is one attempt, like starlette's per-request responder: created when
the attempt starts and dropped when it ends, whatever the outcome (sent, deferred by the rate
limit, lease lost, cancelled), so nothing an attempt learned (its endpoint, its event) can leak
into another one. :class:`WebhookAttempts` is the Worker's ``attempt_hooks``
(:class:`~retrysafe.client._worker.AttemptHooksFactory`): every store call here is awaited on
the webhook store's async face, so nothing blocks the event loop.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable, Sequence

from retrysafe._exceptions import StoreUnavailableError, WebhookError
from retrysafe.client._models import Attempt, Job, JobState
from retrysafe.client._policy import Step
from retrysafe.client._sender import SendResult
from retrysafe.core import Action, AttemptOutcome
from retrysafe.observability._telemetry import Telemetry
from retrysafe.webhooks._admin import log_disabled
from retrysafe.webhooks._endpoints import active_secrets
from retrysafe.webhooks._models import AsyncWebhookStore, WebhookEndpoint, WebhookStore
from retrysafe.webhooks._policy import (
    WebhookPolicy,
    decide,
    disables_endpoint,
    ends_failure_run,
    rate_gate,
    should_auto_disable,
)
from retrysafe.webhooks._signing import signature_header

__all__ = ["FAILURES_REASON", "GONE_REASON", "DeliveryAttempt", "RateLimits", "WebhookAttempts"]

logger = logging.getLogger("retrysafe.webhooks")

#: Outcomes that say nothing about the endpoint's health (delivered, or still in progress).
_NOT_FAILED = {AttemptOutcome.SUCCESS.value, AttemptOutcome.IN_PROGRESS.value}
#: Seconds after its slot a deferred attempt's reservation is forgotten (another worker sent
#: the delivery, or it was deleted): at worst that attempt reserves a new slot.
STALE_SLOT = 60.0


#: How the reasons of automatic disabling read (the metrics' ``reason`` label is read back
#: from them: :func:`retrysafe.observability._collect.disabled_reason_class`).
GONE_REASON = "410 Gone"
FAILURES_REASON = "consecutive failed attempts"

class RateLimits:
    """Per-endpoint attempt spacing in one worker process (GCRA, :func:`rate_gate`).

    A deferred attempt reserved a slot; when its delivery comes back at that slot it goes at
    once instead of reserving another one. Reservations left unused for :data:`STALE_SLOT`
    seconds after their slot are forgotten, so nothing grows without bound.
    """

    def __init__(self) -> None:
        self._tat: dict[str, float] = {}
        self._slots: dict[str, float] = {}
        self._expiry: list[tuple[float, str]] = []

    def held(self, job_id: str, now: float) -> bool:
        """Whether ``job_id`` comes back to a slot it reserved (the slot is used up)."""
        while self._expiry and self._expiry[0][0] < now - STALE_SLOT:
            slot, stale = heapq.heappop(self._expiry)
            if self._slots.get(stale) == slot:
                del self._slots[stale]
        return self._slots.pop(job_id, None) is not None

    def reserve(self, endpoint_id: str, rate: float, job_id: str, now: float) -> float:
        """Reserve the endpoint's next slot for ``job_id``: seconds to wait (0: go now)."""
        wait, self._tat[endpoint_id] = rate_gate(self._tat.get(endpoint_id, 0.0), now, rate=rate)
        if wait > 0:
            self._slots[job_id] = now + wait
            heapq.heappush(self._expiry, (now + wait, job_id))
        return wait


class WebhookAttempts:
    """What one webhook worker keeps across attempts, and the factory of each
    :class:`DeliveryAttempt`.

    Args:
        store: the webhook store (its async face is opened on first use, on the worker's
            event loop, and closed by :meth:`aclose`).
        policy: schedules and auto-disable rules.
        clock: Unix-seconds clock.
        rng: jitter source of the schedules.
        face: the async face to use instead of the store's own.
        telemetry: where each delivery's outcome (by endpoint id) and each automatic
            disabling (by reason) is reported, or None.
        runs_end_on_record: the worker's records end the failure run of each 2xx themselves
            (:class:`~retrysafe.webhooks._store.DeliveryOutboxStore`); otherwise each 2xx
            ends it with ``reset_endpoint_failures`` after its record.
    """

    def __init__(
        self,
        store: WebhookStore,
        *,
        policy: WebhookPolicy,
        clock: Callable[[], float],
        rng: random.Random,
        face: AsyncWebhookStore | None = None,
        telemetry: Telemetry | None = None,
        runs_end_on_record: bool = False,
    ) -> None:
        self.telemetry = telemetry
        self.runs_end_on_record = runs_end_on_record
        self.policy = policy
        self.clock = clock
        self.rng = rng
        self.limits = RateLimits()
        self._store = store
        self._astore = face

    @property
    def astore(self) -> AsyncWebhookStore:
        if self._astore is None:
            self._astore = self._store.asyncio_webhook_store()
        return self._astore

    def attempt(self, job: Job) -> DeliveryAttempt:
        """The :class:`DeliveryAttempt` of one attempt of the leased ``job``."""
        return DeliveryAttempt(self, job)

    async def aclose(self) -> None:
        """Close the async face (a later attempt opens a new one). Idempotent."""
        astore, self._astore = self._astore, None
        if astore is not None:
            await astore.aclose()


class DeliveryAttempt:
    """One attempt of one delivery (see the module docstring).

    A job of the webhook queue that is no delivery (submitted through ``Webhooks.outbox``) is
    sent as the outbox would send it: unsigned, on the outbox's own schedule.
    """

    __slots__ = ("_attempts", "_context", "_read", "job")

    def __init__(self, attempts: WebhookAttempts, job: Job) -> None:
        self._attempts = attempts
        self.job = job
        self._read = False
        self._context: tuple[str, WebhookEndpoint] | None = None

    async def context(self) -> tuple[str, WebhookEndpoint] | None:
        """``(event id, endpoint)`` as read at this attempt's start, or None: not a delivery
        (or deleted with its endpoint)."""
        if not self._read:
            self._context = await self._attempts.astore.delivery_context(self.job.id)
            self._read = True
        return self._context

    async def gate(self, now: float) -> float:
        """Seconds to defer this attempt by its endpoint's rate limit (0: go now); a deferred
        attempt keeps its slot for when the delivery comes back."""
        limits = self._attempts.limits
        if limits.held(self.job.id, now):
            return 0.0
        context = await self.context()
        rate = None if context is None else context[1].rate_limit
        if context is None or rate is None:
            return 0.0
        # Reserve as of now, after the read: the attempt starts right after a 0, and a
        # deferral is counted from the caller's ``now`` to the reserved slot.
        at = max(now, self._attempts.clock())
        wait = limits.reserve(context[1].id, rate, self.job.id, at)
        return wait + (at - now) if wait > 0 else 0.0

    async def headers(self) -> Sequence[tuple[str, str]]:
        """This attempt's signature headers: the event's ``webhook-id``, a fresh
        ``webhook-timestamp`` and ``webhook-signature`` (every active secret).

        Raises:
            WebhookError: the delivery was deleted with its endpoint after the claim (never
                send it).
        """
        context = await self.context()
        if context is None:
            if any(name.lower() == "webhook-id" for name, _ in self.job.headers):
                raise WebhookError(f"delivery {self.job.id} was deleted with its endpoint")
            return []
        event_id, endpoint = context
        timestamp = int(self._attempts.clock())
        secrets = active_secrets(endpoint, timestamp) or [endpoint.secrets[0][0]]
        return [
            ("webhook-id", event_id),
            ("webhook-timestamp", str(timestamp)),
            ("webhook-signature", signature_header(secrets, event_id, timestamp, self.job.body)),
        ]

    async def decide(self, job: Job, result: SendResult, step: Step) -> Step:
        """The step after the attempt. After a 2xx, SUCCEEDED whatever the endpoint says now,
        so nothing is read (:meth:`attempted` ends the endpoint's failure run). After any
        other answer, the endpoint's schedule, read afresh (an endpoint disabled meanwhile
        parks the delivery)."""
        if self._context is None:
            return step
        a = self._attempts
        endpoint: WebhookEndpoint | None
        if result.classification.action is Action.SUCCEED:
            endpoint = self._context[1]  # its schedule and state change nothing for a 2xx
        else:
            endpoint = await a.astore.get_endpoint(self._context[1].id)
        return decide(
            result.classification,
            schedule=a.policy.schedule(None if endpoint is None else endpoint.schedule),
            attempts=job.attempts,
            now=a.clock(),
            retry_after=result.retry_after,
            retry_after_max=a.policy.retry_after_max,
            endpoint_enabled=endpoint is not None and endpoint.enabled,
            default=step,
            rng=a.rng,
            deadline_at=job.deadline_at,
        )

    async def attempted(self, job: Job, attempt: Attempt, step: Step) -> None:
        """After the recorded attempt: one structured log line, and the endpoint's failure run
        (a success ends it; 410 Gone, or a run both long and old enough
        (:func:`should_auto_disable`), disables the endpoint).

        A success ends the run whenever the endpoint has one after the answer, whichever
        worker recorded it: the write changes the endpoint only where its failure count is
        above zero (no process's cache decides it). On a SQL store the record itself made
        that write (:func:`~retrysafe.webhooks._store.finish_deliveries`, one statement per
        batch of records); on a store of one's own it is made here.
        """
        if self._context is None:
            return
        event_id, endpoint_id = self._context[0], self._context[1].id
        _log_attempt(event_id, endpoint_id, job.id, attempt, step)
        a = self._attempts
        if a.telemetry is not None:
            a.telemetry.webhook_delivery(endpoint_id, delivery_outcome(attempt, step))
        try:
            if ends_failure_run(attempt.outcome):
                if not a.runs_end_on_record:
                    await a.astore.reset_endpoint_failures(endpoint_id)
            elif attempt.outcome not in _NOT_FAILED:
                await self._failed(endpoint_id, attempt)
        except StoreUnavailableError as exc:  # the attempt is recorded: only the run waits
            logger.warning(
                "endpoint=%s failure run not updated after delivery %s (%s); the endpoint's "
                "next answer updates it",
                endpoint_id,
                job.id,
                exc,
            )

    async def _failed(self, endpoint_id: str, attempt: Attempt) -> None:
        """Count a failed attempt in its endpoint's run; disable the endpoint on 410 Gone or
        a run long and old enough."""
        a = self._attempts
        now = a.clock()
        if disables_endpoint(attempt.status):
            await self._disable(
                endpoint_id, f"{GONE_REASON} at attempt {attempt.number}", now, kind="gone"
            )
            return
        run = await a.astore.record_endpoint_failure(endpoint_id, now=now)
        if run is None:
            return
        failures, first_at, enabled = run
        if not enabled or first_at is None:
            return
        if should_auto_disable(
            failures,
            first_at,
            now,
            disable_after=a.policy.disable_after,
            disable_window=a.policy.disable_window_s,
        ):
            reason = f"{failures} {FAILURES_REASON} over {_span(now - first_at)}"
            await self._disable(endpoint_id, reason, now, kind="failures")

    async def _disable(self, endpoint_id: str, reason: str, now: float, *, kind: str) -> None:
        a = self._attempts
        disabled = await a.astore.set_endpoint_enabled(
            endpoint_id, enabled=False, reason=reason, now=now, only_if_enabled=True
        )
        if disabled:  # None: already disabled (by another attempt of this run, or by hand)
            log_disabled(endpoint_id, reason)
            if a.telemetry is not None:
                a.telemetry.endpoint_disabled(kind)


def delivery_outcome(attempt: Attempt, step: Step) -> str:
    """The ``outcome`` label of a delivery attempt: ``delivered`` (2xx), ``retrying`` (it
    will be sent again), ``cancelled`` (parked: the endpoint is disabled) or ``failed`` (it
    went to the dead-letter queue, UNKNOWN or REJECTED)."""
    if attempt.outcome == AttemptOutcome.SUCCESS.value:
        return "delivered"
    if step.state is JobState.PENDING:
        return "retrying"
    if step.state is JobState.CANCELLED:
        return "cancelled"
    return "failed"


def _span(seconds: float) -> str:
    """A failure run's span for a reason, e.g. ``"45 s"``, ``"67 min"``, ``"5.2 h"``,
    ``"5.0 days"``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _log_attempt(
    event_id: str, endpoint_id: str, job_id: str, attempt: Attempt, step: Step
) -> None:
    if not logger.isEnabledFor(logging.INFO):  # the hot path: build nothing for nobody
        return
    data = {
        "event_id": event_id,
        "endpoint_id": endpoint_id,
        "delivery_id": job_id,
        "attempt": attempt.number,
        "status": attempt.status,
        "latency_ms": round(attempt.duration * 1000, 1),
        "outcome": attempt.outcome,
        "error_type": attempt.error_type,
        "next_state": step.state.value,
        "next_in": round(step.delay, 3),
    }
    logger.info(
        "webhook attempt event=%s endpoint=%s delivery=%s attempt=%d status=%s "
        "latency=%.1fms outcome=%s next=%s",
        event_id,
        endpoint_id,
        job_id,
        attempt.number,
        attempt.status,
        attempt.duration * 1000,
        attempt.outcome,
        step.state.value,
        extra={"retrysafe": data},
    )
