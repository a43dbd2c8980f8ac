"""Sending and dead letters (SPEC §6): record an event once and fan it out as one outbox job
per subscribed endpoint; list, inspect, replay (same ``webhook-id``) and purge deliveries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from retrysafe._exceptions import (
    JobNotFoundError,
    PayloadError,
    StoreUnavailableError,
    WebhookError,
)
from retrysafe.client._jobs import _encode_json, build_job, job_id_prefix, notify_submitted
from retrysafe.client._models import Attempt, JobState, NewJob, OutboxStore
from retrysafe.client._outbox import unknown_submission
from retrysafe.client._policy import count, seconds
from retrysafe.core import canonical_body
from retrysafe.stores._connector import before_user_write
from retrysafe.webhooks._admin import EndpointAdmin
from retrysafe.webhooks._endpoints import check_event_id, check_event_type, matches, new_event_id
from retrysafe.webhooks._models import WebhookDelivery, WebhookEvent, WebhookStore
from retrysafe.webhooks._policy import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD_HINT

__all__ = ["DEAD_LETTER_STATES", "MISSED_STATES", "QUEUE", "Dispatcher"]

#: The outbox queue of webhook deliveries: the webhook worker claims only it, plain outbox
#: workers never do.
QUEUE = "webhooks"
#: The content type of every event payload (JSON).
_JSON = "application/json"
#: Deliveries in the dead-letter queue: the schedule ran out (UNKNOWN) or the endpoint
#: answered a 4xx that is not retried (REJECTED).
DEAD_LETTER_STATES = (JobState.UNKNOWN, JobState.REJECTED)
#: What ``enable_endpoint(replay_missed=True)`` sends again: parked while disabled, and the
#: dead letters.
MISSED_STATES = (JobState.CANCELLED, JobState.UNKNOWN, JobState.REJECTED)


class Dispatcher:
    """Events, deliveries and the dead-letter queue of one webhook store.

    Args:
        store: the webhook store.
        outbox: the outbox store on the same database (deliveries are its jobs).
        endpoints: the endpoint administration (id prefixes, enabled checks).
        clock: Unix-seconds clock.
    """

    def __init__(
        self,
        store: WebhookStore,
        outbox: OutboxStore,
        *,
        endpoints: EndpointAdmin,
        clock: Callable[[], float],
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.store = store
        self.outbox = outbox
        self.endpoints = endpoints
        self._clock = clock
        self.max_payload = max_payload

    # ------------------------------------------------------------------ sending
    def send(self, event_type: str, payload: Any, event_id: str | None = None) -> WebhookEvent:
        """Record an event once and one delivery per subscribed endpoint (one transaction).

        Enabled endpoints get a PENDING delivery the worker sends; disabled ones a parked
        (CANCELLED) delivery that :meth:`Webhooks.enable_endpoint` can replay. Sending an
        event id again with the same type and payload returns the recorded event and adds
        nothing; payloads are the same when their JSON is, members in any order (the
        canonical form of an idempotency key's fingerprint, SPEC §1).

        Args:
            event_type: e.g. ``"invoice.paid"``.
            payload: a JSON-serialisable value (sent as the exact body that is signed).
            event_id: your stable id (the ``webhook-id``); default ``msg_`` + 32 hex.

        Returns:
            The recorded :class:`~retrysafe.webhooks.Event`.

        Raises:
            ConfigurationError: a malformed event type or id.
            PayloadError: the payload cannot be serialised to JSON, or its JSON is longer than
                the policy's ``max_payload`` (1 MiB by default); nothing recorded.
            WebhookError: ``event_id`` was already used for another type or payload.
            SubmitOutcomeUnknownError: the store did not answer the write: the event may be
                recorded; send it again with ``event_id=`` its ``key``.
            StoreError: the store failed otherwise (nothing recorded).
        """
        event_type = check_event_type(event_type)
        event_id = new_event_id() if event_id is None else check_event_id(event_id)
        body = _encode_json(payload)
        if len(body) > self.max_payload:
            raise PayloadError(
                f"payload is {len(body):,} bytes of JSON, over the limit of "
                f"{self.max_payload:,} ({MAX_PAYLOAD_HINT}): nothing recorded"
            )
        now = self._clock()
        deliveries: list[tuple[NewJob, str, bool]] = []
        before_user_write(self.store)
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
        try:
            created, stored = self.store.insert_event(event, deliveries, now=now)
        except StoreUnavailableError as exc:
            unknown = unknown_submission(
                self.store,
                exc,
                "the event",
                f"send it again with event_id={event_id!r} (the same event with the same id "
                "returns the stored one or records it once; a new id could send it twice to "
                "every endpoint)",
                key=event_id,
            )
            if unknown is None:
                raise
            raise unknown from exc
        if not created:
            same_payload = canonical_body(stored.payload, _JSON) == canonical_body(body, _JSON)
            if stored.event_type != event_type:
                raise WebhookError(
                    f"event id {event_id!r} is already used for an event of type "
                    f"{stored.event_type!r}, not {event_type!r}"
                    + ("" if same_payload else ", with another payload")
                )
            if not same_payload:
                raise WebhookError(
                    f"event id {event_id!r} is already used for an event of the same type with "
                    "another payload"
                )
            return stored
        if any(not parked for _, _, parked in deliveries):
            notify_submitted(self.outbox.url)
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
        full = None if endpoint_id is None else self.endpoints.resolve_endpoint(endpoint_id)
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
        prefix = job_id_prefix(str(delivery_id))  # a delivery id is a job id
        found = [] if prefix is None else self.store.delivery_ids_with_prefix(prefix)
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise JobNotFoundError(
                f"delivery id prefix {delivery_id!r} is ambiguous; give more characters",
                job_id=delivery_id,
            )
        raise JobNotFoundError(
            f"no delivery {delivery_id!r} in {self.store.url}", job_id=delivery_id
        )

    def delivery(self, delivery_id: str) -> WebhookDelivery:
        """One delivery (full id or unique prefix). Raises :class:`JobNotFoundError`."""
        full = self.resolve_delivery(delivery_id)
        return self.store.list_deliveries(ids=[full], limit=1)[0]

    def attempts(self, delivery_id: str) -> list[Attempt]:
        """Every recorded attempt of a delivery, in order."""
        return self.outbox.list_attempts(self.resolve_delivery(delivery_id))

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
                self._check_replayable(d, states)
        else:
            if endpoint_id is not None:
                endpoint = self.endpoints.get_endpoint(endpoint_id)
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
            job = self.outbox.transition_job(
                d.id, from_states=list(states), state=JobState.PENDING, now=now, reset=True
            )
            if job is not None:
                requeued.append(self.store.list_deliveries(ids=[d.id], limit=1)[0])
        if requeued:
            notify_submitted(self.outbox.url)
        return requeued

    def _check_replayable(self, d: WebhookDelivery, states: Sequence[JobState]) -> None:
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

    def purge(
        self,
        *,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        older_than: float | timedelta = 0.0,
    ) -> int:
        """Delete dead letters (and their attempts) unchanged for ``older_than`` seconds;
        return how many. Never touches pending, in-flight or succeeded deliveries."""
        full = None if endpoint_id is None else self.endpoints.resolve_endpoint(endpoint_id)
        age = seconds(older_than, "older_than", allow_zero=True)
        return self.store.purge_deliveries(
            states=DEAD_LETTER_STATES,
            before=self._clock() - age,
            endpoint_id=full,
            event_type=event_type,
        )
