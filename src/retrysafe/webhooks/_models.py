"""Webhook models and the store seam (SPEC §6): endpoints, events, deliveries and the
:class:`WebhookStore` Protocol.

Times are Unix seconds (float).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from retrysafe.client._models import JobState, NewJob

__all__ = [
    "AsyncWebhookStore",
    "WebhookDelivery",
    "WebhookEndpoint",
    "WebhookEvent",
    "WebhookStore",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookEndpoint:
    """A subscriber endpoint as stored. Times are Unix seconds.

    Attributes:
        id: ``ep_`` + 32 hex digits.
        url: the http(s) URL deliveries are POSTed to.
        secrets: ``(whsec_ secret, expires_at or None)`` pairs, the current secret first;
            older secrets keep signing until they expire (rotation).
        event_types: the event types it receives; empty: every type.
        description: free text.
        schedule: the name of its retry schedule (``"default"``, ``"svix"``, …).
        rate_limit: the most attempts per second it receives (None: no limit).
        enabled: whether new deliveries are sent; disabled endpoints keep their deliveries
            (parked, replayable).
        disabled_reason: why it was disabled (``"410 Gone"``, ``"50 consecutive failures"``,
            an operator's note), or None.
        failure_count, first_failure_at: the current run of consecutive failed attempts.
    """

    id: str
    url: str
    secrets: tuple[tuple[str, float | None], ...]
    event_types: tuple[str, ...]
    description: str
    schedule: str
    rate_limit: float | None
    enabled: bool
    disabled_reason: str | None
    failure_count: int
    first_failure_at: float | None
    created_at: float
    updated_at: float

    def to_dict(self, *, secrets: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; secrets only with ``secrets=True`` (else how many there are)."""
        out: dict[str, Any] = {
            "id": self.id,
            "url": self.url,
            "event_types": list(self.event_types),
            "description": self.description,
            "schedule": self.schedule,
            "rate_limit": self.rate_limit,
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "failure_count": self.failure_count,
            "first_failure_at": self.first_failure_at,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "secrets": len(self.secrets),
        }
        if secrets:
            out["secrets"] = [{"secret": s, "expires_at": e} for s, e in self.secrets]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookEvent:
    """An event as recorded once by ``send`` (its id is every delivery's ``webhook-id``)."""

    id: str
    event_type: str
    payload: bytes
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_type": self.event_type,
            "payload": self.payload.decode("utf-8", "replace"),
            "created_at": self.created_at,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class WebhookDelivery:
    """One event to one endpoint: an outbox job (``id`` is the job id) and its state.

    ``state`` is the job's: PENDING / IN_FLIGHT (being delivered), SUCCEEDED, REJECTED (a
    4xx: not retried), UNKNOWN (schedule exhausted) — the last two are the dead-letter queue
    — or CANCELLED (parked because the endpoint is disabled; replayable).
    """

    id: str
    event_id: str
    event_type: str
    endpoint_id: str
    url: str
    state: JobState
    attempts: int
    sends: int
    last_status: int | None
    last_outcome: str | None
    last_error: str | None
    due_at: float
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_id": self.event_id,
            "event_type": self.event_type,
            "endpoint_id": self.endpoint_id,
            "url": self.url,
            "state": self.state.value,
            "attempts": self.attempts,
            "sends": self.sends,
            "last_status": self.last_status,
            "last_outcome": self.last_outcome,
            "last_error": self.last_error,
            "due_at": self.due_at,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@runtime_checkable
class WebhookStore(Protocol):
    """Durable storage for webhook endpoints, events and deliveries (SPEC §6), next to the
    outbox it delivers through. It holds no policy: who is disabled when, which endpoints
    match an event and what is replayed are decided by :mod:`retrysafe.webhooks`.

    Contract (across threads and processes sharing the store):

    * ``insert_event`` is one transaction: the event, its outbox jobs and its delivery rows
      are all written, parked ones CANCELLED, or nothing is. A second insert with the same
      event id writes nothing and returns ``(False, existing)``.
    * ``set_endpoint_enabled(enabled=False)`` disables the endpoint and parks its PENDING
      deliveries (CANCELLED) in one transaction; ``update_endpoint`` with a new URL points
      the deliveries not yet succeeded at it in the same transaction.
    * ``delete_endpoint`` deletes the endpoint, its deliveries and their jobs (in-flight jobs
      included: the worker's fenced writes then change nothing) in one transaction.
    * ``record_endpoint_failure`` increments the failure run atomically.
    * ``asyncio_webhook_store`` gives the async face the worker's per-attempt hooks use (never
      the sync methods on the event loop).
    """

    @property
    def url(self) -> str:
        """The store's URL, without a password (for messages)."""
        ...

    def insert_endpoint(self, endpoint: WebhookEndpoint) -> WebhookEndpoint: ...

    def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint | None: ...

    def list_endpoints(self) -> list[WebhookEndpoint]: ...

    def update_endpoint(
        self, endpoint: WebhookEndpoint, *, now: float, retarget: bool
    ) -> WebhookEndpoint | None:
        """Write ``endpoint``'s url, secrets, event types, description and schedule; with
        ``retarget`` also move its unfinished deliveries to the new URL."""
        ...

    def set_endpoint_enabled(
        self,
        endpoint_id: str,
        *,
        enabled: bool,
        reason: str | None,
        now: float,
        only_if_enabled: bool = False,
    ) -> WebhookEndpoint | None:
        """Enable or disable the endpoint (disabling parks its PENDING deliveries); the
        endpoint, or None when it does not exist or, with ``only_if_enabled``, was already
        disabled (an automatic disabling happens once, however many attempts ask for it)."""
        ...

    def record_endpoint_failure(
        self, endpoint_id: str, *, now: float
    ) -> tuple[int, float | None, bool] | None:
        """Add one failed attempt to the run; ``(failures, first_failure_at, enabled)``."""
        ...

    def reset_endpoint_failures(self, endpoint_id: str) -> None: ...

    def delete_endpoint(self, endpoint_id: str) -> bool: ...

    def insert_event(
        self,
        event: WebhookEvent,
        deliveries: Sequence[tuple[NewJob, str, bool]],
        *,
        now: float,
    ) -> tuple[bool, WebhookEvent]:
        """Record ``event`` and one ``(job, endpoint_id, parked)`` delivery each."""
        ...

    def get_event(self, event_id: str) -> WebhookEvent | None: ...

    def delivery_context(self, job_id: str) -> tuple[str, WebhookEndpoint] | None:
        """``(event_id, endpoint)`` of the delivery that is job ``job_id``."""
        ...

    def list_deliveries(
        self,
        *,
        event_id: str | None = None,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        states: Sequence[JobState] | None = None,
        ids: Sequence[str] | None = None,
        limit: int = 100,
    ) -> list[WebhookDelivery]: ...

    def delivery_ids_with_prefix(self, prefix: str) -> list[str]: ...

    def purge_deliveries(
        self,
        *,
        states: Sequence[JobState],
        before: float,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        batch: int = 1000,
    ) -> int: ...

    def asyncio_webhook_store(self) -> AsyncWebhookStore:
        """A new async face of the same tables (its own connection or pool); close it with
        ``aclose()``."""
        ...


@runtime_checkable
class AsyncWebhookStore(Protocol):
    """The async face of :class:`WebhookStore`: what the webhook worker reads and writes per
    attempt, without blocking the event loop. Same contract as the sync methods."""

    async def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint | None: ...

    async def delivery_context(self, job_id: str) -> tuple[str, WebhookEndpoint] | None: ...

    async def set_endpoint_enabled(
        self,
        endpoint_id: str,
        *,
        enabled: bool,
        reason: str | None,
        now: float,
        only_if_enabled: bool = False,
    ) -> WebhookEndpoint | None: ...

    async def record_endpoint_failure(
        self, endpoint_id: str, *, now: float
    ) -> tuple[int, float | None, bool] | None: ...

    async def reset_endpoint_failures(self, endpoint_id: str) -> None: ...

    async def aclose(self) -> None: ...
