"""The store seam: the few atomic primitives every store offers, and their contract.

Stores are dumb (STYLE §2): they run atomic statements and hold no policy. TTLs, fingerprints,
what to store and when to take over are decided by :mod:`retrysafe.core` and passed in as
plain values. One contract test suite (``tests/stores``) runs against every implementation.

Times are Unix seconds (float). ``lease`` and ``retention`` are durations in seconds.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from retrysafe.core import KeyRecord, StoredResponse

__all__ = [
    "AgentCall",
    "AgentCallState",
    "AgentRunRecord",
    "AgentStore",
    "AsyncKeyStore",
    "AsyncOutboxStore",
    "Attempt",
    "Job",
    "JobState",
    "KeyStore",
    "NewJob",
    "OutboxStore",
    "WebhookDelivery",
    "WebhookEndpoint",
    "WebhookEvent",
    "WebhookStore",
]


@runtime_checkable
class KeyStore(Protocol):
    """Idempotency-key storage for the middleware (SPEC §3, §4, §9).

    Concurrency contract (every implementation keeps it, across threads and processes that
    share the store):

    * ``claim`` is one atomic step: it inserts the key if absent or if its retention expired,
      else it returns the existing record untouched. Of N concurrent claims of one absent key
      exactly one returns ``claimed=True``.
    * ``take_over``, ``complete``, ``release`` and ``extend_lease`` are compare-and-swap on the
      fencing token: they change the record only while it is ``running`` under exactly that
      token, so an owner whose lease was taken over can never overwrite or delete the new
      owner's record.
    * Every fencing token of a key hash is larger than all earlier ones — also across
      ``release``: a released key reads as absent (``get`` returns None, ``claim`` takes it)
      but the store remembers its last token (a tombstone row; Redis: a per-key counter), so
      the next claim's token is larger and an owner fenced out before the release still
      matches nothing. Otherwise a take-over, a release and a new claim could hand the first
      owner's token 1 out again, and that owner's late ``complete`` would overwrite the new
      owner's record.
    * Residual caveat: ``purge_keys`` deletes records and tombstones once their retention
      ended, and with them the key's token history (Redis: the counter's TTL). An owner
      still running past the retention window could then match a fresh claim's token; keep
      retention far longer than any handler runs (it is hours, leases are seconds).

    Errors: :class:`~retrysafe.StoreUnavailableError` when the store cannot serve now (callers
    answer 503), :class:`~retrysafe.StoreError` for anything else; driver errors are chained.
    """

    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        """Insert a running record (lease until ``now + lease``, retained until ``now +
        retention``) if absent or expired; return ``(True, new)`` or ``(False, existing)``."""
        ...

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        """Give a running record whose lease expired a new token and lease; None if the
        record changed meanwhile (someone else took over, it completed, or was released)."""
        ...

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        """Store the response and mark completed, retained until ``now + retention``.
        False when the token no longer owns the running record (nothing is written)."""
        ...

    def release(self, key_hash: str, fencing_token: int) -> bool:
        """Release the running record so the next attempt runs again: it reads as absent from
        then on, while its fencing token stays remembered (see above). False when not owner."""
        ...

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        """Move the owner's lease to ``now + lease``. False when not owner."""
        ...

    def get(self, key_hash: str) -> KeyRecord | None:
        """The record as stored (expired or not), or None."""
        ...

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        """Delete records (released ones included) whose retention ended at or before ``now``,
        at most ``batch`` per statement, until none remain; return how many were deleted."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


@runtime_checkable
class AsyncKeyStore(Protocol):
    """The async face of :class:`KeyStore`: the same methods and contract, awaitable."""

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]: ...

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None: ...

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool: ...

    async def release(self, key_hash: str, fencing_token: int) -> bool: ...

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool: ...

    async def get(self, key_hash: str) -> KeyRecord | None: ...


# ---------------------------------------------------------------------- outbox (SPEC §5)
class JobState(str, enum.Enum):
    """Where an outbox job stands (SPEC §5)."""

    PENDING = "pending"
    """Waiting until ``due_at`` for its next attempt (first, retry, poll or deferred)."""
    IN_FLIGHT = "in_flight"
    """Leased to a worker until ``lease_expires_at``; claimable again once that passes."""
    SUCCEEDED = "succeeded"
    """A 2xx answer (replayed or not): the effect committed."""
    REJECTED = "rejected"
    """A 4xx that says the request must be fixed (or a 422 key-reused): stopped."""
    UNKNOWN = "unknown"
    """Attempts or deadline ran out without a definitive answer: parked in the DLQ for
    ``reconcile``. Not a failure — the effect may have committed."""
    CANCELLED = "cancelled"
    """Cancelled by an operator before it succeeded; never sent again."""

    @property
    def is_terminal(self) -> bool:
        """True when no worker will pick the job up again by itself (UNKNOWN included)."""
        return self not in (JobState.PENDING, JobState.IN_FLIGHT)


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    """A validated job, ready to insert (built by :meth:`retrysafe.Outbox.submit`).

    Attributes:
        id: the job id (32 lower-case hex digits).
        key: the idempotency key, minted before the first attempt and never regenerated.
        method, url, destination: the request; ``destination`` is ``scheme://host:port``.
        headers: request headers as ``(name, value)`` pairs, without ``Idempotency-Key``.
        body: the request body bytes.
        deadline_at: Unix seconds after which no new attempt starts, or None.
        queue: the queue whose workers deliver it (``"default"``: the outbox;
            ``"webhooks"``: webhook deliveries).
    """

    id: str
    key: str
    method: str
    url: str
    destination: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    deadline_at: float | None
    queue: str = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """An outbox job as stored. Times are Unix seconds.

    Attributes:
        id, key, state, method, url, destination, headers, body: as submitted / current state.
        queue: the queue it belongs to; workers claim only their own queue's jobs.
        created_at, updated_at: when the job was created / last changed.
        due_at: when it is next claimable (PENDING).
        deadline_at: no attempt starts after it (None: no deadline).
        attempts: counted attempts (409 polls and cancelled attempts do not count).
        sends: attempts recorded, counted or not (the last attempt's number).
        polls: 409 request-in-progress polls recorded (they have their own limit).
        last_delay: the last backoff delay in seconds (decorrelated jitter's ``previous``).
        lease_token, lease_expires_at: the current lease while IN_FLIGHT.
        finished_at: when it reached a terminal state.
        last_status, last_outcome, last_error: what the last attempt saw.
    """

    id: str
    key: str
    state: JobState
    method: str
    url: str
    destination: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    created_at: float
    updated_at: float
    due_at: float
    deadline_at: float | None
    attempts: int
    sends: int
    polls: int
    last_delay: float
    lease_token: str | None
    lease_expires_at: float | None
    finished_at: float | None
    last_status: int | None
    last_outcome: str | None
    last_error: str | None
    queue: str = "default"

    def to_dict(self, *, body: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (the body, as text, only when ``body`` is True)."""
        out: dict[str, Any] = {
            "id": self.id,
            "key": self.key,
            "queue": self.queue,
            "state": self.state.value,
            "method": self.method,
            "url": self.url,
            "destination": self.destination,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "due_at": self.due_at,
            "deadline_at": self.deadline_at,
            "attempts": self.attempts,
            "sends": self.sends,
            "polls": self.polls,
            "finished_at": self.finished_at,
            "last_status": self.last_status,
            "last_outcome": self.last_outcome,
            "last_error": self.last_error,
        }
        if body:
            out["headers"] = [list(p) for p in self.headers]
            out["body"] = self.body.decode("utf-8", "replace")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """One recorded attempt (SPEC §5, last bullets).

    Attributes:
        job_id, key: the job and the idempotency key the attempt carried.
        number: 1, 2, … per job, counting every recorded attempt.
        started_at: Unix seconds; duration: seconds.
        outcome: an :class:`~retrysafe.core.AttemptOutcome` value.
        status: the HTTP status, or None when no complete answer arrived.
        error_type: the transport error's class name (``"ReadTimeout"``), or None.
        replayed: the answer carried ``Idempotent-Replayed: true``.
        counted: whether it counted against ``attempts`` (409 polls do not).
    """

    job_id: str
    key: str
    number: int
    started_at: float
    duration: float
    outcome: str
    status: int | None
    error_type: str | None
    replayed: bool
    counted: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "job_id": self.job_id,
            "key": self.key,
            "number": self.number,
            "started_at": self.started_at,
            "duration": self.duration,
            "outcome": self.outcome,
            "status": self.status,
            "error_type": self.error_type,
            "replayed": self.replayed,
            "counted": self.counted,
        }


@runtime_checkable
class OutboxStore(Protocol):
    """Durable storage for outbox jobs and their attempts (SPEC §5, §9).

    The store holds no policy: the worker decides states, due times and deadlines and passes
    them in. Concurrency contract (across threads and processes sharing the store):

    * ``insert_job`` creates the job and its key in one write; a second insert with the same
      key inserts nothing and returns the existing job. With ``connection`` it runs inside the
      caller's open transaction (transactional outbox) and commits or rolls back with it.
    * ``claim_jobs`` atomically leases up to ``limit`` jobs of one ``queue`` that are PENDING
      and due, or IN_FLIGHT under an expired lease (the owner crashed), to a new ``token``. A
      job is leased to one claimant at a time, and only to a claimant of its own queue.
    * Every method that selects jobs by state (claims, lists, counts, ``next_due``, purges)
      sees only the given ``queue``; methods taking a job id see the job whatever its queue.
    * ``finish_attempt``, ``release_job`` and ``extend_job_lease`` are fenced by the lease
      token: they change the job only while it is IN_FLIGHT under exactly that token, so a
      worker whose lease expired and was taken over writes nothing. ``finish_attempt`` records
      the attempt in the same transaction.
    * ``extend_job_lease`` is the owner's heartbeat: a live worker renews the lease of every
      job it is sending, so the lease only bounds how long a dead worker blocks its jobs.
    """

    @property
    def url(self) -> str:
        """The store's URL (``sqlite:///path.db``)."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...

    def insert_job(self, job: NewJob, *, now: float, connection: Any = None) -> tuple[bool, Job]:
        """Insert ``job`` as PENDING, due ``now``; ``(True, job)`` or ``(False, existing)``
        when a job with the same key exists."""
        ...

    def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]:
        """Lease up to ``limit`` claimable jobs of ``queue`` until ``now + lease`` (earliest
        due first)."""
        ...

    def claim_unknown_jobs(
        self,
        *,
        queue: str,
        token: str,
        now: float,
        lease: float,
        limit: int,
        ids: Sequence[str] | None,
    ) -> list[Job]:
        """Lease UNKNOWN jobs of ``queue`` (all, or those in ``ids``) for reconciliation."""
        ...

    def finish_attempt(
        self,
        job_id: str,
        token: str,
        attempt: Attempt,
        *,
        state: JobState,
        due_at: float,
        last_delay: float,
        error: str | None,
        now: float,
    ) -> Attempt | None:
        """Record ``attempt`` (its ``number`` is assigned here) and move the job to
        ``state``; None when the token no longer owns the job (nothing is written)."""
        ...

    def release_job(
        self,
        job_id: str,
        token: str,
        *,
        state: JobState,
        due_at: float,
        error: str | None,
        now: float,
    ) -> bool:
        """End a lease without recording an attempt. False when not the owner."""
        ...

    def extend_job_lease(self, job_id: str, token: str, *, now: float, lease: float) -> bool:
        """Move the job's lease end to ``now + lease`` (seconds; a PostgreSQL store on the
        server clock measures from its own now) while it is IN_FLIGHT under exactly
        ``token``. True renewed; False otherwise, nothing written (taken over, finished,
        released, deleted). An expired lease nobody claimed yet is still the token's."""
        ...

    def transition_job(
        self,
        job_id: str,
        *,
        from_states: Sequence[JobState],
        state: JobState,
        now: float,
        reset: bool = False,
        deadline_at: float | None = None,
    ) -> Job | None:
        """Move a job in one of ``from_states`` to ``state`` (due ``now``); with ``reset``
        its attempt count restarts and ``deadline_at`` replaces the deadline. None when the
        job is in another state."""
        ...

    def get_job(self, job_id: str) -> Job | None: ...

    def resolve_job_id(self, prefix: str, *, queue: str) -> str | None:
        """The one job id of ``queue`` starting with ``prefix``; None when none or several
        match."""
        ...

    def list_jobs(
        self, *, queue: str, states: Sequence[JobState] | None, limit: int
    ) -> list[Job]: ...

    def list_attempts(self, job_id: str) -> list[Attempt]: ...

    def count_jobs(self, *, queue: str) -> dict[JobState, int]: ...

    def next_due(self, *, queue: str) -> float | None:
        """The earliest time a job of ``queue`` becomes claimable, or None when none will."""
        ...

    def purge_jobs(
        self, *, queue: str, states: Sequence[JobState], before: float, batch: int = 1000
    ) -> int:
        """Delete jobs of ``queue`` (and their attempts) in ``states`` last changed at or
        before ``before``; return how many."""
        ...


@runtime_checkable
class AsyncOutboxStore(Protocol):
    """The async face of :class:`OutboxStore` used by the worker's hot path."""

    async def insert_job(self, job: NewJob, *, now: float) -> tuple[bool, Job]: ...

    async def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]: ...

    async def claim_unknown_jobs(
        self,
        *,
        queue: str,
        token: str,
        now: float,
        lease: float,
        limit: int,
        ids: Sequence[str] | None,
    ) -> list[Job]: ...

    async def finish_attempt(
        self,
        job_id: str,
        token: str,
        attempt: Attempt,
        *,
        state: JobState,
        due_at: float,
        last_delay: float,
        error: str | None,
        now: float,
    ) -> Attempt | None: ...

    async def release_job(
        self,
        job_id: str,
        token: str,
        *,
        state: JobState,
        due_at: float,
        error: str | None,
        now: float,
    ) -> bool: ...

    async def extend_job_lease(
        self, job_id: str, token: str, *, now: float, lease: float
    ) -> bool: ...

    async def count_jobs(self, *, queue: str) -> dict[JobState, int]: ...

    async def next_due(self, *, queue: str) -> float | None: ...


# ---------------------------------------------------------------------- webhooks (SPEC §6)
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
    """

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
        self, endpoint_id: str, *, enabled: bool, reason: str | None, now: float
    ) -> WebhookEndpoint | None: ...

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


# ---------------------------------------------------------------------- agent tool calls (§7)
class AgentCallState(str, enum.Enum):
    """State of one logical agent tool call (SPEC §7).

    ``RUNNING``: claimed, attempts may be in flight. ``SUCCEEDED``: the result is stored and
    replayed to every repeat. ``FAILED``: a definitive error, re-raised to every repeat.
    ``UNKNOWN``: the effect may or may not have happened (attempts exhausted on transport
    errors, or the process running it stopped); repeats report it with the key. ``REFUSED``: a
    budget stopped the call before any attempt.
    """

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRunRecord:
    """One agent run as stored.

    Attributes:
        id: the run id (caller-given or generated).
        state: ``"active"`` or ``"stopped"`` (a budget refused a call; ``reason`` says which).
        max_steps: logical calls allowed in the run (None: unlimited).
        max_attempts: attempts allowed per logical call, over every process (None: unlimited).
        calls: logical calls recorded (refusals excluded); ``unknown``: those in ``UNKNOWN``.
    """

    id: str
    state: str
    max_steps: int | None
    max_attempts: int | None
    reason: str | None
    created_at: float
    updated_at: float
    calls: int = 0
    unknown: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentCall:
    """One logical tool call: a row of the audit log.

    Attributes:
        key: the call's idempotency key (derived from run, tool, step and arguments).
        arguments_json: canonical JSON text of the bound arguments; ``arguments_hash`` its
            SHA-256. :attr:`arguments` is the decoded value.
        signature: hash of the tool's parameters when the call was first recorded.
        result_json: the result as JSON text (None until SUCCEEDED, or when not
            JSON-serialisable). :attr:`result` is the decoded value.
        result_summary: a short human-readable summary (≤ 200 characters).
        fencing_token: proves which claimant may finish the call; ``owner`` names it.
    """

    key: str
    run_id: str
    step: int
    tool: str
    kind: str
    signature: str
    arguments_hash: str
    arguments_json: str
    state: AgentCallState
    attempts: int = 0
    fencing_token: int = 1
    owner: str = ""
    lease_expires_at: float = 0.0
    result_json: str | None = None
    result_summary: str | None = None
    error: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The bound arguments as JSON values (``{parameter: value}``; tuples are lists)."""
        value: dict[str, Any] = json.loads(self.arguments_json)
        return value

    @property
    def result(self) -> Any:
        """The stored result as JSON values (a tuple comes back as a list); None when there
        is none (not SUCCEEDED, or not JSON-serialisable: see ``result_summary``)."""
        return None if self.result_json is None else json.loads(self.result_json)


@runtime_checkable
class AgentStore(Protocol):
    """Agent runs and their calls (SPEC §7). Every method is one atomic store operation."""

    def create_agent_run(
        self, run_id: str, *, max_steps: int | None, max_attempts: int | None, now: float
    ) -> tuple[bool, AgentRunRecord]:
        """Insert the run if absent. Returns ``(created, record)`` (the existing one if not)."""
        ...

    def get_agent_run(self, run_id: str) -> AgentRunRecord | None: ...

    def list_agent_runs(self, *, limit: int = 100) -> list[AgentRunRecord]:
        """Newest first, with call counts."""
        ...

    def stop_agent_run(self, run_id: str, *, reason: str, now: float) -> None: ...

    def claim_agent_call(
        self, call: AgentCall, *, max_steps: int | None, now: float
    ) -> tuple[str, AgentCall]:
        """Insert ``call`` if its key is absent, in one transaction.

        Returns ``("existing", row)`` when the key is recorded already; ``("conflict", row)``
        when the run recorded this tool under another signature (``row`` is such a call);
        ``("refused", row)`` when the run already has ``max_steps`` logical calls: the refusal
        is recorded as a ``REFUSED`` row and the run is stopped; else ``("claimed", call)``.
        """
        ...

    def take_over_agent_call(
        self,
        key: str,
        fencing_token: int,
        *,
        owner: str,
        lease_expires_at: float,
        now: float,
        allow_unknown: bool,
    ) -> int | None:
        """Compare-and-swap a RUNNING call with an expired lease (or, if allowed, an UNKNOWN
        one) back to RUNNING under ``owner``. Returns the new fencing token, or None."""
        ...

    def start_agent_attempt(
        self, key: str, fencing_token: int, *, lease_expires_at: float, now: float
    ) -> int | None:
        """Count one attempt (fenced). Returns the call's attempts, or None if not the owner."""
        ...

    def extend_agent_call_lease(
        self, key: str, fencing_token: int, *, lease_expires_at: float
    ) -> bool:
        """The live claimant's heartbeat: move a RUNNING call's lease end forward to
        ``lease_expires_at`` (Unix seconds on the agent layer's clock; never backward) while it
        runs under exactly ``fencing_token``. True renewed; False otherwise, nothing written
        (taken over, finished, interrupted). An expired lease nobody took over yet is still
        the token's."""
        ...

    def finish_agent_call(
        self,
        key: str,
        fencing_token: int,
        *,
        state: AgentCallState,
        result: str | None,
        result_summary: str | None,
        error: str | None,
        now: float,
    ) -> bool:
        """Move a RUNNING call to ``state`` (fenced). False if the token is no longer valid."""
        ...

    def interrupt_agent_calls(self, run_id: str, *, now: float) -> int:
        """Move the run's RUNNING calls to UNKNOWN (its process stopped). Returns how many."""
        ...

    def get_agent_call(self, key: str) -> AgentCall | None: ...

    def list_agent_calls(self, run_id: str) -> list[AgentCall]:
        """The run's calls in the order they were recorded."""
        ...
