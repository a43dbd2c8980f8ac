"""The outbox store on SQL, written once for SQLite and PostgreSQL (SPEC §5, §9).

Claims are one statement each — ``UPDATE … WHERE id IN (SELECT … LIMIT n) RETURNING …`` over
due jobs and IN_FLIGHT jobs whose lease expired — atomic under SQLite's write lock and, on
PostgreSQL, locking their rows ``FOR UPDATE SKIP LOCKED``: two workers (threads, processes or
hosts) never lease the same job at once, and PostgreSQL's concurrent claimants get disjoint
batches without waiting on each other's rows. Each claim, list, count and purge is limited to
one queue. Every later write is fenced by the lease token; ``finish_attempt`` records the
attempt and moves the job in one transaction (one statement on PostgreSQL). The statements
live in ``sql/outbox.<dialect>.sql``; the operations here only bind parameters and convert
rows. :class:`SQLOutboxStore` and :class:`AsyncSQLOutboxStore` are the same operations on a
sync and an async :mod:`connector <retrysafe.stores._connector>`; :func:`outbox_store` gives
the outbox of a :class:`~retrysafe.stores.SQLiteStore` or
:class:`~retrysafe.stores.PostgresStore`.

Clock: a PostgreSQL store on ``clock="server"`` (its default) measures leases, due times and
``updated_at`` on the database server's clock. A time the worker computed on its own clock (a
due time ``due_at`` with its ``now``, a purge cut-off) is stored as the same offset from the
server's now, so hosts whose clocks drift still agree on when a job is due or a lease expired;
``next_due`` is returned on this host's clock. ``deadline_at`` is stored as given (the worker
that checks it uses its own clock). SQLite, and PostgreSQL on ``clock="caller"`` (tests), use
every ``now`` as given.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeAlias

from retrysafe._exceptions import (
    ConfigurationError,
    DamagedJobError,
    RetrysafeWarning,
    StoreError,
)
from retrysafe.client._jobs import RESERVED_HEADERS
from retrysafe.client._models import Attempt, Finish, Job, JobState, NewJob, OutboxStore
from retrysafe.client._policy import count as positive
from retrysafe.core import RACE_LIMIT, parse_key
from retrysafe.stores._connector import (
    Clock,
    JsonText,
    OnAsyncConnector,
    OnConnector,
    Op,
    Statements,
    all_rows,
    async_op,
    caller_now,
    caller_time,
    count,
    feature_store,
    one,
    sync_op,
)
from retrysafe.stores._keys import headers_json

__all__ = [
    "INLINE_BODY_MAX",
    "JOB_COLUMNS",
    "JOB_READS",
    "AsyncSQLOutboxStore",
    "SQLOutboxStore",
    "StoreArg",
    "attempt_from_row",
    "claim_jobs",
    "claim_unknown_jobs",
    "count_jobs",
    "extend_job_lease",
    "finish_attempt",
    "finish_attempts",
    "get_job",
    "hasten_jobs",
    "insert_job",
    "job_from_row",
    "job_ids_with_prefix",
    "job_stats",
    "list_attempts",
    "list_jobs",
    "next_due",
    "open_outbox_store",
    "outbox_store",
    "purge_jobs",
    "release_job",
    "resolve_job_id",
    "states_param",
    "transition_job",
]

logger = logging.getLogger("retrysafe.client")

if TYPE_CHECKING:
    from retrysafe.stores import PostgresStore, SQLiteStore

#: What the outbox, the worker and reconcile take as their store: a URL (``sqlite:///x.db``,
#: ``postgresql://…``), a SQL store, or any :class:`~retrysafe.client.OutboxStore`.
StoreArg: TypeAlias = "str | OutboxStore | SQLiteStore | PostgresStore"

#: The columns every statement returning a row reads, in the order the row converter
#: unpacks them (``{job_columns}`` in the statement files).
JOB_COLUMNS = (
    "id",
    "idempotency_key",
    "queue",
    "state",
    "method",
    "url",
    "destination",
    "headers",
    "body",
    "created_at",
    "updated_at",
    "due_at",
    "deadline_at",
    "attempts",
    "sends",
    "polls",
    "last_delay",
    "lease_token",
    "lease_expires_at",
    "finished_at",
    "last_status",
    "last_outcome",
    "last_error",
)

#: How a statement reads a job column that is not simply the column, by dialect. SQLite keeps
#: a body over 3.5 KiB in ``outbox_bodies`` and the body's length (an INTEGER) in the job's row
#: (``sql/schema.sqlite.sql``, schema version 4: SQLite rewrites a whole row, its overflow
#: pages included, whenever an update changes the row's size, so every claim and every
#: recorded attempt rewrote such a body).
#: (A body whose length is not the one the row records reads as NULL: damaged, never sent.)
JOB_READS = {
    "sqlite": {
        "body": "CASE WHEN typeof(body) = 'integer' THEN (SELECT b.body FROM outbox_bodies b"
        " WHERE b.job_id = outbox_jobs.id AND length(b.body) = outbox_jobs.body) ELSE body END"
    }
}

#: The longest body, in bytes, that SQLite keeps in the job's row; a longer one goes to
#: ``outbox_bodies`` (:data:`JOB_READS`). At 3.5 KiB a row still fits its 4 KiB page with
#: the other columns: a claim writes that page anyway, and the claim and the record of 16 KiB
#: bodies cost a quarter of what they cost in the row; under it the table gains nothing.
INLINE_BODY_MAX = 3584

_SQL = Statements(
    "retrysafe.client",
    "outbox",
    columns={"job_columns": JOB_COLUMNS},
    reads=JOB_READS,
    lenient=["job_columns"],
)


# ---------------------------------------------------------------------- rows
#: A stored state's member (a dict look-up; calling ``JobState`` costs an Enum call per row).
_STATES = {s.value: s for s in JobState}


def _parse(headers: str) -> tuple[tuple[str, str], ...]:
    """A job's stored headers (a JSON array of [name, value]) as the pairs :class:`Job`
    holds.

    Raises:
        ValueError: not such an array; or a header that would make every attempt malformed
            or ambiguous, which no submission may set (:data:`RESERVED_HEADERS`: a
            Content-Length, a second Host, an Idempotency-Key) or a line break or NUL in a
            name or value: a row something else wrote. (Values an earlier release accepted,
            such as a DEL character, are still read.)
    """
    fields = json.loads(headers)
    if not isinstance(fields, list):
        raise ValueError("not a JSON array of [name, value] pairs")
    pairs = []
    for field in fields:
        if not (isinstance(field, list) and len(field) == 2):
            raise ValueError("not a JSON array of [name, value] pairs")
        name, value = field
        if not (type(name) is str and type(value) is str and name):
            raise ValueError("not a JSON array of [name, value] pairs")
        if name.lower() in RESERVED_HEADERS:
            raise ValueError(f"header {name[:40]!r} is set by the HTTP client, never by a job")
        if _BREAKS.search(name) or _BREAKS.search(value):
            raise ValueError(f"header {name[:40]!r} holds a line break or NUL")
        pairs.append((name, value))
    return tuple(pairs)


#: What no header name or value may hold: it would split the request (RFC 9110 §5.5).
_BREAKS = re.compile(r"[\r\n\0]")


#: The longest stored headers whose parse is cached, and how many are kept (at most 1 MiB of
#: text): the jobs of one sender usually carry the same few headers, so a claim of many jobs
#: parses them once (the pairs are immutable, so every job may share them).
_CACHED_HEADERS = 4096
_headers_of = functools.lru_cache(maxsize=256)(_parse)


def job_from_row(row: Sequence[Any]) -> Job:
    """A :class:`Job` from a row of the job columns (the order the statements return them).

    Raises:
        DamagedJobError: a value of the row is not one retrysafe writes (something else wrote
            or changed the row): the message names the job and the column.
    """
    try:
        return _job_from_row(row)
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
        raise DamagedJobError(_damage(row, exc), job_id=str(row[0])) from exc


def _damage(row: Sequence[Any], exc: BaseException) -> str:
    """Why ``row`` cannot be read, for :class:`DamagedJobError` and the parked job's
    ``last_error``."""
    where = "a value"
    try:
        _parse(row[JOB_COLUMNS.index("headers")])
    except (ValueError, TypeError, RecursionError):
        where = "its headers"
    detail = f"{type(exc).__name__}: {exc}"[:200]
    return (
        f"job {row[0]}: the stored row cannot be read, {where}: {detail}. Something other "
        "than retrysafe wrote or changed it. A worker that claims it parks it UNKNOWN "
        "without sending it; correct the row in the database, or delete it (`retrysafe dlq "
        "purge --state unknown` deletes the UNKNOWN jobs)"
    )


def _readable(rows: Sequence[Sequence[Any]]) -> tuple[list[Job], list[tuple[str, str]]]:
    """The jobs of ``rows`` that can be read, and (id, why) of each damaged one."""
    jobs: list[Job] = []
    damaged: list[tuple[str, str]] = []
    for row in rows:
        try:
            jobs.append(job_from_row(row))
        except DamagedJobError as exc:
            damaged.append((exc.job_id, str(exc)))
    return jobs, damaged


class Claimed(list[Job]):
    """A claim's jobs, and :attr:`parked`: the ids of the damaged jobs it parked UNKNOWN
    instead of returning them (never sent; see :func:`job_from_row`), which the worker and
    reconcile count as left UNKNOWN (a run that parked one exited 0, saying none was)."""

    parked: tuple[str, ...] = ()


def parked_by(claimed: Sequence[Job]) -> tuple[str, ...]:
    """The ids of the damaged jobs the claim that returned ``claimed`` parked (none from a
    store of one's own, whose claims return plain lists)."""
    return claimed.parked if isinstance(claimed, Claimed) else ()


def _claimed(jobs: list[Job], damaged: list[tuple[str, str]]) -> Claimed:
    out = Claimed(jobs)
    out.parked = tuple(job_id for job_id, _ in damaged)
    return out


def readable_jobs(rows: Sequence[Sequence[Any]]) -> list[Job]:
    """The jobs of ``rows`` that can be read, for a listing: each damaged row is left out
    with a :class:`~retrysafe.RetrysafeWarning` naming it and why (one row something else
    damaged made every listing fail, so an operator saw none of the other jobs)."""
    jobs, damaged = _readable(rows)
    for _, why in damaged:
        warnings.warn(f"left out of this listing: {why}", RetrysafeWarning, stacklevel=2)
    return jobs


def _park_damaged(
    clock: Clock, damaged: list[tuple[str, str]], token: str, now: float
) -> Op[None]:
    """End the new lease of each damaged job (a claim's): UNKNOWN, never sent by it, the
    reason in ``last_error``. A worker that failed on such a row stopped, and a new one
    claimed the same row again once the lease ended."""
    for job_id, why in damaged:
        logger.error("job=%s parked UNKNOWN without an attempt: %s", job_id, why)
        yield from release_job(
            clock, job_id, token, state=JobState.UNKNOWN, due_at=now, error=why, now=now
        )


def _job_from_row(row: Sequence[Any]) -> Job:
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
    if not (
        type(id_) is str
        and type(key) is str
        and type(queue) is str
        and type(method) is str
        and type(url) is str
        and type(destination) is str
    ):
        raise TypeError("a text column (id, key, queue, method, url, destination) holds no text")
    if body is None:  # SQLite (JOB_READS): its row of outbox_bodies is gone or changed
        raise ValueError(
            f"the body is missing: a body over {INLINE_BODY_MAX:,} bytes is kept in "
            "outbox_bodies, and the job's row there is gone or does not have the length the "
            "job's own row records"
        )
    if not isinstance(body, (bytes, memoryview)):  # bytes(5) would be five zero bytes
        raise TypeError(f"the body is {type(body).__name__}, not bytes")
    for text in (lease_token, last_outcome, last_error):
        if text is not None and type(text) is not str:  # a BLOB, or bytes that are no UTF-8
            raise TypeError("a text column (lease_token, last_outcome, last_error) holds no text")
    if parse_key(key) != key:  # the submission's own rule (SPEC §2): an empty or overlong
        # key went out as it was, and the endpoint ran the effect unprotected
        raise ValueError("the idempotency key is not 1–255 visible ASCII characters")
    created, updated, due = float(created_at), float(updated_at), float(due_at)
    if not (math.isfinite(created) and math.isfinite(updated) and math.isfinite(due)):
        raise ValueError("a time (created_at, updated_at, due_at) is not finite")
    return Job(
        id=id_,
        key=key,
        queue=queue,
        state=_STATES[state],
        method=method,
        url=url,
        destination=destination,
        headers=_headers_of(headers) if len(headers) <= _CACHED_HEADERS else _parse(headers),
        body=bytes(body),
        created_at=created,
        updated_at=updated,
        due_at=due,
        deadline_at=_float(deadline_at),
        attempts=int(attempts),
        sends=int(sends),
        polls=int(polls),
        last_delay=float(last_delay),
        lease_token=lease_token,
        lease_expires_at=_float(lease_expires_at),
        finished_at=_float(finished_at),
        last_status=None if last_status is None else int(last_status),
        last_outcome=last_outcome,
        last_error=last_error,
    )


def _as_inserted(job: NewJob, now: float) -> Job:
    """The :class:`Job` that ``insert_job`` stores for ``job`` at ``now``: what
    :func:`job_from_row` reads back from that row."""
    return Job(
        id=job.id,
        key=job.key,
        queue=job.queue,
        state=JobState.PENDING,
        method=job.method,
        url=job.url,
        destination=job.destination,
        headers=tuple((str(k), str(v)) for k, v in job.headers),
        body=bytes(job.body),
        created_at=float(now),
        updated_at=float(now),
        due_at=float(now),
        deadline_at=_float(job.deadline_at),
        attempts=0,
        sends=0,
        polls=0,
        last_delay=0.0,
        lease_token=None,
        lease_expires_at=None,
        finished_at=None,
        last_status=None,
        last_outcome=None,
        last_error=None,
    )


def attempt_from_row(row: Sequence[Any]) -> Attempt:
    """An :class:`Attempt` from a row of ``list_attempts``."""
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


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def states_param(states: Sequence[JobState] | None) -> str | None:
    """States as the statements take them: a JSON array of their values (None: any state)."""
    return None if states is None else json.dumps([JobState(s).value for s in states])


# ---------------------------------------------------------------------- operations
def insert_job(clock: Clock, job: NewJob, *, now: float) -> Op[tuple[bool, Job]]:
    """Insert ``job`` as PENDING, due ``now``: ``(True, job)``, or ``(False, existing)`` when a
    job with the same key exists (nothing is written)."""
    params = {
        "id": job.id,
        "key": job.key,
        "queue": job.queue,
        "method": job.method,
        "url": job.url,
        "destination": job.destination,
        "headers": headers_json(job.headers),
        "body": job.body,
        "now": caller_now(clock, now),
        "deadline_at": job.deadline_at,
    }
    # On the caller's clock the job as stored is known without reading it back: its times
    # are this ``now`` (RETURNING costs SQLite an ephemeral table per statement). On the
    # server's clock (PostgreSQL only) they are the server's: insert_job returns them.
    add = _SQL["add_large_job" if len(job.body) > INLINE_BODY_MAX else "add_job"]
    for _ in range(RACE_LIMIT):
        if clock == "caller":
            if (yield count(add, params)):
                return True, _as_inserted(job, now)
        else:
            row = yield one(_SQL["insert_job"], params)
            if row is not None:
                return True, job_from_row(row)
        row = yield one(_SQL["get_job_by_key"], params)
        if row is not None:
            return False, job_from_row(row)
        # The job with that key was deleted between the two statements: insert again.
    raise StoreError(f"insert of job {job.id} kept racing with deletes of its key; giving up")


def claim_jobs(
    clock: Clock,
    *,
    queue: str,
    token: str,
    now: float,
    lease: float,
    limit: int,
    skip_destinations: Sequence[str] = (),
    only_destination: str | None = None,
) -> Op[list[Job]]:
    """Lease up to ``limit`` claimable jobs of ``queue`` until ``now + lease``: the earliest
    due (or whose lease ended earliest), returned oldest first (once leased, every one is due
    at the lease's end, so the due time no longer orders them). Jobs to the
    ``skip_destinations`` (``scheme://host:port``) stay where they are; with
    ``only_destination``, only its jobs are claimed."""
    params = {
        "queue": queue,
        "token": token,
        "now": caller_now(clock, now),
        "lease": lease,
        "limit": limit,
        "skip": json.dumps(list(skip_destinations)) if skip_destinations else None,
        "only": only_destination,
    }
    rows = yield all_rows(_SQL["claim_jobs"], params)
    jobs, damaged = _readable(rows)
    if damaged:
        yield from _park_damaged(clock, damaged, token, now)
    return _claimed(sorted(jobs, key=_oldest_first), damaged)


def _oldest_first(job: Job) -> tuple[float, str]:
    return (job.created_at, job.id)


def claim_unknown_jobs(
    clock: Clock,
    *,
    queue: str,
    token: str,
    now: float,
    lease: float,
    limit: int,
    ids: Sequence[str] | None,
) -> Op[list[Job]]:
    """Lease UNKNOWN jobs of ``queue`` (all, oldest first, or those in ``ids``) for
    reconciliation."""
    params = {
        "queue": queue,
        "token": token,
        "now": caller_now(clock, now),
        "lease": lease,
        "limit": limit,
        "ids": None if ids is None else json.dumps(list(ids)),
    }
    rows = yield all_rows(_SQL["claim_unknown_jobs"], params)
    jobs, damaged = _readable(rows)
    if damaged:
        yield from _park_damaged(clock, damaged, token, now)
    return _claimed(jobs, damaged)


def finish_attempt(
    clock: Clock,
    job_id: str,
    token: str,
    attempt: Attempt,
    *,
    state: JobState,
    due_at: float,
    last_delay: float,
    error: str | None,
    now: float,
) -> Op[Attempt | None]:
    """Record ``attempt`` (its ``number`` is assigned here: the job's new send count) and move
    the job to ``state``, in one transaction; None when the token no longer owns the job
    (nothing is written). A batch of one :func:`finish_attempts`."""
    finish = Finish(
        job_id=job_id,
        token=token,
        attempt=attempt,
        state=state,
        due_at=due_at,
        last_delay=last_delay,
        error=error,
        now=now,
    )
    recorded = yield from finish_attempts(clock, [finish])
    return recorded[0]


def finish_attempts(clock: Clock, finishes: Sequence[Finish]) -> Op[list[Attempt | None]]:
    """Record a batch of attempts and move their jobs, in one transaction (the worker's hot
    path: one round trip per batch, not per job; PostgreSQL: one statement; SQLite: two
    plain statements per finish). Each finish is fenced on its own: one whose token no
    longer owns its job writes nothing and comes back as None; the others are recorded.

    Raises:
        ValueError: a job appears twice in the batch.
    """
    if not finishes:
        return []
    rows = finish_rows(clock, finishes)
    if len({f.job_id for f in finishes}) != len(finishes):
        raise ValueError("a batch of finishes names the same job twice")
    # Both forms of the batch: one JSON array (PostgreSQL, one statement; written only there)
    # and the rows themselves (SQLite runs its block once per row: see the statement's "each").
    params = {"finishes": JsonText(rows), "rows": rows}
    numbers = dict((yield all_rows(_SQL["finish_attempts"], params)))
    out: list[Attempt | None] = []
    for f in finishes:
        number = numbers.get(f.job_id)
        out.append(
            None if number is None else _numbered(f.attempt, f.job_id, int(number))
        )
    return out


def finish_rows(clock: Clock, finishes: Sequence[Finish]) -> list[dict[str, Any]]:
    """The parameters of each finish of a batch: the lease's end (:func:`_lease_end`) and
    the attempt's fields, one mapping per finish."""
    rows = []
    for f in finishes:
        a = f.attempt
        rows.append(
            {
                **_lease_end(clock, f.job_id, f.token, f.state, f.due_at, f.error, f.now),
                "counted": a.counted,
                "last_delay": f.last_delay,
                "status": a.status,
                "outcome": a.outcome,
                "key": a.key,
                "started_at": a.started_at,
                "duration": a.duration,
                "error_type": a.error_type,
                "replayed": a.replayed,
            }
        )
    return rows


def _numbered(a: Attempt, job_id: str, number: int) -> Attempt:
    """``a`` as recorded: its job and the number the store gave it (the constructor, not
    ``dataclasses.replace``, which costs several times as much on this hot path)."""
    return Attempt(
        job_id=job_id,
        key=a.key,
        number=number,
        started_at=a.started_at,
        duration=a.duration,
        outcome=a.outcome,
        status=a.status,
        error_type=a.error_type,
        replayed=a.replayed,
        counted=a.counted,
    )


def release_job(
    clock: Clock,
    job_id: str,
    token: str,
    *,
    state: JobState,
    due_at: float,
    error: str | None,
    now: float,
) -> Op[bool]:
    """End a lease without recording an attempt; False when not the owner."""
    params = _lease_end(clock, job_id, token, state, due_at, error, now)
    released: int = yield count(_SQL["release_job"], params)
    return released == 1


def _lease_end(
    clock: Clock,
    job_id: str,
    token: str,
    state: JobState,
    due_at: float,
    error: str | None,
    now: float,
) -> dict[str, Any]:
    """The parameters of a fenced write that ends the lease (finish or release): the job, the
    token, its next state and due time, and the error to keep."""
    due = caller_time(clock, due_at, now)
    return {
        "id": job_id,
        "token": token,
        "state": state.value,
        "due_at": due["at"],
        "due_in": due["in"],
        "terminal": state.is_terminal,
        "error": error,
        "now": caller_now(clock, now),
    }


def extend_job_lease(
    clock: Clock, job_id: str, token: str, *, now: float, lease: float
) -> Op[bool]:
    """Move the lease end to ``now + lease`` while the job is IN_FLIGHT under ``token``."""
    params = {"id": job_id, "token": token, "now": caller_now(clock, now), "lease": lease}
    renewed: int = yield count(_SQL["extend_job_lease"], params)
    return renewed == 1


def transition_job(
    clock: Clock,
    job_id: str,
    *,
    from_states: Sequence[JobState],
    state: JobState,
    now: float,
    reset: bool = False,
    deadline_at: float | None = None,
) -> Op[Job | None]:
    """Move a job in one of ``from_states`` to ``state`` (due now); None when it is in
    another state."""
    params = {
        "id": job_id,
        "from_states": states_param(from_states),
        "state": state.value,
        "now": caller_now(clock, now),
        "reset": reset,
        "deadline_at": deadline_at,
    }
    row = yield one(_SQL["transition_job"], params)
    return None if row is None else job_from_row(row)


def hasten_jobs(
    clock: Clock, jobs: Sequence[tuple[str, float, float]], *, now: float
) -> Op[int]:
    """Make each ``(job id, due at, released at)`` due ``now`` while it is PENDING until
    exactly the time :func:`release_job` set when it released it at ``released at`` with
    that ``due at`` (a retry the retry budget deferred: see the worker's ``_Budgets``); how
    many changed."""
    changed = 0
    for job_id, due_at, released_at in jobs:
        due = caller_time(clock, due_at, released_at)
        params = {"id": job_id, "due_at": due["at"], "due_in": due["in"]}
        params["now"] = caller_now(clock, now)
        changed += yield count(_SQL["hasten_job"], params)
    return changed


def get_job(clock: Clock, job_id: str) -> Op[Job | None]:
    """The job with id ``job_id``, whatever its queue, or None."""
    row = yield one(_SQL["get_job"], {"id": job_id})
    return None if row is None else job_from_row(row)


def job_ids_with_prefix(clock: Clock, prefix: str, *, queue: str) -> Op[list[str]]:
    """Up to two job ids of ``queue`` starting with ``prefix`` (compared literally), in id
    order: none, the one, or two of an ambiguous prefix. An empty prefix names no job."""
    rows = yield all_rows(_SQL["find_job_by_prefix"], {"prefix": prefix, "queue": queue})
    return [str(row[0]) for row in rows]


def resolve_job_id(clock: Clock, prefix: str, *, queue: str) -> Op[str | None]:
    """The one job id of ``queue`` starting with ``prefix``; None when none or several
    match."""
    found = yield from job_ids_with_prefix(clock, prefix, queue=queue)
    return found[0] if len(found) == 1 else None


def list_jobs(
    clock: Clock, *, queue: str, states: Sequence[JobState] | None, limit: int
) -> Op[list[Job]]:
    """Jobs of ``queue`` (only in ``states``, when given), oldest first, at most ``limit``;
    damaged rows left out (:func:`readable_jobs`)."""
    params = {"queue": queue, "states": states_param(states), "limit": limit}
    rows = yield all_rows(_SQL["list_jobs"], params)
    return readable_jobs(rows)


def list_attempts(clock: Clock, job_id: str) -> Op[list[Attempt]]:
    """Every recorded attempt of the job, by number."""
    rows = yield all_rows(_SQL["list_attempts"], {"job_id": job_id})
    return [attempt_from_row(r) for r in rows]


def count_jobs(clock: Clock, *, queue: str) -> Op[dict[JobState, int]]:
    """How many jobs of ``queue`` are in each state (every state present, 0 included)."""
    counts = dict.fromkeys(JobState, 0)
    for state, n in (yield all_rows(_SQL["count_jobs"], {"queue": queue})):
        known = _known_state(state, int(n))
        if known is not None:
            counts[known] = int(n)
    return counts


def _known_state(state: Any, n: int) -> JobState | None:
    """The :class:`JobState` of a stored state, or None, with a warning, for one retrysafe
    never writes (a row changed by hand, its CHECK constraint dropped): such jobs are never
    claimed nor counted, where a traceback stopped the worker, `jobs list` and the console."""
    known = _STATES.get(state) if isinstance(state, str) else None
    if known is None:
        warnings.warn(
            f"{n} job(s) in a state retrysafe does not know ({str(state)[:40]!r}), written by "
            "something else: left alone (neither claimed nor counted); correct or delete them "
            "in the database",
            RetrysafeWarning,
            stacklevel=3,
        )
    return known


def job_stats(clock: Clock, *, now: float) -> Op[list[tuple[str, JobState, int, float]]]:
    """Every queue's jobs by state: ``(queue, state, count, age)`` rows, ``age`` the seconds
    since the oldest of them was created (on the store's clock: the server's on PostgreSQL,
    ``now`` on SQLite), 0.0 at least. States without jobs have no row. One statement: what
    the metrics collector reads at each scrape."""
    rows = yield all_rows(_SQL["job_stats"], {})
    out: list[tuple[str, JobState, int, float]] = []
    for queue, state, n, oldest, server_now in rows:
        at = now if server_now is None else float(server_now)
        age = 0.0 if oldest is None else max(0.0, at - float(oldest))
        known = _known_state(state, int(n))
        if known is not None:
            out.append((str(queue), known, int(n), age))
    return out


def next_due(clock: Clock, *, queue: str) -> Op[float | None]:
    """The earliest time (this host's clock) a job of ``queue`` becomes claimable, or None."""
    row = yield one(_SQL["next_due"], {"queue": queue})
    if row is None or row[0] is None:
        return None
    try:
        due = float(row[0]) if clock == "caller" else time.time() + (float(row[0]) - float(row[1]))
    except (ValueError, TypeError, OverflowError):  # a due time something else wrote
        return None
    return due if math.isfinite(due) else None  # NaN: a worker that waited for it spun


def purge_jobs(
    clock: Clock,
    *,
    queue: str,
    states: Sequence[JobState],
    before: float,
    batch: int = 1000,
    ids: Sequence[str] | None = None,
) -> Op[int]:
    """Delete jobs of ``queue`` (and their attempts) in ``states`` last changed at or before
    ``before`` (this host's clock), ``batch`` at a time; return how many. With ``ids``, only
    those jobs: an id of another queue, in another state or unknown deletes nothing.

    Raises:
        ConfigurationError: ``batch`` is not an integer >= 1.
    """
    batch = positive(batch, "batch")
    cut = caller_time(clock, before, time.time())
    params = {
        "queue": queue,
        "states": states_param(states),
        "before_at": cut["at"],
        "before_in": cut["in"],
        "batch": batch,
        "ids": None if ids is None else json.dumps(list(ids)),
    }
    total = 0
    while True:
        deleted: int = yield count(_SQL["purge_jobs"], params)
        total += deleted
        if deleted < batch:
            return total


# ---------------------------------------------------------------------- faces
class SQLOutboxStore(OnConnector):
    """:class:`~retrysafe.client.OutboxStore` on a SQL
    :class:`~retrysafe.stores._connector.Connector` (SQLite or PostgreSQL).

    Concurrency contract: see :class:`~retrysafe.client.OutboxStore`. Claims are single
    statements (PostgreSQL: ``FOR UPDATE SKIP LOCKED``); ``finish_attempt``, ``release_job``
    and ``extend_job_lease`` change a job only while it is IN_FLIGHT under the caller's lease
    token; purges delete in batches of ``batch``.

    Args:
        connector: the store's connector (``store.connector`` of a
            :class:`~retrysafe.stores.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore`).
    """

    def close(self) -> None:
        """Close the connector's connections. Idempotent."""
        self.connector.close()

    def transaction(self) -> AbstractContextManager[Any]:
        """The store's transaction (see :meth:`~retrysafe.stores.SQLiteStore.transaction`):
        yields the driver connection to pass as ``connection=`` to ``outbox.submit``."""
        return self.connector.transaction()

    def insert_job(self, job: NewJob, *, now: float, connection: Any = None) -> tuple[bool, Job]:
        """Insert ``job`` as PENDING, due ``now``: ``(True, job)``, or ``(False, existing)``
        when a job with the same key exists.

        Args:
            connection: the driver connection of an open ``store.transaction()`` of the same
                store: the job commits or rolls back with it (the transactional outbox).

        Raises:
            ConfigurationError: ``connection`` is not an open transaction of this store.
        """
        c = self.connector
        # ``insert_job`` here is the module's operation, not this method.
        return c.run(insert_job(c.clock, job, now=now), connection=connection)

    claim_jobs = sync_op(claim_jobs)
    claim_unknown_jobs = sync_op(claim_unknown_jobs)
    finish_attempt = sync_op(finish_attempt)
    finish_attempts = sync_op(finish_attempts)
    release_job = sync_op(release_job)
    extend_job_lease = sync_op(extend_job_lease)
    transition_job = sync_op(transition_job, atomic=True)  # a damaged row: nothing changes
    get_job = sync_op(get_job)
    job_ids_with_prefix = sync_op(job_ids_with_prefix)
    resolve_job_id = sync_op(resolve_job_id)
    list_jobs = sync_op(list_jobs)
    list_attempts = sync_op(list_attempts)
    count_jobs = sync_op(count_jobs)
    job_stats = sync_op(job_stats)
    next_due = sync_op(next_due)
    purge_jobs = sync_op(purge_jobs)

    def asyncio_outbox_store(self) -> AsyncSQLOutboxStore:
        """A new :class:`~retrysafe.client.AsyncOutboxStore` face (its own connection or pool,
        bound to the event loop that uses it; close it with ``aclose()``, after which it
        opens a new one if used again)."""
        return AsyncSQLOutboxStore(self.connector.async_connector())


class AsyncSQLOutboxStore(OnAsyncConnector):
    """The async face of :class:`SQLOutboxStore` (the worker's hot path): the same operations
    on an :class:`~retrysafe.stores._connector.AsyncConnector`, never blocking the event
    loop."""

    insert_job = async_op(insert_job)
    claim_jobs = async_op(claim_jobs, skippable=True)
    claim_unknown_jobs = async_op(claim_unknown_jobs, skippable=True)
    finish_attempt = async_op(finish_attempt)
    finish_attempts = async_op(finish_attempts)
    release_job = async_op(release_job)
    extend_job_lease = async_op(extend_job_lease)
    hasten_jobs = async_op(hasten_jobs)
    get_job = async_op(get_job, skippable=True)
    count_jobs = async_op(count_jobs, skippable=True)
    next_due = async_op(next_due, skippable=True)


# ---------------------------------------------------------------------- opening
def outbox_store(store: object) -> OutboxStore:
    """The outbox of ``store``: a :class:`SQLOutboxStore` on the connector of a
    :class:`~retrysafe.stores.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore` (a
    new, cheap object each call: it shares the store's connections), or ``store`` itself when
    it already is an :class:`~retrysafe.client.OutboxStore`.

    Raises:
        ConfigurationError: ``store`` has no outbox (a key store such as ``MemoryStore`` or
            ``RedisStore``, or anything else).
    """
    found: OutboxStore = feature_store(
        store,
        OutboxStore,
        SQLOutboxStore,
        "has no outbox: the outbox runs on SQLiteStore, PostgresStore or another OutboxStore",
    )
    return found


def open_outbox_store(store: StoreArg) -> tuple[OutboxStore, bool]:
    """``(outbox store, owned)``: open a URL (owned: close it when done) or take a store
    object (see :func:`outbox_store`).

    ``sqlite:///path.db`` and ``postgresql://…`` have an outbox; ``redis://`` and
    ``memory://`` are key stores only.

    Raises:
        ConfigurationError: the URL is malformed, names a missing directory, or a store
            without an outbox (``memory://``); an object without an outbox.
    """
    if not isinstance(store, str):
        return outbox_store(store), False
    from retrysafe.stores import open_store
    from retrysafe.stores._url_check import redact_url

    opened = open_store(store)
    try:
        return outbox_store(opened), True
    except ConfigurationError:
        with contextlib.suppress(Exception):
            opened.close()
        raise ConfigurationError(
            f"store {redact_url(store)!r} has no outbox; use sqlite:///path.db or postgresql://…",
            option="store",
        ) from None
