"""The outbox's models and store seams (SPEC §5): jobs, attempts, and the
:class:`OutboxStore` Protocol (sync and async faces) every outbox store implements.

Times are Unix seconds (float); durations are seconds.
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AsyncOutboxStore",
    "Attempt",
    "Finish",
    "Job",
    "JobState",
    "NewJob",
    "OutboxStore",
]


class JobState(str, enum.Enum):
    """Where an outbox job stands (SPEC §5). ``str()`` and f-strings give the value
    (``pending``), as JSON and the CLI show it."""

    def __str__(self) -> str:
        return str(self.value)

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
        due_at: when it is next claimable: its next attempt's time (PENDING) or its
            lease's end (IN_FLIGHT, equal to ``lease_expires_at``; jobs leased by an
            earlier release keep the due time they were claimed at).
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
        """A JSON-ready dict (the body, as text, only when ``body`` is True). A body that is
        no UTF-8 is ``body`` with U+FFFD for what cannot be read, and ``body_base64``, its
        exact bytes (a script could not get them back from the text)."""
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
            try:
                out["body"] = self.body.decode("utf-8")
            except UnicodeDecodeError:
                out["body"] = self.body.decode("utf-8", "replace")
                out["body_base64"] = base64.b64encode(self.body).decode("ascii")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """One attempt's outcome, to record with :meth:`OutboxStore.finish_attempts`.

    Attributes:
        job_id, token: the job and the lease token that must still own it.
        attempt: the attempt (its ``number`` is assigned by the store).
        state, due_at: the job's next state and when it is next due (Unix seconds).
        last_delay: the backoff delay that led to ``due_at`` (seconds).
        error: the error text to keep on the job, or None.
        now: when the attempt ended (Unix seconds, the worker's clock).
    """

    job_id: str
    token: str
    attempt: Attempt
    state: JobState
    due_at: float
    last_delay: float
    error: str | None
    now: float


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
      the attempt in the same transaction; ``finish_attempts`` does so for a batch, in one
      transaction, each finish fenced on its own.
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
        when a job with the same key exists.

        Raises:
            ConfigurationError: ``connection`` is not the connection of an open
                ``store.transaction()`` of this store.
        """
        ...

    def claim_jobs(
        self,
        *,
        queue: str,
        token: str,
        now: float,
        lease: float,
        limit: int,
        skip_destinations: Sequence[str] = (),
        only_destination: str | None = None,
    ) -> list[Job]:
        """Lease up to ``limit`` claimable jobs of ``queue`` until ``now + lease`` (earliest
        due first), none of whose destination is in ``skip_destinations``, and all of
        ``only_destination`` when it is given (the worker passes them only while a
        destination is limited: a store of an earlier release need not know them)."""
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

    def finish_attempts(self, finishes: Sequence[Finish]) -> list[Attempt | None]:
        """Record a batch of finishes in one transaction: for each, in order, the recorded
        attempt or None when its token no longer owns its job (that one writes nothing)."""
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

    def get_job(self, job_id: str) -> Job | None:
        """The job with id ``job_id``, whatever its queue, or None."""
        ...

    def job_ids_with_prefix(self, prefix: str, *, queue: str) -> list[str]:
        """Up to two job ids of ``queue`` starting with ``prefix`` (compared literally, no
        wildcards), in id order: none, the one, or two of an ambiguous prefix. An empty
        prefix names no job. (Which text is a job id prefix is the caller's rule:
        :func:`retrysafe.client._jobs.job_id_prefix`.)"""
        ...

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
        self,
        *,
        queue: str,
        states: Sequence[JobState],
        before: float,
        batch: int = 1000,
        ids: Sequence[str] | None = None,
    ) -> int:
        """Delete jobs of ``queue`` (and their attempts) in ``states`` last changed at or
        before ``before`` (only those of ``ids``, when given), ``batch`` (>= 1) at a time;
        return how many."""
        ...

    def asyncio_outbox_store(self) -> AsyncOutboxStore:
        """A new async face on the same store, for an event loop (the worker, reconcile,
        :class:`~retrysafe.AsyncOutbox`): its own connection or pool, closed with
        ``aclose()``."""
        ...


@runtime_checkable
class AsyncOutboxStore(Protocol):
    """The async face of :class:`OutboxStore` used by the worker's hot path: the same
    operations and contract, awaitable, never blocking the event loop."""

    async def insert_job(self, job: NewJob, *, now: float) -> tuple[bool, Job]: ...

    async def claim_jobs(
        self,
        *,
        queue: str,
        token: str,
        now: float,
        lease: float,
        limit: int,
        skip_destinations: Sequence[str] = (),
        only_destination: str | None = None,
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

    async def finish_attempts(self, finishes: Sequence[Finish]) -> list[Attempt | None]: ...

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

    async def get_job(self, job_id: str) -> Job | None: ...

    async def count_jobs(self, *, queue: str) -> dict[JobState, int]: ...

    async def next_due(self, *, queue: str) -> float | None: ...

    async def aclose(self) -> None:
        """Close this face's connection or pool. Idempotent."""
        ...
