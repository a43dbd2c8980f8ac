"""What the console reads and changes, without HTML: pages of jobs and deliveries (keyset,
newest first), the overview's figures, and the actions — each action one call of the rule
that already exists (``Outbox.reconcile``/``retry``/``purge``, ``Webhooks.replay``,
``enable_endpoint``/``disable_endpoint``), never a second copy of it.

Reads go through the store's connector and the named statements of
``sql/console.<dialect>.sql``; a store that only holds idempotency keys (Redis, or a SQL store
opened for keys only) offers the keys page alone (:attr:`Console.has_outbox` is False).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from retrysafe._exceptions import (
    ConfigurationError,
    EndpointNotFoundError,
    JobError,
    JobNotFoundError,
    StoreError,
    WebhookError,
)
from retrysafe.client._models import Attempt, Job, JobState
from retrysafe.client._store import JOB_COLUMNS, JOB_READS, readable_jobs, states_param
from retrysafe.stores._connector import Op, Statements, all_rows, before_user_write

__all__ = [
    "DEAD_LETTER_STATES",
    "WEBHOOK_QUEUE",
    "ActionResult",
    "Console",
    "JobFilter",
    "Position",
    "page_jobs",
]

#: The dead letters of the outbox: what reconcile and purge act on.
DEAD_LETTER_STATES = (JobState.UNKNOWN, JobState.REJECTED)
#: The queue of webhook deliveries: replayed from the webhooks pages (the delivery is signed
#: per attempt), never reconciled as a plain outbox job.
WEBHOOK_QUEUE = "webhooks"
#: Items left alone that an action's log line names (the rest are counted).
LOGGED_UNCHANGED = 20
#: The overview chart: the last hour in buckets of five minutes.
CHART_SECONDS = 3600.0
CHART_BUCKET = 300.0

_SQL = Statements(
    "retrysafe.ui",
    "console",
    columns={"job_columns": JOB_COLUMNS},
    reads=JOB_READS,
    lenient=["job_columns"],
)


@dataclass(frozen=True)
class Position:
    """A keyset position: the ``(created_at, id)`` of the last row of a page. The next page
    holds the rows that sort after it (newest first), whatever was inserted meanwhile."""

    created_at: float
    id: str

    def token(self) -> str:
        """The position as a query-string value: ``<created_at>_<id>``."""
        return f"{self.created_at!r}_{self.id}"


@dataclass(frozen=True)
class JobFilter:
    """The jobs page's filters (every field optional but ``queue``).

    Attributes:
        queue: the queue walked (every index a worker uses starts with it).
        states: only these states (empty: all).
        host, port: the destination's host name (lower case; an IPv6 literal without
            brackets) and, when given, its port (else any port).
        since, until: created at or after ``since`` and before ``until`` (Unix seconds).
    """

    queue: str = "default"
    states: tuple[JobState, ...] = ()
    host: str | None = None
    port: int | None = None
    since: float | None = None
    until: float | None = None

    @property
    def host_text(self) -> str | None:
        """The host filter as typed back into the form (``[::1]:9000``)."""
        if self.host is None:
            return None
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port is None else f"{name}:{self.port}"


def _after(after: Position | None) -> dict[str, Any]:
    """The keyset position's parameters; the first page's is (+inf, ""), before every row,
    so each page is the same single index seek."""
    if after is None:
        return {"after_at": math.inf, "after_id": ""}
    return {"after_at": after.created_at, "after_id": after.id}


def _host_params(host: str | None, port: int | None) -> dict[str, Any]:
    """The host filter as the statement compares it with the destination's authority
    (``host:port``): exactly, or its start ``host:`` (any port)."""
    if host is None:
        return {"host": None, "host_exact": False}
    if port is None:
        return {"host": host + ":", "host_exact": False}
    return {"host": f"{host}:{port}", "host_exact": True}


def page_jobs(clock: Any, f: JobFilter, *, limit: int, after: Position | None) -> Op[list[Job]]:
    """One page of jobs (newest first) of ``f.queue`` matching ``f``, after ``after``."""
    params = {
        "queue": f.queue,
        "states": states_param(list(f.states)) if f.states else None,
        "since": f.since,
        "until": f.until,
        **_after(after),
        "limit": limit,
        **_host_params(f.host, f.port),
    }
    rows = yield all_rows(_SQL["page_jobs"], params)
    return readable_jobs(rows)


def _attempt_buckets(clock: Any, *, since: float, width: float) -> Op[list[tuple[int, str, int]]]:
    rows = yield all_rows(_SQL["attempt_buckets"], {"since": since, "width": width})
    return [(int(b), str(o), int(n)) for b, o, n in rows]


def _page_deliveries(
    clock: Any,
    *,
    endpoint_id: str | None,
    states: Sequence[JobState] | None,
    limit: int,
    after: Position | None,
) -> Op[list[Any]]:
    from retrysafe.webhooks._store import delivery_from_row

    params = {
        "endpoint_id": endpoint_id,
        "states": states_param(list(states)) if states else None,
        **_after(after),
        "limit": limit,
    }
    rows = yield all_rows(_SQL["page_deliveries"], params)
    return [delivery_from_row(r) for r in rows]


def _queues(clock: Any) -> Op[list[Any]]:
    rows: list[Any] = yield all_rows(_SQL["queues"], {})
    return rows


def _dead_deliveries(clock: Any, *, limit: int, after: Position | None) -> Op[list[Any]]:
    from retrysafe.webhooks._store import delivery_from_row

    params = {
        "states": states_param(list(DEAD_LETTER_STATES)),
        **_after(after),
        "limit": limit,
    }
    rows = yield all_rows(_SQL["dead_deliveries"], params)
    return [delivery_from_row(r) for r in rows]


def _page_agent_runs(clock: Any, *, limit: int, after: Position | None) -> Op[list[Any]]:
    from retrysafe.agents._store import run_from_row

    rows = yield all_rows(_SQL["page_agent_runs"], {**_after(after), "limit": limit})
    return [run_from_row(r) for r in rows]


@dataclass
class ActionResult:
    """What one action did, per item: ``changed`` ``(id, before, after)`` rows, ``unchanged``
    ``(id, why)`` rows (a second submit of the same action lands here), and ``error`` when
    the store failed part way (the items before it are in ``changed``; none is half-done:
    each item's change is one atomic store operation)."""

    action: str
    changed: list[tuple[str, str, str]] = field(default_factory=list)
    unchanged: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None

    def to_log(self) -> dict[str, Any]:
        """The action as the log line records it: every change, and the first
        :data:`LOGGED_UNCHANGED` items left alone with their count (a no-op of 500 ids must
        not make a 40 KB line)."""
        return {
            "action": self.action,
            "changed": [{"id": i, "from": a, "to": b} for i, a, b in self.changed],
            "unchanged": [{"id": i, "why": w} for i, w in self.unchanged[:LOGGED_UNCHANGED]],
            "unchanged_count": len(self.unchanged),
            "error": self.error,
        }


class Console:
    """The console's view of one store.

    Args:
        store: a store object (:class:`~retrysafe.SQLiteStore`,
            :class:`~retrysafe.stores.PostgresStore`, :class:`~retrysafe.stores.RedisStore`
            …); the console never closes it (whoever opened it does).
        reconcile_timeout: seconds per reconcile attempt.
        clock: Unix-seconds clock.
    """

    def __init__(
        self,
        store: Any,
        *,
        reconcile_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from retrysafe.stores._base import KeyAdmin

        self.store = store
        self.clock = clock
        self.reconcile_timeout = float(reconcile_timeout)
        connector = getattr(store, "connector", None)
        self.connector = connector if hasattr(connector, "run") else None
        self.has_outbox = self.connector is not None
        #: The store's clock kind, which every operation takes first.
        self.kind: Any = getattr(self.connector, "clock", "caller")
        self.has_keys = isinstance(store, KeyAdmin)

    # ------------------------------------------------------------------ reads
    def _run(self, op: Op[Any]) -> Any:
        if self.connector is None:
            raise ConfigurationError("this store holds idempotency keys only", option="store")
        return self.connector.run(op)

    def queues(self) -> list[str]:
        """Every queue that holds a job, ``default`` first (one index seek per queue)."""
        found = {str(q) for (q,) in self._run(_queues(self.kind))}
        found.add("default")
        return sorted(found, key=lambda q: (q != "default", q))

    def stats(self) -> list[tuple[str, JobState, int, float]]:
        """``(queue, state, count, age of the oldest)`` rows (see ``job_stats``)."""
        from retrysafe.client._store import job_stats

        rows: list[tuple[str, JobState, int, float]] = self._run(
            job_stats(self.kind, now=self.clock())
        )
        return rows

    def chart(self, now: float) -> list[dict[str, int]]:
        """Attempts of the last hour per five-minute bucket: a dict of outcome → count per
        bucket, oldest bucket first (twelve of them)."""
        since = now - CHART_SECONDS
        n = int(CHART_SECONDS // CHART_BUCKET)
        buckets: list[dict[str, int]] = [{} for _ in range(n)]
        rows = self._run(_attempt_buckets(self.kind, since=since, width=CHART_BUCKET))
        for b, outcome, count in rows:
            if 0 <= b < n:
                buckets[b][outcome] = buckets[b].get(outcome, 0) + count
        return buckets

    def jobs(self, f: JobFilter, *, limit: int, after: Position | None) -> list[Job]:
        """One page of jobs (see :func:`page_jobs`)."""
        jobs: list[Job] = self._run(page_jobs(self.kind, f, limit=limit, after=after))
        return jobs

    def job(self, job_id: str) -> Job | None:
        """The job ``job_id`` (a full id), or None."""
        from retrysafe.client._store import get_job

        job: Job | None = self._run(get_job(self.kind, job_id))
        return job

    def before_action(self) -> None:
        """Before an action writes: a SQLite store's connections compare their file with the
        path at their next use (a file deleted a moment ago is a 503, never a change written
        into the unlinked file)."""
        before_user_write(self.store)

    def jobs_with_prefix(self, prefix: str, queue: str | None) -> list[str]:
        """Up to two ids of jobs whose id starts with ``prefix`` (the short ids the lists
        show), in ``queue`` or, when None, in any queue: none, the one, or two of an
        ambiguous prefix."""
        from retrysafe.client._store import job_ids_with_prefix

        found: list[str] = []
        for q in [queue] if queue is not None else self.queues():
            found += self._run(job_ids_with_prefix(self.kind, prefix, queue=q))
            if len(found) > 1:
                break
        return found[:2]

    def attempts(self, job_id: str) -> list[Attempt]:
        from retrysafe.client._store import list_attempts

        found: list[Attempt] = self._run(list_attempts(self.kind, job_id))
        return found

    def deliveries(
        self,
        *,
        endpoint_id: str | None,
        states: Sequence[JobState] | None,
        limit: int,
        after: Position | None,
    ) -> list[Any]:
        """One page of webhook deliveries, newest first."""
        found: list[Any] = self._run(
            _page_deliveries(
                self.kind, endpoint_id=endpoint_id, states=states, limit=limit, after=after
            )
        )
        return found

    def dead_deliveries(self, *, limit: int, after: Position | None) -> list[Any]:
        """One page of the webhook dead-letter queue, newest first."""
        found: list[Any] = self._run(_dead_deliveries(self.kind, limit=limit, after=after))
        return found

    @contextmanager
    def webhooks(self) -> Iterator[Any]:
        from retrysafe.webhooks import Webhooks

        # allow_private: the console replays and re-enables what an operator registered; it
        # sends nothing itself (a webhook worker does, with its own SSRF guard).
        hooks = Webhooks(self.store, allow_private=True, clock=self.clock)
        try:
            yield hooks
        finally:
            hooks.close()

    @contextmanager
    def outbox(self, queue: str) -> Iterator[Any]:
        """The outbox of ``queue`` on the console's store (retry and purge; reconcile runs
        :func:`~retrysafe.client.areconcile` itself)."""
        from retrysafe.client import Outbox

        box = Outbox(self.store, queue=queue, clock=self.clock)
        try:
            yield box
        finally:
            box.close()

    def agent_runs(self, *, limit: int, after: Position | None = None) -> list[Any]:
        """One page of agent runs (newest first) after ``after``, with their call counts."""
        found: list[Any] = self._run(_page_agent_runs(self.kind, limit=limit, after=after))
        return found

    def agent_run(self, run_id: str) -> tuple[Any, list[Any]] | None:
        from retrysafe.agents._store import get_agent_run, list_agent_calls

        run = self._run(get_agent_run(self.kind, run_id))
        if run is None:
            return None
        return run, self._run(list_agent_calls(self.kind, run_id))

    # ------------------------------------------------------------------ actions
    def _jobs_in(self, queue: str, ids: Sequence[str], result: ActionResult) -> list[Job]:
        """The jobs of ``ids`` that exist in ``queue``; the others go to ``unchanged``."""
        found = []
        for job_id in ids:
            job = self.job(job_id)
            if job is None:
                result.unchanged.append((job_id, "no such job (purged already?)"))
            elif job.queue != queue:
                result.unchanged.append((job_id, f"belongs to queue {job.queue!r}, not {queue!r}"))
            else:
                found.append(job)
        return found

    async def reconcile(self, queue: str, ids: Sequence[str]) -> ActionResult:
        """Re-send the UNKNOWN jobs of ``ids`` with their same key
        (:func:`~retrysafe.client.areconcile`, on the caller's event loop: a console stopped
        mid-attempt cancels it, and a cancelled attempt gives its job back as UNKNOWN); a job
        that is not UNKNOWN (a second submit) is left alone, saying so."""
        from retrysafe.client import RetryPolicy, areconcile

        result = ActionResult("reconcile")
        todo: list[str] = []
        try:
            jobs = await run_in_threadpool(self._jobs_in, queue, ids, result)
            for job in jobs:
                if job.state is JobState.UNKNOWN:
                    todo.append(job.id)
                else:
                    result.unchanged.append((job.id, f"is {job.state.value}, not unknown"))
            if todo:
                report = await areconcile(
                    self.store,
                    policy=RetryPolicy(attempts=1, timeout=self.reconcile_timeout),
                    ids=todo,
                    limit=len(todo),
                    concurrency=8,
                    queue=queue,
                    clock=self.clock,
                )
                after = {j.id: j for j in report.jobs}
                for job_id in todo:
                    done = after.get(job_id)
                    if done is None:
                        result.unchanged.append((job_id, "taken by another worker meanwhile"))
                    elif done.state is JobState.UNKNOWN:
                        result.unchanged.append(
                            (job_id, "still unknown: no definitive answer (attempt recorded)")
                        )
                    else:
                        result.changed.append((job_id, "unknown", done.state.value))
        except StoreError as exc:
            result.error = str(exc)
        except asyncio.CancelledError:
            # The console is stopping (SIGINT, SIGTERM) while attempts run: every job whose
            # attempt had not ended is back to UNKNOWN. The page and the action's log line
            # say so, and list the jobs that did settle (read now, in this thread: the event
            # loop is stopping), instead of a bare 500 and no record of the action at all.
            for job_id in todo:
                with suppress(StoreError):
                    done = self.job(job_id)
                    if done is not None and done.state not in (
                        JobState.UNKNOWN,
                        JobState.IN_FLIGHT,
                    ):
                        result.changed.append((job_id, "unknown", done.state.value))
            result.error = (
                "the console was stopped during this reconcile: the jobs listed as changed "
                "settled, every other one is back to UNKNOWN"
            )
        return result

    def retry(self, queue: str, ids: Sequence[str]) -> ActionResult:
        """Put the dead letters of ``ids`` back to PENDING with their same key
        (``Outbox.retry``: a worker sends them)."""
        result = ActionResult("retry")
        try:
            jobs = self._jobs_in(queue, ids, result)
            with self.outbox(queue) as box:
                for job in jobs:
                    try:
                        done = box.retry(job.id)
                    except JobNotFoundError:
                        result.unchanged.append((job.id, "no such job (purged already?)"))
                    except JobError:
                        result.unchanged.append((job.id, f"is {job.state.value}: not retried"))
                    else:
                        result.changed.append((job.id, job.state.value, done.state.value))
        except StoreError as exc:
            result.error = str(exc)
        return result

    def purge(self, queue: str, ids: Sequence[str]) -> ActionResult:
        """Delete the dead letters of ``ids`` and their attempts, in one statement
        (``Outbox.purge``): all of them or, if the store fails, none."""
        result = ActionResult("purge")
        try:
            jobs = self._jobs_in(queue, ids, result)
            dead = [j for j in jobs if j.state in DEAD_LETTER_STATES]
            for j in jobs:
                if j.state not in DEAD_LETTER_STATES:
                    result.unchanged.append((j.id, f"is {j.state.value}, not a dead letter"))
            if dead:
                with self.outbox(queue) as box:
                    box.purge(states=DEAD_LETTER_STATES, ids=[j.id for j in dead])
                for j in dead:
                    if self.job(j.id) is None:
                        result.changed.append((j.id, j.state.value, "purged"))
                    else:
                        result.unchanged.append((j.id, "changed meanwhile: not purged"))
        except StoreError as exc:
            result.error = str(exc)
        return result

    def replay_deliveries(self, ids: Sequence[str]) -> ActionResult:
        """Re-queue webhook dead letters with their same ``webhook-id`` (``Webhooks.replay``);
        a webhook worker delivers them."""
        result = ActionResult("replay")
        try:
            with self.webhooks() as hooks:
                for delivery_id in ids:
                    try:
                        before = hooks.dispatcher.delivery(delivery_id)
                        done = hooks.replay([delivery_id])
                    except JobNotFoundError:
                        result.unchanged.append((delivery_id, "no such delivery"))
                    except WebhookError as exc:
                        result.unchanged.append((delivery_id, str(exc)))
                    else:
                        if done:
                            result.changed.append(
                                (delivery_id, before.state.value, done[0].state.value)
                            )
                        else:
                            result.unchanged.append((delivery_id, "changed meanwhile"))
        except StoreError as exc:
            result.error = str(exc)
        return result

    def set_endpoint(self, endpoint_id: str, *, enabled: bool, reason: str) -> ActionResult:
        """Enable or disable an endpoint (``Webhooks.enable_endpoint`` /
        ``disable_endpoint``); the same state again is a no-op, saying so."""
        result = ActionResult("enable" if enabled else "disable")
        try:
            with self.webhooks() as hooks:
                try:
                    before = hooks.get_endpoint(endpoint_id)
                except EndpointNotFoundError as exc:
                    why = (
                        "several endpoints have ids starting with it: give more of the id"
                        if "ambiguous" in str(exc)
                        else "no such endpoint"
                    )
                    result.unchanged.append((endpoint_id, why))
                    return result
                if before.enabled == enabled:
                    result.unchanged.append(
                        (before.id, "enabled already" if enabled else "disabled already")
                    )
                    return result
                if enabled:
                    hooks.enable_endpoint(before.id)
                else:
                    hooks.disable_endpoint(before.id, reason)
                result.changed.append(
                    (
                        before.id,
                        "enabled" if before.enabled else "disabled",
                        "enabled" if enabled else "disabled",
                    )
                )
        except StoreError as exc:
            result.error = str(exc)
        return result
