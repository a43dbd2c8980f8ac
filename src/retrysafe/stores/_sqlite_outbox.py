"""The outbox half of :class:`~retrysafe.stores.SQLiteStore` (SPEC §5, §9).

Claims are one ``UPDATE … WHERE id IN (SELECT … LIMIT n) RETURNING …`` statement, atomic under
SQLite's write lock, so two workers (threads or processes) on one file never lease the same
job at once; each claim, list, count and purge is limited to one queue. Every later write
is fenced by the lease token. Statements live in ``sql/sqlite.sql``; the functions here only
bind parameters and convert rows.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from retrysafe.client._models import Attempt, Job, JobState, NewJob
from retrysafe.stores._sql import queries

if TYPE_CHECKING:
    from retrysafe.stores._sqlite import _Conn

__all__ = ["SQLiteOutboxMixin"]

_T = TypeVar("_T")
_Q = queries("sqlite")


def _row_to_job(row: Sequence[Any]) -> Job:
    (
        id_,
        key,
        queue,
        state,
        method,
        url,
        destination,
        headers,
        body,
        created_at,
        updated_at,
        due_at,
        deadline_at,
        attempts,
        sends,
        polls,
        last_delay,
        lease_token,
        lease_expires_at,
        finished_at,
        last_status,
        last_outcome,
        last_error,
    ) = row
    return Job(
        id=id_,
        key=key,
        queue=queue,
        state=JobState(state),
        method=method,
        url=url,
        destination=destination,
        headers=tuple((str(k), str(v)) for k, v in json.loads(headers)),
        body=bytes(body),
        created_at=float(created_at),
        updated_at=float(updated_at),
        due_at=float(due_at),
        deadline_at=None if deadline_at is None else float(deadline_at),
        attempts=int(attempts),
        sends=int(sends),
        polls=int(polls),
        last_delay=float(last_delay),
        lease_token=lease_token,
        lease_expires_at=None if lease_expires_at is None else float(lease_expires_at),
        finished_at=None if finished_at is None else float(finished_at),
        last_status=None if last_status is None else int(last_status),
        last_outcome=last_outcome,
        last_error=last_error,
    )


def _row_to_attempt(row: Sequence[Any]) -> Attempt:
    job_id, key, number, started, duration, outcome, status, error_type, replayed, counted = row
    return Attempt(
        job_id=job_id,
        key=key,
        number=int(number),
        started_at=float(started),
        duration=float(duration),
        outcome=outcome,
        status=None if status is None else int(status),
        error_type=error_type,
        replayed=bool(replayed),
        counted=bool(counted),
    )


def _states(states: Sequence[JobState] | None) -> str | None:
    return None if states is None else json.dumps([JobState(s).value for s in states])


# ---------------------------------------------------------------------- statements
def _insert_job(c: sqlite3.Connection, job: NewJob, now: float) -> tuple[bool, Job]:
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
            "now": now,
            "deadline_at": job.deadline_at,
        },
    ).fetchone()
    if row is not None:
        return True, _row_to_job(row)
    existing = c.execute(_Q["get_job_by_key"], {"key": job.key}).fetchone()
    return False, _row_to_job(existing)


def _claim(
    c: sqlite3.Connection, queue: str, token: str, now: float, lease: float, limit: int
) -> list[Job]:
    rows = c.execute(
        _Q["claim_jobs"],
        {
            "queue": queue,
            "token": token,
            "now": now,
            "lease_expires_at": now + lease,
            "limit": limit,
        },
    ).fetchall()
    return sorted((_row_to_job(r) for r in rows), key=lambda j: j.due_at)


def _claim_unknown(
    c: sqlite3.Connection,
    queue: str,
    token: str,
    now: float,
    lease: float,
    limit: int,
    ids: Sequence[str] | None,
) -> list[Job]:
    rows = c.execute(
        _Q["claim_unknown_jobs"],
        {
            "queue": queue,
            "token": token,
            "now": now,
            "lease_expires_at": now + lease,
            "limit": limit,
            "ids": None if ids is None else json.dumps(list(ids)),
        },
    ).fetchall()
    return [_row_to_job(r) for r in rows]


def _finish(
    c: sqlite3.Connection,
    job_id: str,
    token: str,
    attempt: Attempt,
    state: JobState,
    due_at: float,
    last_delay: float,
    error: str | None,
    now: float,
) -> Attempt | None:
    c.execute("BEGIN IMMEDIATE")
    try:
        row = c.execute(
            _Q["finish_attempt"],
            {
                "id": job_id,
                "token": token,
                "state": state.value,
                "due_at": due_at,
                "counted": 1 if attempt.counted else 0,
                "last_delay": last_delay,
                "finished_at": now if state.is_terminal else None,
                "status": attempt.status,
                "outcome": attempt.outcome,
                "error": error,
                "now": now,
            },
        ).fetchone()
        if row is None:
            c.execute("ROLLBACK")
            return None
        number = int(row[0])
        c.execute(
            _Q["insert_attempt"],
            {
                "job_id": job_id,
                "number": number,
                "key": attempt.key,
                "started_at": attempt.started_at,
                "duration": attempt.duration,
                "outcome": attempt.outcome,
                "status": attempt.status,
                "error_type": attempt.error_type,
                "replayed": 1 if attempt.replayed else 0,
                "counted": 1 if attempt.counted else 0,
            },
        )
        c.execute("COMMIT")
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    return Attempt(
        job_id=job_id,
        key=attempt.key,
        number=number,
        started_at=attempt.started_at,
        duration=attempt.duration,
        outcome=attempt.outcome,
        status=attempt.status,
        error_type=attempt.error_type,
        replayed=attempt.replayed,
        counted=attempt.counted,
    )


def _release(
    c: sqlite3.Connection,
    job_id: str,
    token: str,
    state: JobState,
    due_at: float,
    error: str | None,
    now: float,
) -> bool:
    cur = c.execute(
        _Q["release_job"],
        {
            "id": job_id,
            "token": token,
            "state": state.value,
            "due_at": due_at,
            "finished_at": now if state.is_terminal else None,
            "error": error,
            "now": now,
        },
    )
    return cur.rowcount == 1


def _extend(c: sqlite3.Connection, job_id: str, token: str, now: float, lease: float) -> bool:
    params = {"id": job_id, "token": token, "lease_expires_at": now + lease}
    return c.execute(_Q["extend_job_lease"], params).rowcount == 1


def _transition(
    c: sqlite3.Connection,
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
            "now": now,
            "reset": 1 if reset else 0,
            "deadline_at": deadline_at,
        },
    ).fetchone()
    return None if row is None else _row_to_job(row)


def _count(c: sqlite3.Connection, queue: str) -> dict[JobState, int]:
    counts = dict.fromkeys(JobState, 0)
    for state, n in c.execute(_Q["count_jobs"], {"queue": queue}).fetchall():
        counts[JobState(state)] = int(n)
    return counts


def _next_due(c: sqlite3.Connection, queue: str) -> float | None:
    row = c.execute(_Q["next_due"], {"queue": queue}).fetchone()
    return None if row is None or row[0] is None else float(row[0])


class SQLiteOutboxMixin:
    """:class:`~retrysafe.stores.OutboxStore` for :class:`~retrysafe.stores.SQLiteStore`."""

    if TYPE_CHECKING:

        @property
        def url(self) -> str: ...

        _lock: Any
        _connections: Any

        def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T: ...

        def _connect(self, busy_timeout: float) -> sqlite3.Connection: ...

        def transaction(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def insert_job(self, job: NewJob, *, now: float, connection: Any = None) -> tuple[bool, Job]:
        if connection is not None:
            if not isinstance(connection, sqlite3.Connection):
                from retrysafe._exceptions import ConfigurationError

                raise ConfigurationError(
                    "connection must be the sqlite3.Connection of store.transaction()",
                    option="connection",
                )
            from retrysafe.stores._sqlite import _translate

            try:
                return _insert_job(connection, job, now)
            except sqlite3.Error as exc:
                raise _translate(exc, self.url) from exc
        return self.run(lambda c: _insert_job(c, job, now))

    def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]:
        return self.run(lambda c: _claim(c, queue, token, now, lease, limit))

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
        return self.run(lambda c: _claim_unknown(c, queue, token, now, lease, limit, ids))

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
        return self.run(
            lambda c: _finish(c, job_id, token, attempt, state, due_at, last_delay, error, now)
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
        return self.run(lambda c: _release(c, job_id, token, state, due_at, error, now))

    def extend_job_lease(self, job_id: str, token: str, *, now: float, lease: float) -> bool:
        return self.run(lambda c: _extend(c, job_id, token, now, lease))

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
        return self.run(
            lambda c: _transition(c, job_id, from_states, state, now, reset, deadline_at)
        )

    def get_job(self, job_id: str) -> Job | None:
        row = self.run(lambda c: c.execute(_Q["get_job"], {"id": job_id}).fetchone())
        return None if row is None else _row_to_job(row)

    def resolve_job_id(self, prefix: str, *, queue: str) -> str | None:
        found = self.job_ids_with_prefix(prefix, queue=queue)
        return found[0] if len(found) == 1 else None

    def job_ids_with_prefix(self, prefix: str, *, queue: str) -> list[str]:
        """Up to two job ids of ``queue`` starting with ``prefix`` (lower-case hex), in id
        order: none, the one, or two of an ambiguous prefix."""
        if not prefix or any(ch not in "0123456789abcdef" for ch in prefix):
            return []
        params = {"prefix": prefix, "queue": queue}
        rows = self.run(lambda c: c.execute(_Q["find_job_by_prefix"], params).fetchall())
        return [str(row[0]) for row in rows]

    def list_jobs(self, *, queue: str, states: Sequence[JobState] | None, limit: int) -> list[Job]:
        params = {"queue": queue, "states": _states(states), "limit": limit}
        rows = self.run(lambda c: c.execute(_Q["list_jobs"], params).fetchall())
        return [_row_to_job(r) for r in rows]

    def list_attempts(self, job_id: str) -> list[Attempt]:
        rows = self.run(lambda c: c.execute(_Q["list_attempts"], {"job_id": job_id}).fetchall())
        return [_row_to_attempt(r) for r in rows]

    def count_jobs(self, *, queue: str) -> dict[JobState, int]:
        return self.run(lambda c: _count(c, queue))

    def next_due(self, *, queue: str) -> float | None:
        return self.run(lambda c: _next_due(c, queue))

    def purge_jobs(
        self, *, queue: str, states: Sequence[JobState], before: float, batch: int = 1000
    ) -> int:
        params = {"queue": queue, "states": _states(states), "before": before, "batch": batch}
        total = 0
        while True:
            n = self.run(lambda c: c.execute(_Q["purge_jobs"], params).rowcount)
            total += n
            if n < batch:
                return total

    def asyncio_outbox_store(self) -> _AsyncSQLiteOutbox:
        """The :class:`~retrysafe.stores.AsyncOutboxStore` face used by the worker."""
        return _AsyncSQLiteOutbox(self)


class _AsyncSQLiteOutbox:
    """Async face of the SQLite outbox for the event loop.

    Like the key store's async face: a statement first runs on the loop thread on a
    connection that never waits for a lock (an uncontended write takes microseconds); when
    another worker holds the write lock it is retried in a worker thread with the store's
    normal ``busy_timeout``, so the loop never blocks on a lock.
    """

    def __init__(self, store: SQLiteOutboxMixin) -> None:
        self._store = store
        self._inline: _Conn | None = None

    def _inline_conn(self) -> sqlite3.Connection:
        from retrysafe.stores._sqlite import _Conn

        if self._inline is None:
            self._inline = _Conn(self._store._connect(0.0))
            with self._store._lock:
                self._store._connections.add(self._inline)
        return self._inline.conn

    async def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        from retrysafe.stores._sqlite import _translate

        try:
            return fn(self._inline_conn())
        except sqlite3.OperationalError as exc:
            low = str(exc).lower()
            if "locked" not in low and "busy" not in low:
                raise _translate(exc, self._store.url) from exc
        except sqlite3.Error as exc:
            raise _translate(exc, self._store.url) from exc
        return await asyncio.to_thread(self._store.run, fn)

    async def insert_job(self, job: NewJob, *, now: float) -> tuple[bool, Job]:
        return await self._call(lambda c: _insert_job(c, job, now))

    async def claim_jobs(
        self, *, queue: str, token: str, now: float, lease: float, limit: int
    ) -> list[Job]:
        return await self._call(lambda c: _claim(c, queue, token, now, lease, limit))

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
        return await self._call(lambda c: _claim_unknown(c, queue, token, now, lease, limit, ids))

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
            lambda c: _finish(c, job_id, token, attempt, state, due_at, last_delay, error, now)
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
        return await self._call(lambda c: _release(c, job_id, token, state, due_at, error, now))

    async def extend_job_lease(self, job_id: str, token: str, *, now: float, lease: float) -> bool:
        return await self._call(lambda c: _extend(c, job_id, token, now, lease))

    async def count_jobs(self, *, queue: str) -> dict[JobState, int]:
        return await self._call(lambda c: _count(c, queue))

    async def next_due(self, *, queue: str) -> float | None:
        return await self._call(lambda c: _next_due(c, queue))
