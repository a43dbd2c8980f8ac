"""The sending side: :class:`Webhooks` manages endpoints, records events, fans them out as
outbox jobs and builds the worker that delivers them (SPEC §6).

A delivery is one outbox job (key ``"{event id}:{endpoint id}"``) in the ``"webhooks"``
queue: it inherits the outbox's durability, leases, fencing, attempt records and retry
budget, and only the webhook worker claims it (a plain outbox worker on the same store
claims the ``"default"`` queue and never sends a delivery unsigned). The worker gets three
hooks: ``headers_for_attempt`` signs every attempt afresh (same ``webhook-id``, new
``webhook-timestamp`` and ``webhook-signature``), ``decide`` applies the endpoint's schedule
(:func:`~retrysafe.webhooks.decide`), and ``on_attempt`` logs the attempt as one structured
line and disables endpoints on 410 Gone or a run of failures.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from retrysafe._exceptions import (
    ConfigurationError,
    DestinationRefusedError,
    EndpointNotFoundError,
    JobNotFoundError,
    WebhookError,
)
from retrysafe.client._jobs import _encode_json, build_job, notify_submitted
from retrysafe.client._models import Attempt, Job, JobState, NewJob, OutboxStore
from retrysafe.client._outbox import Outbox
from retrysafe.client._policy import RetryPolicy, Step, count, seconds
from retrysafe.client._sender import SendResult
from retrysafe.client._worker import Worker
from retrysafe.core import AttemptOutcome
from retrysafe.webhooks._endpoints import (
    ROTATION_OVERLAP,
    active_secrets,
    check_event_id,
    check_event_type,
    check_event_types,
    check_secret,
    check_url,
    matches,
    new_endpoint_id,
    new_event_id,
    rotated,
)
from retrysafe.webhooks._models import WebhookDelivery, WebhookEndpoint, WebhookEvent, WebhookStore
from retrysafe.webhooks._policy import (
    WebhookPolicy,
    decide,
    disables_endpoint,
    rate_gate,
    should_auto_disable,
)
from retrysafe.webhooks._signing import generate_secret, signature_header
from retrysafe.webhooks._ssrf import PinnedTransport, resolve_checked

__all__ = ["DEAD_LETTER_STATES", "QUEUE", "Webhooks"]

logger = logging.getLogger("retrysafe.webhooks")

#: The outbox queue of webhook deliveries: the webhook worker claims only it, plain outbox
#: workers never do.
QUEUE = "webhooks"
#: Deliveries in the dead-letter queue: the schedule ran out (UNKNOWN) or the endpoint
#: answered a 4xx that is not retried (REJECTED).
DEAD_LETTER_STATES = (JobState.UNKNOWN, JobState.REJECTED)
#: What ``enable_endpoint(replay_missed=True)`` sends again: parked while disabled, and the
#: dead letters.
MISSED_STATES = (JobState.CANCELLED, JobState.UNKNOWN, JobState.REJECTED)
_NOT_SENT = {AttemptOutcome.SUCCESS.value, AttemptOutcome.IN_PROGRESS.value}


class _Keep:
    """The default of an optional argument whose None means something (no rate limit)."""


_KEEP = _Keep()


def _check_rate(rate: object) -> float | None:
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e6:
        raise ConfigurationError(
            f"rate_limit must be attempts per second > 0, or None; got {rate!r}",
            option="rate_limit",
        )
    return float(rate)


class Webhooks:
    """Webhook delivery on top of the outbox: endpoints, signed at-least-once deliveries, a
    dead-letter queue and replay (SPEC §6).

    Args:
        store: an outbox store with webhook tables, or its URL (``sqlite:///path.db``).
        allow_private: allow endpoints on private, loopback and link-local addresses
            (default False: the SSRF guard refuses them, at registration and at every
            attempt).
        policy: schedules, timeouts and auto-disable rules (default :class:`WebhookPolicy`).
        rotation_overlap: seconds a replaced secret keeps signing (default 24 h).
        clock: Unix-seconds clock.

    Raises:
        ConfigurationError: a malformed store URL or a store without webhook tables.
    """

    def __init__(
        self,
        store: str | OutboxStore = "sqlite:///retrysafe.db",
        *,
        allow_private: bool = False,
        policy: WebhookPolicy | None = None,
        rotation_overlap: float | timedelta = ROTATION_OVERLAP,
        clock: Any = time.time,
    ) -> None:
        self.policy = policy or WebhookPolicy()
        self.allow_private = bool(allow_private)
        self.rotation_overlap = seconds(rotation_overlap, "rotation_overlap", allow_zero=True)
        self._clock = clock
        self.outbox = Outbox(
            store, policy=RetryPolicy(timeout=self.policy.timeout), clock=clock, queue=QUEUE
        )
        if not isinstance(self.outbox.store, WebhookStore):
            self.outbox.close()
            raise ConfigurationError(
                f"store {self.outbox.store!r} has no webhook tables; use sqlite:///path.db",
                option="store",
            )
        self.store: WebhookStore = self.outbox.store
        self._contexts: dict[str, tuple[str, str]] = {}
        self._clean: set[str] = set()
        self._rng = random.Random()
        self._tat: dict[str, float] = {}
        self._reserved: dict[str, float] = {}
        self._looked_up: dict[str, tuple[str, WebhookEndpoint] | None] = {}

    def __repr__(self) -> str:
        return f"Webhooks({self.outbox.store.url!r})"

    # ------------------------------------------------------------------ endpoints
    def _check_destination(self, url: str) -> None:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        resolve_checked(parts.hostname or "", port, allow_private=self.allow_private, url=url)

    def add_endpoint(
        self,
        url: str,
        *,
        secret: str | None = None,
        event_types: Sequence[str] | None = None,
        description: str = "",
        schedule: str | None = None,
        rate_limit: float | None = None,
        enabled: bool = True,
    ) -> WebhookEndpoint:
        """Register a subscriber endpoint.

        Args:
            url: the http(s) URL deliveries are POSTed to.
            secret: its ``whsec_`` secret (>= 24 random bytes); default a fresh one
                (read it back from the returned endpoint's ``secrets[0][0]``).
            event_types: the types it receives (``invoice.paid``, ``invoice.*``, ``*``);
                empty or None: every type.
            description: free text.
            schedule: the name of a schedule in the policy (default ``"default"``).
            rate_limit: the most attempts per second it receives (None: unlimited),
                spaced evenly; enforced per worker process.
            enabled: False registers it disabled (its deliveries are parked).

        Returns:
            The stored :class:`~retrysafe.stores.WebhookEndpoint`.

        Raises:
            ConfigurationError: a bad URL, secret, event type or schedule name.
            DestinationRefusedError: the host resolves to a refused address (SSRF guard) or
                does not resolve.
        """
        url = check_url(url)
        secret = generate_secret() if secret is None else check_secret(secret)
        types = check_event_types(event_types)
        schedule = self._check_schedule(schedule)
        if not isinstance(description, str):
            raise ConfigurationError("description must be a string", option="description")
        self._check_destination(url)
        now = self._clock()
        endpoint = WebhookEndpoint(
            id=new_endpoint_id(),
            url=url,
            secrets=((secret, None),),
            event_types=types,
            description=description,
            schedule=schedule,
            rate_limit=_check_rate(rate_limit),
            enabled=bool(enabled),
            disabled_reason=None if enabled else "registered disabled",
            failure_count=0,
            first_failure_at=None,
            created_at=now,
            updated_at=now,
        )
        return self.store.insert_endpoint(endpoint)

    def _check_schedule(self, schedule: str | None) -> str:
        if schedule is None:
            return self.policy.default_schedule
        if not isinstance(schedule, str) or not self.policy.has_schedule(schedule):
            names = sorted(s.name for s in self.policy.schedules)
            raise ConfigurationError(
                f"schedule {schedule!r} is not one of {names}", option="schedule"
            )
        return schedule

    def resolve_endpoint(self, endpoint_id: str) -> str:
        """The full id of ``endpoint_id`` or of the one endpoint whose id starts with it.

        Raises:
            EndpointNotFoundError: none, or the prefix is ambiguous.
        """
        if not isinstance(endpoint_id, str) or not endpoint_id:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}")
        if self.store.get_endpoint(endpoint_id) is not None:
            return endpoint_id
        found = [e.id for e in self.store.list_endpoints() if e.id.startswith(endpoint_id)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise EndpointNotFoundError(
                f"endpoint id prefix {endpoint_id!r} is ambiguous: {', '.join(found[:3])}",
                endpoint_id=endpoint_id,
            )
        raise EndpointNotFoundError(
            f"no endpoint {endpoint_id!r} in {self.outbox.store.url}", endpoint_id=endpoint_id
        )

    def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint:
        """The endpoint (full id or unique prefix). Raises :class:`EndpointNotFoundError`."""
        full = self.resolve_endpoint(endpoint_id)
        endpoint = self.store.get_endpoint(full)
        if endpoint is None:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)
        return endpoint

    def list_endpoints(self) -> list[WebhookEndpoint]:
        """Every endpoint, oldest first."""
        return self.store.list_endpoints()

    def update_endpoint(
        self,
        endpoint_id: str,
        *,
        url: str | None = None,
        secret: str | None = None,
        event_types: Sequence[str] | None = None,
        description: str | None = None,
        schedule: str | None = None,
        rate_limit: float | _Keep | None = _KEEP,
    ) -> WebhookEndpoint:
        """Change an endpoint; None (for ``rate_limit``: leaving it out) keeps a field.

        A new ``url`` also applies to its deliveries not yet succeeded. A new ``secret``
        rotates: it signs from now on, and the previous secret keeps signing too for
        ``rotation_overlap`` seconds (several ``v1,`` signatures per attempt).

        Raises:
            EndpointNotFoundError: no such endpoint.
            ConfigurationError, DestinationRefusedError: as for :meth:`add_endpoint`.
        """
        current = self.get_endpoint(endpoint_id)
        now = self._clock()
        new_url = current.url if url is None else check_url(url)
        if url is not None:
            self._check_destination(new_url)
        secrets = current.secrets
        if secret is not None:
            secrets = rotated(current, check_secret(secret), now=now, overlap=self.rotation_overlap)
        types = current.event_types if event_types is None else check_event_types(event_types)
        if description is not None and not isinstance(description, str):
            raise ConfigurationError("description must be a string", option="description")
        changed = WebhookEndpoint(
            id=current.id,
            url=new_url,
            secrets=secrets,
            event_types=types,
            description=current.description if description is None else description,
            schedule=current.schedule if schedule is None else self._check_schedule(schedule),
            rate_limit=current.rate_limit
            if isinstance(rate_limit, _Keep)
            else _check_rate(rate_limit),
            enabled=current.enabled,
            disabled_reason=current.disabled_reason,
            failure_count=current.failure_count,
            first_failure_at=current.first_failure_at,
            created_at=current.created_at,
            updated_at=now,
        )
        updated = self.store.update_endpoint(changed, now=now, retarget=new_url != current.url)
        if updated is None:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)
        return updated

    def rotate_secret(self, endpoint_id: str, secret: str | None = None) -> WebhookEndpoint:
        """Rotate to ``secret`` (default a fresh one); see :meth:`update_endpoint`."""
        return self.update_endpoint(endpoint_id, secret=secret or generate_secret())

    def disable_endpoint(
        self, endpoint_id: str, reason: str = "disabled by an operator"
    ) -> WebhookEndpoint:
        """Stop sending to an endpoint. Its pending deliveries are parked (CANCELLED) and new
        events still record a parked delivery for it: nothing is lost.

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        full = self.resolve_endpoint(endpoint_id)
        endpoint = self.store.set_endpoint_enabled(
            full, enabled=False, reason=str(reason), now=self._clock()
        )
        if endpoint is None:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)
        logger.warning("endpoint %s disabled: %s", full, reason)
        return endpoint

    def enable_endpoint(self, endpoint_id: str, *, replay_missed: bool = False) -> WebhookEndpoint:
        """Send to an endpoint again; with ``replay_missed`` also re-queue what it missed:
        its parked (CANCELLED) deliveries and its dead letters, with their same
        ``webhook-id``.

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        full = self.resolve_endpoint(endpoint_id)
        endpoint = self.store.set_endpoint_enabled(
            full, enabled=True, reason=None, now=self._clock()
        )
        if endpoint is None:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)
        self._clean.discard(full)
        if replay_missed:
            self.replay(endpoint_id=full, states=MISSED_STATES)
        return endpoint

    def delete_endpoint(self, endpoint_id: str) -> None:
        """Delete an endpoint with its deliveries and their attempts (events stay).

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        full = self.resolve_endpoint(endpoint_id)
        if not self.store.delete_endpoint(full):
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)

    # ------------------------------------------------------------------ sending
    def send(self, event_type: str, payload: Any, event_id: str | None = None) -> WebhookEvent:
        """Record an event once and one delivery per subscribed endpoint (one transaction).

        Enabled endpoints get a PENDING delivery the worker sends; disabled ones a parked
        (CANCELLED) delivery that :meth:`enable_endpoint` can replay. Sending an event id
        again with the same type and payload returns the recorded event and adds nothing.

        Args:
            event_type: e.g. ``"invoice.paid"``.
            payload: a JSON-serialisable value (sent as the exact body that is signed).
            event_id: your stable id (the ``webhook-id``); default ``msg_`` + 32 hex.

        Returns:
            The recorded :class:`~retrysafe.stores.WebhookEvent`.

        Raises:
            ConfigurationError: a malformed event type or id.
            PayloadError: the payload cannot be serialised to JSON (nothing recorded).
            WebhookError: ``event_id`` was already used for another type or payload.
            StoreError: the store failed (nothing recorded).
        """
        event_type = check_event_type(event_type)
        event_id = new_event_id() if event_id is None else check_event_id(event_id)
        body = _encode_json(payload)
        now = self._clock()
        deliveries: list[tuple[NewJob, str, bool]] = []
        for endpoint in self.store.list_endpoints():
            if not matches(endpoint, event_type):
                continue
            job = build_job(
                endpoint.url,
                content=body,
                headers={"Content-Type": "application/json", "webhook-id": event_id},
                key=f"{event_id}:{endpoint.id}",
                now=now,
                queue=QUEUE,
            )
            deliveries.append((job, endpoint.id, not endpoint.enabled))
        event = WebhookEvent(id=event_id, event_type=event_type, payload=body, created_at=now)
        created, stored = self.store.insert_event(event, deliveries, now=now)
        if not created:
            if (stored.event_type, stored.payload) != (event_type, body):
                raise WebhookError(
                    f"event id {event_id!r} is already used for another event ({stored.event_type})"
                )
            return stored
        if any(not parked for _, _, parked in deliveries):
            notify_submitted(self.outbox.store.url)
        return stored

    def get_event(self, event_id: str) -> WebhookEvent:
        """The recorded event. Raises :class:`WebhookError` when there is none."""
        event = self.store.get_event(event_id)
        if event is None:
            raise WebhookError(f"no event {event_id!r}")
        return event

    # ------------------------------------------------------------------ deliveries / DLQ
    def deliveries(
        self,
        *,
        event_id: str | None = None,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        states: Sequence[JobState | str] | None = None,
        limit: int = 100,
    ) -> list[WebhookDelivery]:
        """Deliveries, oldest first, filtered by event, endpoint, event type and state."""
        full = None if endpoint_id is None else self.resolve_endpoint(endpoint_id)
        wanted = None if states is None else [JobState(s) for s in states]
        return self.store.list_deliveries(
            event_id=event_id,
            endpoint_id=full,
            event_type=event_type,
            states=wanted,
            limit=count(limit, "limit"),
        )

    def dead_letters(
        self,
        *,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        limit: int = 100,
    ) -> list[WebhookDelivery]:
        """The dead-letter queue: deliveries whose schedule ran out (UNKNOWN) or that a
        4xx rejected (REJECTED); see :meth:`attempts` for each one's attempts."""
        return self.deliveries(
            endpoint_id=endpoint_id,
            event_type=event_type,
            states=DEAD_LETTER_STATES,
            limit=limit,
        )

    def resolve_delivery(self, delivery_id: str) -> str:
        """The full id of a delivery (or of the one whose id starts with ``delivery_id``).

        Raises:
            JobNotFoundError: none, or the prefix is ambiguous.
        """
        if self.store.list_deliveries(ids=[delivery_id], limit=1):
            return delivery_id
        found = self.store.delivery_ids_with_prefix(str(delivery_id).lower())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise JobNotFoundError(
                f"delivery id prefix {delivery_id!r} is ambiguous; give more characters",
                job_id=delivery_id,
            )
        raise JobNotFoundError(f"no delivery {delivery_id!r}", job_id=delivery_id)

    def delivery(self, delivery_id: str) -> WebhookDelivery:
        """One delivery (full id or unique prefix). Raises :class:`JobNotFoundError`."""
        full = self.resolve_delivery(delivery_id)
        return self.store.list_deliveries(ids=[full], limit=1)[0]

    def attempts(self, delivery_id: str) -> list[Attempt]:
        """Every recorded attempt of a delivery, in order."""
        return self.outbox.store.list_attempts(self.resolve_delivery(delivery_id))

    def replay(
        self,
        ids: str | Sequence[str] | None = None,
        *,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        states: Sequence[JobState] = DEAD_LETTER_STATES,
        limit: int = 10_000,
    ) -> list[WebhookDelivery]:
        """Send dead letters again with their **same** ``webhook-id`` and a fresh schedule.

        Either the given delivery ids, or every delivery in ``states`` (default the DLQ)
        matching the filters whose endpoint is enabled.

        Returns:
            The re-queued (PENDING) deliveries.

        Raises:
            JobNotFoundError: an id matches no delivery.
            EndpointNotFoundError: ``endpoint_id`` matches no endpoint.
            WebhookError: an explicit id is not in ``states``, or its endpoint (or the
                ``endpoint_id`` endpoint) is disabled.
        """
        if isinstance(ids, str):
            ids = [ids]
        if ids is not None:
            targets = [self.delivery(i) for i in ids]
            for d in targets:
                if d.state not in states:
                    raise WebhookError(
                        f"delivery {d.id} is {d.state.value}; only "
                        f"{'/'.join(s.value for s in states)} deliveries are replayed",
                        endpoint_id=d.endpoint_id,
                    )
                endpoint = self.store.get_endpoint(d.endpoint_id)
                if endpoint is None or not endpoint.enabled:
                    raise WebhookError(
                        f"endpoint {d.endpoint_id} of delivery {d.id} is disabled; "
                        "enable it first (enable_endpoint(replay_missed=True) replays all)",
                        endpoint_id=d.endpoint_id,
                    )
        else:
            if endpoint_id is not None:
                endpoint = self.get_endpoint(endpoint_id)
                if not endpoint.enabled:
                    raise WebhookError(
                        f"endpoint {endpoint.id} is disabled; enable it first "
                        "(enable_endpoint(replay_missed=True) replays all)",
                        endpoint_id=endpoint.id,
                    )
            enabled = {e.id for e in self.store.list_endpoints() if e.enabled}
            targets = [
                d
                for d in self.deliveries(
                    endpoint_id=endpoint_id, event_type=event_type, states=states, limit=limit
                )
                if d.endpoint_id in enabled
            ]
        now = self._clock()
        requeued: list[WebhookDelivery] = []
        for d in targets:
            job = self.outbox.store.transition_job(
                d.id, from_states=list(states), state=JobState.PENDING, now=now, reset=True
            )
            if job is not None:
                requeued.append(self.store.list_deliveries(ids=[d.id], limit=1)[0])
        if requeued:
            notify_submitted(self.outbox.store.url)
        return requeued

    def purge(
        self,
        *,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        older_than: float | timedelta = 0.0,
    ) -> int:
        """Delete dead letters (and their attempts) unchanged for ``older_than`` seconds;
        return how many. Never touches pending, in-flight or succeeded deliveries."""
        full = None if endpoint_id is None else self.resolve_endpoint(endpoint_id)
        age = seconds(older_than, "older_than", allow_zero=True)
        return self.store.purge_deliveries(
            states=DEAD_LETTER_STATES,
            before=self._clock() - age,
            endpoint_id=full,
            event_type=event_type,
        )

    # ------------------------------------------------------------------ the worker
    def refused_endpoints(self) -> list[tuple[WebhookEndpoint, DestinationRefusedError]]:
        """The enabled endpoints the SSRF guard would refuse now (empty when
        ``allow_private``): every attempt to them fails with ``DestinationRefused`` until
        the schedule runs out. Resolves each host once (blocking); a host that does not
        resolve is not listed (DNS may be down for a moment)."""
        if self.allow_private:
            return []
        refused = []
        for endpoint in self.store.list_endpoints():
            if not endpoint.enabled:
                continue
            try:
                self._check_destination(endpoint.url)
            except DestinationRefusedError as exc:
                if exc.reason != "unresolved":
                    refused.append((endpoint, exc))
        return refused

    def worker(self, **options: Any) -> Worker:
        """A :class:`~retrysafe.client.Worker` that delivers webhooks: signs each attempt,
        follows each endpoint's schedule, pins the checked address (SSRF guard).

        It claims only the ``"webhooks"`` queue: plain outbox jobs in the same store are left
        to a plain worker.

        ``options`` are the Worker's (``concurrency``, ``poll_interval``, ``rng``, …); a
        ``transport`` is wrapped by the SSRF guard. ``headers_for_attempt``, ``decide`` and
        ``queue`` are this object's; an ``on_attempt`` is called after this object's own.

        Without ``allow_private``, logs one warning per enabled endpoint on a private,
        loopback or link-local address (see :meth:`refused_endpoints`): its deliveries
        would be refused at every attempt.
        """
        if options.pop("queue", QUEUE) != QUEUE:
            raise ConfigurationError(
                f"the webhook worker delivers the {QUEUE!r} queue only", option="queue"
            )
        for endpoint, exc in self.refused_endpoints():
            logger.warning(
                "endpoint %s is on a refused address and this worker does not allow private "
                "destinations: its deliveries will fail (%s)",
                endpoint.id,
                exc,
            )
        options.setdefault("policy", self.outbox.policy)
        options.setdefault("clock", self._clock)
        if "rng" in options and options["rng"] is not None:
            self._rng = options["rng"]
        inner = options.pop("transport", None)
        options["transport"] = PinnedTransport(inner, allow_private=self.allow_private)
        user_hook = options.pop("on_attempt", None)

        def on_attempt(job: Job, attempt: Attempt, step: Step) -> None:
            self._on_attempt(job, attempt, step)
            if user_hook is not None:
                user_hook(job, attempt, step)

        return Worker(
            self.outbox.store,
            queue=QUEUE,
            headers_for_attempt=self._headers_for_attempt,
            decide=self._decide,
            gate=self._gate,
            on_attempt=on_attempt,
            **options,
        )

    def _gate(self, job: Job, now: float) -> float:
        """Per-endpoint rate limit: a slot per attempt; a deferred attempt keeps its slot."""
        if self._reserved.pop(job.id, None) is not None:
            return 0.0
        context = self.store.delivery_context(job.id)
        if context is None or context[1].rate_limit is None:
            self._looked_up[job.id] = context  # the signing hook, right after, reuses it
            return 0.0
        endpoint = context[1]
        assert endpoint.rate_limit is not None
        wait, self._tat[endpoint.id] = rate_gate(
            self._tat.get(endpoint.id, 0.0), now, rate=endpoint.rate_limit
        )
        if wait > 0:
            self._reserved[job.id] = now + wait
        else:
            self._looked_up[job.id] = context
        return wait

    def _headers_for_attempt(self, job: Job) -> list[tuple[str, str]]:
        if job.id in self._looked_up:
            context = self._looked_up.pop(job.id)
        else:
            context = self.store.delivery_context(job.id)
        if context is None:
            if any(name.lower() == "webhook-id" for name, _ in job.headers):
                # Its endpoint was deleted (with the job) after the claim: never send it.
                raise WebhookError(f"delivery {job.id} was deleted with its endpoint")
            return []  # submitted through self.outbox, not send(): sent as the outbox would
        event_id, endpoint = context
        self._contexts[job.id] = (event_id, endpoint.id)
        timestamp = int(self._clock())
        secrets = active_secrets(endpoint, timestamp) or [endpoint.secrets[0][0]]
        return [
            ("webhook-id", event_id),
            ("webhook-timestamp", str(timestamp)),
            ("webhook-signature", signature_header(secrets, event_id, timestamp, job.body)),
        ]

    def _decide(self, job: Job, result: SendResult, step: Step) -> Step:
        context = self._contexts.get(job.id)
        if context is None:
            return step  # not a delivery (submitted through self.outbox)
        endpoint = self.store.get_endpoint(context[1])
        schedule = self.policy.schedule(None if endpoint is None else endpoint.schedule)
        return decide(
            result.classification,
            schedule=schedule,
            attempts=job.attempts,
            now=self._clock(),
            retry_after=result.retry_after,
            retry_after_max=self.policy.retry_after_max,
            endpoint_enabled=endpoint is not None and endpoint.enabled,
            default=step,
            rng=self._rng,
            deadline_at=job.deadline_at,
        )

    def _on_attempt(self, job: Job, attempt: Attempt, step: Step) -> None:
        context = self._contexts.pop(job.id, None)
        if context is None:
            return
        event_id, endpoint_id = context
        data = {
            "event_id": event_id,
            "endpoint_id": endpoint_id,
            "delivery_id": job.id,
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
            job.id,
            attempt.number,
            attempt.status,
            attempt.duration * 1000,
            attempt.outcome,
            step.state.value,
            extra={"retrysafe": data},
        )
        if attempt.outcome == AttemptOutcome.SUCCESS.value:
            if endpoint_id not in self._clean:
                self.store.reset_endpoint_failures(endpoint_id)
                self._clean.add(endpoint_id)
            return
        if attempt.outcome in _NOT_SENT:
            return
        self._clean.discard(endpoint_id)
        now = self._clock()
        if disables_endpoint(attempt.status):
            self.disable_endpoint(endpoint_id, reason=f"410 Gone at attempt {attempt.number}")
            return
        run = self.store.record_endpoint_failure(endpoint_id, now=now)
        if run is None:
            return
        failures, first_at, enabled = run
        if enabled and should_auto_disable(
            failures,
            first_at,
            now,
            disable_after=self.policy.disable_after,
            disable_window=self.policy.disable_window,
        ):
            self.disable_endpoint(endpoint_id, reason=f"{failures} consecutive failed attempts")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the store if this object opened it from a URL. Idempotent."""
        self.outbox.close()

    def __enter__(self) -> Webhooks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
