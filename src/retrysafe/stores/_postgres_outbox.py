"""The outbox half of :class:`~retrysafe.stores.PostgresStore` (SPEC §5, §9).

Many workers on many hosts share one database. A claim is one statement — ``UPDATE … WHERE id
IN (SELECT id … ORDER BY due_at LIMIT n FOR UPDATE SKIP LOCKED) RETURNING …`` over due jobs
and IN_FLIGHT jobs whose lease expired — so concurrent claimants get disjoint batches and
never wait on each other's rows. Every later write is fenced by the lease token;
``finish_attempt`` updates the job and inserts its attempt in one statement. Statements live
in ``sql/postgres.sql``; the functions here only bind parameters and convert rows.

Clock: with the store's ``clock="server"`` (default) leases, due times and ``updated_at`` are
measured on the database server's clock. A time the worker computed on its own clock (a due
time ``due_at`` with its ``now``) is stored as the same offset from the server's now, so
hosts whose clocks drift still agree on when a job is due or a lease expired; ``next_due``
is returned on this host's clock. ``deadline_at`` is stored as given (the worker that checks
it uses its own clock). ``clock="caller"`` uses every ``now`` as given (tests).

The async face runs the same statements in worker threads over the store's pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from retrysafe._exceptions import ConfigurationError
from retrysafe.client._models import Attempt, Job, JobState, NewJob
from retrysafe.stores._sql import queries

# Rows come back in SQLite's column order, so one pair of converters serves both stores.
from retrysafe.stores._sqlite_outbox import _row_to_attempt, _row_to_job

if TYPE_CHECKING:
    from retrysafe.stores._postgres import Clock

__all__ = ["AsyncPostgresOutbox", "PostgresOutboxMixin"]

_T = TypeVar("_T")
_Q: dict[str, bytes] = {name: q.encode() for name, q in queries("postgres").items()}


def _states(states: Sequence[JobState] | None) -> list[str] | None:
    return None if states is None else [JobState(s).value for s in states]


# ---------------------------------------------------------------------- statements
# Each takes a sync connection and the store's clock mode; the async face runs them in threads.
Conn = psycopg.Connection[Any]


def _at(clock: Clock, at: float, now: float) -> dict[str, float | None]:
    """A caller-clock time as ``(absolute, offset from now)``: see the module docstring."""
    return {"at": at if clock == "caller" else None, "in": at - now}


def _insert_job(c: Conn, clock: Clock, job: NewJob, now: float) -> tuple[bool, Job]:
    row = c.execute(
        _Q["insert_job"],
        {
            "id": job.id,
            "key": job.key,
            "queue": job.queue,
            "method": job.method,
            "url": job.url,
            "destination": job.destination,
            "headers": json.dumps([list(p) for p in job.headers]),
            "body": job.body,
            "now": now if clock == "caller" else None,
            "deadline_at": job.deadline_at,
        },
    ).fetchone()
    if row is not None:
        return True, _row_to_job(row)
    existing = c.execute(_Q["get_job_by_key"], {"key": job.key}).fetchone()
    if existing is None:  # deleted between the two statements: insert again
        return _insert_job(c, clock, job, now)
    return False, _row_to_job(existing)


def _claim(
    c: Conn, clock: Clock, queue: str, token: str, now: float, lease: float, limit: int
) -> list[Job]:
    params = {
        "queue": queue,
        "token": token,
        "now": now if clock == "caller" else None,
        "lease": lease,
        "limit": limit,
    }
    rows = c.execute(_Q["claim_jobs"], params).fetchall()
    return sorted((_row_to_job(r) for r in rows), key=lambda j: j.due_at)


def _claim_unknown(
    c: Conn,
    clock: Clock,
    queue: str,
    token: str,
    now: float,
    lease: float,
    limit: int,
    ids: Sequence[str] | None,
) -> list[Job]:
    params = {
        "queue": queue,
        "token": token,
        "now": now if clock == "caller" else None,
        "lease": lease,
        "limit": limit,
        "ids": None if ids is None else list(ids),
    }
    rows = c.execute(_Q["claim_unknown_jobs"], params).fetchall()
    return [_row_to_job(r) for r in rows]


def _finish(
    c: Conn,
    clock: Clock,
    job_id: str,
    token: str,
    attempt: Attempt,
    state: JobState,
    due_at: float,
    last_delay: float,
    error: str | None,
    now: float,
) -> Attempt | None:
    due = _at(clock, due_at, now)
    row = c.execute(
        _Q["finish_attempt"],
        {
            "id": job_id,
            "token": token,
            "state": state.value,
            "due_at": due["at"],
            "due_in": due["in"],
            "counted": attempt.counted,
            "last_delay": last_delay,
            "terminal": state.is_terminal,
            "status": attempt.status,
            "outcome": attempt.outcome,
            "error": error,
            "now": now if clock == "caller" else None,
            "key": attempt.key,
            "started_at": attempt.started_at,
            "duration": attempt.duration,
            "error_type": attempt.error_type,
            "replayed": attempt.replayed,
        },
    ).fetchone()
    if row is None:
        return None
    return Attempt(
        job_id=job_id,
        key=attempt.key,
        number=int(row[0]),
        started_at=attempt.started_at,
        duration=attempt.duration,
        outcome=attempt.outcome,
        status=attempt.status,
        error_type=attempt.error_type,
        replayed=attempt.replayed,
        counted=attempt.counted,
    )


def _release(
    c: Conn,
    clock: Clock,
    job_id: str,
    token: str,
    state: JobState,
    due_at: float,
    error: str | None,
    now: float,
) -> bool:
    due = _at(clock, due_at, now)
    cur = c.execute(
        _Q["release_job"],
        {
            "id": job_id,
            "token": token,
            "state": state.value,
            "due_at": due["at"],
            "due_in": due["in"],
            "terminal": state.is_terminal,
            "error": error,
            "now": now if clock == "caller" else None,
        },
    )
    return cur.rowcount == 1


def _extend(c: Conn, clock: Clock, job_id: str, token: str, now: float, lease: float) -> bool:
    params = {
        "id": job_id,
        "token": token,
        "now": now if clock == "caller" else None,
        "lease": lease,
    }
    return c.execute(_Q["extend_job_lease"], params).rowcount == 1


def _transition(
    c: Conn,
    clock: Clock,
    job_id: str,
    from_states: Sequence[JobState],
    state: JobState,
    now: float,
    reset: bool,
    deadline_at: float | None,
) -> Job | None:
    row = c.execute(
        _Q["transition_job"],
        {
            "id": job_id,
            "from_states": _states(from_states),
            "state": state.value,
            "now": now if clock == "caller" else None,
            "reset": reset,
            "deadline_at": deadline_at,
        },
    ).fetchone()
    return None if row is None else _row_to_job(row)


def _count(c: Conn, queue: str) -> dict[JobState, int]:
    counts = dict.fromkeys(JobState, 0)
    for state, n in c.execute(_Q["count_jobs"], {"queue": queue}).fetchall():
        counts[JobState(state)] = int(n)
    return counts


def _next_due(c: Conn, clock: Clock, queue: str) -> float | None:
    row = c.execute(_Q["next_due"], {"queue": queue}).fetchone()
    if row is None or row[0] is None:
        return None
    if clock == "caller":
        return float(row[0])
    return time.time() + (float(row[0]) - float(row[1]))


class PostgresOutboxMixin:
    """:class:`~retrysafe.stores.OutboxStore` for :class:`~retrysafe.stores.PostgresStore`.

    Concurrency contract: see :class:`~retrysafe.stores.OutboxStore`. Claims lock their rows
    ``FOR UPDATE SKIP LOCKED``; ``finish_attempt``, ``release_job`` and ``extend_job_lease``
    change a job only while it is IN_FLIGHT under the caller's lease token; purges delete in
    batches of ``batch``.
    """

    if TYPE_CHECKING:

        @property
        def url(self) -> str: ...

        clock: Clock

        def _conn(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...

        def _translate(self, exc: Exception) -> Exception: ...

    def _run(self, fn: Callable[[Conn], _T]) -> _T:
        with self._conn() as conn:
            return fn(conn)

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection inside a transaction, committed on success and rolled back on
        an exception: pass it as ``submit(connection=…)`` so the job commits together with
        the application's own rows (the transactional outbox). Its ``search_path`` is the
        store's schema."""
        with self._conn() as conn, conn.transaction():
            yield conn

    def insert_job(self, job: NewJob, *, now: float, connection: Any = None) -> tuple[bool, Job]:
        if connection is not None:
            if not isinstance(connection, psycopg.Connection):
                raise ConfigurationError(
                    "connection must be the psycopg.Connection of store.transaction()",
                    option="connection",
                )
            try:
                return _insert_job(connection, self.clock, job, now)
            except psycopg.Error as exc:
                raise self._translate(exc) from exc
        return self._run(lambda c: _insert_job(c, self.clock, job, now))

    def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]:
        return self._run(lambda c: _claim(c, self.clock, queue, token, now, lease, limit))

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
        return self._run(
            lambda c: _claim_unknown(c, self.clock, queue, token, now, lease, limit, ids)
        )

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
        return self._run(
            lambda c: _finish(
                c, self.clock, job_id, token, attempt, state, due_at, last_delay, error, now
            )
        )

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
        return self._run(
            lambda c: _release(c, self.clock, job_id, token, state, due_at, error, now)
        )

    def extend_job_lease(self, job_id: str, token: str, *, now: float, lease: float) -> bool:
        return self._run(lambda c: _extend(c, self.clock, job_id, token, now, lease))

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
        return self._run(
            lambda c: _transition(
                c, self.clock, job_id, from_states, state, now, reset, deadline_at
            )
        )

    def get_job(self, job_id: str) -> Job | None:
        row = self._run(lambda c: c.execute(_Q["get_job"], {"id": job_id}).fetchone())
        return None if row is None else _row_to_job(row)

    def resolve_job_id(self, prefix: str, *, queue: str) -> str | None:
        found = self.job_ids_with_prefix(prefix, queue=queue)
        return found[0] if len(found) == 1 else None

    def job_ids_with_prefix(self, prefix: str, *, queue: str) -> list[str]:
        """Up to two job ids of ``queue`` starting with ``prefix`` (lower-case hex), in id
        order: none, the one, or two of an ambiguous prefix."""
        if not prefix or any(ch not in "0123456789abcdef" for ch in prefix):
            return []
        params = {"pattern": prefix + "%", "queue": queue}
        rows = self._run(lambda c: c.execute(_Q["find_job_by_prefix"], params).fetchall())
        return [str(row[0]) for row in rows]

    def list_jobs(self, *, queue: str, states: Sequence[JobState] | None, limit: int) -> list[Job]:
        params = {"queue": queue, "states": _states(states), "limit": limit}
        rows = self._run(lambda c: c.execute(_Q["list_jobs"], params).fetchall())
        return [_row_to_job(r) for r in rows]

    def list_attempts(self, job_id: str) -> list[Attempt]:
        rows = self._run(lambda c: c.execute(_Q["list_attempts"], {"job_id": job_id}).fetchall())
        return [_row_to_attempt(r) for r in rows]

    def count_jobs(self, *, queue: str) -> dict[JobState, int]:
        return self._run(lambda c: _count(c, queue))

    def next_due(self, *, queue: str) -> float | None:
        return self._run(lambda c: _next_due(c, self.clock, queue))

    def purge_jobs(
        self, *, queue: str, states: Sequence[JobState], before: float, batch: int = 1000
    ) -> int:
        if batch < 1:
            raise ConfigurationError("batch must be >= 1", option="batch")
        cut = _at(self.clock, before, time.time())
        params = {
            "queue": queue,
            "states": _states(states),
            "before_at": cut["at"],
            "before_in": cut["in"],
            "batch": batch,
        }
        total = 0
        while True:
            n = self._run(lambda c: c.execute(_Q["purge_jobs"], params).rowcount)
            total += n
            if n < batch:
                return total

    def asyncio_outbox_store(self) -> AsyncPostgresOutbox:
        """The :class:`~retrysafe.stores.AsyncOutboxStore` face used by the worker."""
        return AsyncPostgresOutbox(self)


class AsyncPostgresOutbox:
    """Async face of the PostgreSQL outbox: the same statements, run in worker threads on the
    store's connection pool (so the face needs no pool of its own and no ``aclose``; the
    store's ``close`` ends it)."""

    def __init__(self, store: PostgresOutboxMixin) -> None:
        self._s = store

    async def _call(self, fn: Callable[[Conn], _T]) -> _T:
        return await asyncio.to_thread(self._s._run, fn)

    async def insert_job(self, job: NewJob, *, now: float) -> tuple[bool, Job]:
        return await self._call(lambda c: _insert_job(c, self._s.clock, job, now))

    async def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]:
        return await self._call(lambda c: _claim(c, self._s.clock, queue, token, now, lease, limit))

    async def claim_unknown_jobs(
        self,
        *,
        queue: str,
        token: str,
        now: float,
        lease: float,
        limit: int,
        ids: Sequence[str] | None,
    ) -> list[Job]:
        return await self._call(
            lambda c: _claim_unknown(c, self._s.clock, queue, token, now, lease, limit, ids)
        )

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
    ) -> Attempt | None:
        return await self._call(
            lambda c: _finish(
                c, self._s.clock, job_id, token, attempt, state, due_at, last_delay, error, now
            )
        )

    async def release_job(
        self,
        job_id: str,
        token: str,
        *,
        state: JobState,
        due_at: float,
        error: str | None,
        now: float,
    ) -> bool:
        return await self._call(
            lambda c: _release(c, self._s.clock, job_id, token, state, due_at, error, now)
        )

    async def extend_job_lease(self, job_id: str, token: str, *, now: float, lease: float) -> bool:
        return await self._call(lambda c: _extend(c, self._s.clock, job_id, token, now, lease))

    async def count_jobs(self, *, queue: str) -> dict[JobState, int]:
        return await self._call(lambda c: _count(c, queue))

    async def next_due(self, *, queue: str) -> float | None:
        return await self._call(lambda c: _next_due(c, self._s.clock, queue))
