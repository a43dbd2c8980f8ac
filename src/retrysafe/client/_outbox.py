"""The durable outbox: submit jobs, inspect them, cancel, retry, purge (SPEC §5).

``Outbox.submit`` validates the request, mints the job's idempotency key and inserts both in
one write. Pass ``connection=`` (from ``store.transaction()``) to commit the job together with
the application's own rows: the transactional outbox.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from retrysafe._exceptions import (
    JobError,
    JobNotFoundError,
    PayloadError,
    StoreUnavailableError,
    SubmitOutcomeUnknownError,
)
from retrysafe.client._jobs import (
    _MISSING,
    DEFAULT_QUEUE,
    build_job,
    check_queue,
    job_id_prefix,
    notify_submitted,
)
from retrysafe.client._models import Attempt, Job, JobState, NewJob
from retrysafe.client._policy import RetryPolicy, count, policy_or_default, seconds
from retrysafe.client._store import StoreArg, open_outbox_store
from retrysafe.client._worker import ReconcileReport, Worker, areconcile
from retrysafe.observability._telemetry import Telemetry, telemetry_of
from retrysafe.stores._connector import before_user_write, may_have_written

__all__ = ["DEAD_LETTER_STATES", "AsyncOutbox", "Outbox"]

#: The states the dead-letter view shows: stopped without a definitive answer, or rejected.
DEAD_LETTER_STATES = (JobState.UNKNOWN, JobState.REJECTED)
_RETRYABLE = (JobState.UNKNOWN, JobState.REJECTED, JobState.CANCELLED)

#: The largest request body :meth:`Outbox.submit` records by default, in bytes (10 MiB). A
#: body is stored with its job, and a worker holds several copies of each body in flight: a
#: 50 MB body took a worker to 390 MB for one job, eight of them to 1.1 GB.
DEFAULT_MAX_BODY = 10 * 1024 * 1024
#: How the over-limit error says the limit is raised (the CLI names its option instead).
MAX_BODY_HINT = "Outbox(max_body=…) raises it"


class Outbox:
    """A durable outbox of side-effecting HTTP requests.

    Args:
        store: a :class:`~retrysafe.SQLiteStore`, a :class:`~retrysafe.stores.PostgresStore`,
            another :class:`~retrysafe.client.OutboxStore`, or a URL (default
            ``sqlite:///retrysafe.db``). The SQLite file's directory must exist.
        policy: the default :class:`RetryPolicy` (its ``deadline`` applies to jobs submitted
            without one; workers made by :meth:`worker` use it).
        clock: Unix-seconds clock.
        queue: the queue its jobs go to and the one it lists, counts, purges, retries,
            delivers (:meth:`worker`) and reconciles (default ``"default"``); 1–64 characters
            of ``a-z 0-9 _ . -``. Several queues can share one store: a worker never claims
            another queue's jobs (webhook deliveries live in the ``"webhooks"`` queue).
        telemetry: a :class:`~retrysafe.observability.Prometheus`, an
            :class:`~retrysafe.observability.OpenTelemetry` or a list of both. Each
            submission's trace context (OpenTelemetry: a span, child of the current one) is
            stored with the job as ``traceparent``, so every attempt of the job joins one
            trace; workers and reconciles made here report to it too.
        max_body: the largest request body :meth:`submit` records, in bytes (default
            :data:`DEFAULT_MAX_BODY`, 10 MiB); None: no limit.

    Raises:
        ConfigurationError: a malformed store URL, a missing directory, a store without an
            outbox, a bad queue name, a ``max_body`` that is no whole number >= 1 or None.
    """

    def __init__(
        self,
        store: StoreArg = "sqlite:///retrysafe.db",
        *,
        policy: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
        queue: str = DEFAULT_QUEUE,
        telemetry: Telemetry | Sequence[Telemetry] | None = None,
        max_body: int | None = DEFAULT_MAX_BODY,
    ) -> None:
        self.queue = check_queue(queue)
        self.max_body = None if max_body is None else count(max_body, "max_body")
        self.telemetry = telemetry_of(telemetry)
        self.policy = policy_or_default(policy, RetryPolicy)  # before a store is opened
        self.store, self._owns_store = open_outbox_store(store)
        self._clock = clock

    def __repr__(self) -> str:
        if self.queue == DEFAULT_QUEUE:
            return f"Outbox({self.store.url!r})"
        return f"Outbox({self.store.url!r}, queue={self.queue!r})"

    def submit(
        self,
        url: str,
        *,
        json: Any = _MISSING,
        content: bytes | str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        deadline: float | timedelta | datetime | None = None,
        connection: Any = None,
    ) -> Job:
        """Record one logical operation; a worker will deliver it.

        Args:
            url: an ``http://`` or ``https://`` URL.
            json: a JSON-serialisable payload (sent with ``Content-Type: application/json``).
            content: raw body bytes or text (instead of ``json``).
            method: the HTTP method (default POST).
            headers: extra request headers (not ``Idempotency-Key``: pass ``key``).
            key: your own idempotency key (1–255 visible ASCII characters); default a fresh
                UUIDv4. Submitting an existing key with the same request returns that job.
            deadline: seconds / timedelta from now, or an aware datetime, after which no
                attempt starts (default ``policy.deadline``).
            connection: the connection from ``store.transaction()`` (``sqlite3`` for SQLite,
                ``psycopg`` for PostgreSQL): the job commits or rolls back with your own rows
                (transactional outbox).

        Returns:
            The PENDING :class:`Job` with its ``id`` and ``key``.

        Raises:
            ConfigurationError: the URL is not http(s), bad method/headers/deadline.
            PayloadError: the payload cannot be serialised to JSON, or the body is longer
                than ``max_body`` bytes (nothing recorded).
            InvalidKeyError: a malformed ``key``.
            JobError: ``key`` is already used by a different request.
            SubmitOutcomeUnknownError: the store did not answer a write it may have
                committed (a server; without ``connection``): the job may be recorded;
                submit again with its ``key``.
            StoreError: the store failed otherwise (nothing was recorded; a SQLite file
                deleted while open included).
        """
        new, now = self._new_job(url, json, content, method, headers, key, deadline)
        if connection is None:  # (your transaction's connection opened the file anew)
            before_user_write(self.store)
        try:
            created, job = self.store.insert_job(new, now=now, connection=connection)
        except StoreUnavailableError as exc:
            # In the caller's transaction its commit decides: the store's own error.
            unknown = None if connection is not None else _unknown_job(self.store, exc, new)
            if unknown is None:
                raise
            raise unknown from exc
        return self._submitted(new, created, job)

    def _new_job(
        self,
        url: str,
        json: Any,
        content: bytes | str | None,
        method: str,
        headers: Mapping[str, str] | None,
        key: str | None,
        deadline: float | timedelta | datetime | None,
    ) -> tuple[NewJob, float]:
        """The validated job of a submission and the time it is submitted at."""
        now = self._clock()
        new = build_job(
            url,
            json=json,
            content=content,
            method=method,
            headers=headers,
            key=key,
            deadline=self.policy.deadline_s if deadline is None else deadline,
            now=now,
            queue=self.queue,
        )
        if self.max_body is not None and len(new.body) > self.max_body:
            raise PayloadError(
                f"body is {len(new.body):,} bytes, over the limit of {self.max_body:,} "
                f"({MAX_BODY_HINT}): nothing recorded"
            )
        if self.telemetry is not None:
            traced = self.telemetry.job_submitted(self.queue, new.method, new.url)
            if traced:
                names = {name.lower() for name, _ in traced}
                kept = tuple((k, v) for k, v in new.headers if k.lower() not in names)
                new = replace(new, headers=kept + tuple(traced))
        return new, now

    def _submitted(self, new: NewJob, created: bool, job: Job) -> Job:
        """The job a submission of ``new`` got (``created`` or found by its key); wakes this
        process's workers.

        Raises:
            JobError: the key's job is a different request.
        """
        if not created and (job.method, job.url, job.body) != (new.method, new.url, new.body):
            raise JobError(
                f"idempotency key {new.key!r} is already used by job {job.id} for a different "
                "request",
                job_id=job.id,
            )
        notify_submitted(self.store.url)
        return job

    # ------------------------------------------------------------------ inspection
    def resolve(self, job_id: str) -> str:
        """The full id of ``job_id`` or of the one job of this queue whose id starts with it.

        Raises:
            JobNotFoundError: no such job in this queue (the message names the queue of a job
                that is in another one), or the prefix is ambiguous (the message names
                candidates).
        """
        job = self.store.get_job(job_id)
        if job is not None:
            if job.queue == self.queue:
                return job_id
            raise JobNotFoundError(
                f"job {job_id} is in the {job.queue!r} queue, not {self.queue!r}",
                job_id=job_id,
            )
        prefix = job_id_prefix(job_id)
        found = [] if prefix is None else self.store.job_ids_with_prefix(prefix, queue=self.queue)
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise JobNotFoundError(
                f"job id prefix {job_id!r} is ambiguous: it matches {', '.join(found)} and "
                "maybe more; give more characters",
                job_id=job_id,
            )
        raise JobNotFoundError(f"no job {job_id!r} in {self.store.url}", job_id=job_id)

    def get(self, job_id: str) -> Job:
        """The job (full id or unique prefix). Raises :class:`JobNotFoundError`."""
        job = self.store.get_job(self.resolve(job_id))
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} in {self.store.url}", job_id=job_id)
        return job

    def attempts(self, job_id: str) -> list[Attempt]:
        """Every recorded attempt of the job, in order."""
        return self.store.list_attempts(self.resolve(job_id))

    def jobs(
        self, *, states: Sequence[JobState | str] | None = None, limit: int = 100
    ) -> list[Job]:
        """Jobs, oldest first, optionally only in ``states``; at most ``limit`` (>= 1).

        Raises:
            ConfigurationError: ``limit`` < 1.
        """
        wanted = None if states is None else [JobState(s) for s in states]
        return self.store.list_jobs(queue=self.queue, states=wanted, limit=count(limit, "limit"))

    def dead_letters(self, *, limit: int = 100) -> list[Job]:
        """The dead-letter view: UNKNOWN and REJECTED jobs (see :meth:`attempts` for each);
        at most ``limit`` (>= 1, else :class:`ConfigurationError`)."""
        return self.store.list_jobs(
            queue=self.queue, states=DEAD_LETTER_STATES, limit=count(limit, "limit")
        )

    def counts(self) -> dict[JobState, int]:
        """How many jobs of this queue are in each state."""
        return self.store.count_jobs(queue=self.queue)

    # ------------------------------------------------------------------ changes
    def cancel(self, job_id: str) -> Job:
        """Cancel a PENDING job (it is never sent again).

        Raises:
            JobNotFoundError: no such job.
            JobError: the job is IN_FLIGHT (its attempt may commit; cancel after it ends)
                or already terminal.
        """
        full = self.resolve(job_id)
        job = self.store.transition_job(
            full, from_states=[JobState.PENDING], state=JobState.CANCELLED, now=self._clock()
        )
        if job is None:
            current = self.get(full)
            raise JobError(
                f"job {full} is {current.state.value}; only pending jobs can be cancelled",
                job_id=full,
            )
        return job

    def retry(self, job_id: str, *, deadline: float | timedelta | None = None) -> Job:
        """Send an UNKNOWN, REJECTED or CANCELLED job again, with the **same key** and a fresh
        attempt budget (the attempt history stays).

        Raises:
            JobNotFoundError: no such job.
            JobError: the job is PENDING, IN_FLIGHT or SUCCEEDED.
        """
        full = self.resolve(job_id)
        now = self._clock()
        if deadline is None:
            deadline = self.policy.deadline_s
        deadline_at = None
        if deadline is not None:
            d = deadline.total_seconds() if isinstance(deadline, timedelta) else float(deadline)
            deadline_at = now + d
        job = self.store.transition_job(
            full,
            from_states=_RETRYABLE,
            state=JobState.PENDING,
            now=now,
            reset=True,
            deadline_at=deadline_at,
        )
        if job is None:
            current = self.get(full)
            raise JobError(
                f"job {full} is {current.state.value}; only unknown, rejected or cancelled "
                "jobs can be retried",
                job_id=full,
            )
        notify_submitted(self.store.url)
        return job

    def purge(
        self,
        *,
        states: Sequence[JobState | str] = DEAD_LETTER_STATES,
        older_than: float | timedelta = 0.0,
        ids: Sequence[str] | None = None,
    ) -> int:
        """Delete jobs (and their attempts) in ``states`` unchanged for ``older_than``
        seconds; return how many. Refuses PENDING and IN_FLIGHT (that would lose work).

        Args:
            ids: only these jobs (full ids of this queue); a job that is gone, of another
                queue or in another state is left alone (a second purge of the same ids
                deletes nothing).

        Raises:
            JobError: ``states`` includes PENDING or IN_FLIGHT.
            ConfigurationError: ``older_than`` is negative or not a number.
        """
        wanted = [JobState(s) for s in states]
        if any(not s.is_terminal for s in wanted):
            raise JobError("refusing to purge pending or in-flight jobs")
        age = seconds(older_than, "older_than", allow_zero=True)
        chosen = None if ids is None else [str(i) for i in ids]
        return self.store.purge_jobs(
            queue=self.queue, states=wanted, before=self._clock() - age, ids=chosen
        )

    # ------------------------------------------------------------------ delivery
    def worker(self, **options: Any) -> Worker:
        """A :class:`Worker` on this outbox's store, policy and queue (``options`` as for
        Worker)."""
        options.setdefault("policy", self.policy)
        options.setdefault("clock", self._clock)
        options.setdefault("queue", self.queue)
        options.setdefault("telemetry", self.telemetry)
        return Worker(self.store, **options)

    def reconcile(self, **options: Any) -> ReconcileReport:
        """Re-send this queue's UNKNOWN jobs with their same key (see
        :func:`retrysafe.client.reconcile`)."""
        options.setdefault("policy", self.policy)
        options.setdefault("queue", self.queue)
        options.setdefault("telemetry", self.telemetry)
        return asyncio.run(areconcile(self.store, **options))

    def close(self) -> None:
        """Close the store if this outbox opened it from a URL. Idempotent."""
        if self._owns_store:
            self.store.close()
            self._owns_store = False

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOutbox:
    """The async face of :class:`Outbox`: the same methods, awaitable; close with
    :meth:`aclose`. ``submit`` runs on the store's async face (SQLite: on the event loop, an
    uncontended insert takes microseconds, in a thread only when another process holds the
    write lock; PostgreSQL: an async pool); the other methods run :class:`Outbox`'s in a
    thread."""

    def __init__(
        self,
        store: StoreArg = "sqlite:///retrysafe.db",
        *,
        policy: RetryPolicy | None = None,
        clock: Callable[[], float] = time.time,
        queue: str = DEFAULT_QUEUE,
        telemetry: Telemetry | Sequence[Telemetry] | None = None,
        max_body: int | None = DEFAULT_MAX_BODY,
    ) -> None:
        self._sync = Outbox(
            store, policy=policy, clock=clock, queue=queue, telemetry=telemetry, max_body=max_body
        )
        self.store = self._sync.store
        self.policy = self._sync.policy
        self.queue = self._sync.queue
        self._astore = self.store.asyncio_outbox_store()

    def __repr__(self) -> str:
        return "Async" + repr(self._sync)

    async def submit(
        self,
        url: str,
        *,
        json: Any = _MISSING,
        content: bytes | str | None = None,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        deadline: float | timedelta | datetime | None = None,
    ) -> Job:
        """See :meth:`Outbox.submit` (without ``connection``)."""
        new, now = self._sync._new_job(url, json, content, method, headers, key, deadline)
        before_user_write(self._sync.store)
        try:
            created, job = await self._astore.insert_job(new, now=now)
        except StoreUnavailableError as exc:
            unknown = _unknown_job(self._sync.store, exc, new)
            if unknown is None:
                raise
            raise unknown from exc
        return self._sync._submitted(new, created, job)

    async def get(self, job_id: str) -> Job:
        return await asyncio.to_thread(self._sync.get, job_id)

    async def attempts(self, job_id: str) -> list[Attempt]:
        return await asyncio.to_thread(self._sync.attempts, job_id)

    async def jobs(
        self, *, states: Sequence[JobState | str] | None = None, limit: int = 100
    ) -> list[Job]:
        return await asyncio.to_thread(lambda: self._sync.jobs(states=states, limit=limit))

    async def counts(self) -> dict[JobState, int]:
        return await asyncio.to_thread(self._sync.counts)

    async def cancel(self, job_id: str) -> Job:
        return await asyncio.to_thread(self._sync.cancel, job_id)

    async def retry(self, job_id: str, *, deadline: float | timedelta | None = None) -> Job:
        return await asyncio.to_thread(lambda: self._sync.retry(job_id, deadline=deadline))

    def worker(self, **options: Any) -> Worker:
        """A :class:`Worker` on this outbox's store; run it with ``await worker.serve()``."""
        return self._sync.worker(**options)

    async def reconcile(self, **options: Any) -> ReconcileReport:
        options.setdefault("policy", self.policy)
        options.setdefault("queue", self.queue)
        options.setdefault("telemetry", self._sync.telemetry)
        return await areconcile(self.store, **options)

    async def aclose(self) -> None:
        """Close the async face, and the store if this outbox opened it from a URL.
        Idempotent."""
        await self._astore.aclose()
        await asyncio.to_thread(self._sync.close)

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _unknown_job(
    store: object, exc: StoreUnavailableError, new: NewJob
) -> SubmitOutcomeUnknownError | None:
    return unknown_submission(
        store,
        exc,
        "the job",
        f"submit it again with key={new.key!r} (the same request with the same key returns "
        "the stored job or records it once; a new key could record it twice)",
        key=new.key,
        job_id=new.id,
    )


def unknown_submission(
    store: object,
    exc: StoreUnavailableError,
    what: str,
    again: str,
    *,
    key: str,
    job_id: str | None = None,
) -> SubmitOutcomeUnknownError | None:
    """What a submission (the outbox's jobs, the webhooks' events) whose write to ``store``
    raised ``exc`` raises instead: None when the write cannot have landed (the store's own
    error stands: SQLite, or no connection; :func:`may_have_written`), else the error saying
    ``what`` may have been recorded all the same, with ``again``, how to submit it again
    under the same ``key``."""
    if not may_have_written(store, exc):
        return None
    return SubmitOutcomeUnknownError(
        f"{exc}; {what} may have been recorded all the same: {again}",
        key=key,
        job_id=job_id,
        store=exc.store,
    )
