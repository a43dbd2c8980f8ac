"""The webhook store on SQL, written once for SQLite and PostgreSQL (SPEC §6, §9).

Endpoints, events and deliveries live next to the outbox jobs that carry the deliveries (queue
``"webhooks"``), on the same :mod:`connector <retrysafe.stores._connector>`. Every write that
changes more than one row kind is one atomic operation: recording an event inserts the event,
its outbox jobs (the outbox's own ``insert_job`` operation, delegated to) and its delivery rows
in one transaction; disabling an endpoint parks its pending deliveries with it; a new URL
retargets the unfinished deliveries with it; deleting an endpoint deletes its jobs with it.
The statements live in ``sql/webhooks.<dialect>.sql``; the functions here only bind parameters
and convert rows, and hold no policy (who is disabled when, what matches, what is replayed:
:mod:`retrysafe.webhooks`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import Any

from retrysafe._batch import Batcher
from retrysafe._exceptions import StoreError
from retrysafe.client._jobs import destination_of
from retrysafe.client._models import Attempt, Finish, JobState, NewJob, OutboxStore
from retrysafe.client._policy import count as positive
from retrysafe.client._store import (
    AsyncSQLOutboxStore,
    SQLOutboxStore,
    finish_attempts,
    insert_job,
    states_param,
)
from retrysafe.stores._connector import (
    AsyncConnector,
    Clock,
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
from retrysafe.webhooks._models import (
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookStore,
)
from retrysafe.webhooks._policy import ends_failure_run

__all__ = ["AsyncSQLWebhookStore", "SQLWebhookStore", "delivery_from_row", "webhook_store"]

#: The columns every statement returning a row reads, in the order the row converter
#: unpacks them (``{endpoint_columns}`` in the statement files).
ENDPOINT_COLUMNS = (
    "id",
    "url",
    "secrets",
    "event_types",
    "description",
    "schedule",
    "rate_limit",
    "enabled",
    "disabled_reason",
    "failure_count",
    "first_failure_at",
    "created_at",
    "updated_at",
)

_SQL = Statements("retrysafe.webhooks", "webhooks", columns={"endpoint_columns": ENDPOINT_COLUMNS})


# ---------------------------------------------------------------------- rows
def _endpoint(row: Sequence[Any]) -> WebhookEndpoint:
    """The endpoint of a row of :data:`ENDPOINT_COLUMNS`. Every read still goes to the store;
    only the decoding of a row equal to one decoded lately is not repeated (the worker reads
    each delivery's endpoint twice, and a few endpoints serve many deliveries: ~5.7 µs each
    on this project's machine, ~0.1 µs from the cache)."""
    return _decoded_endpoint(tuple(row))


@functools.lru_cache(maxsize=256)
def _decoded_endpoint(row: tuple[Any, ...]) -> WebhookEndpoint:
    (id_, url, secrets, types, desc, schedule, rate_limit, enabled, reason) = row[:9]
    failures, first, created, updated = row[9:]
    return WebhookEndpoint(
        id=id_,
        url=url,
        secrets=tuple((str(s), None if e is None else float(e)) for s, e in json.loads(secrets)),
        event_types=tuple(str(t) for t in json.loads(types)),
        description=desc,
        schedule=schedule,
        rate_limit=None if rate_limit is None else float(rate_limit),
        enabled=bool(enabled),
        disabled_reason=reason,
        failure_count=int(failures),
        first_failure_at=None if first is None else float(first),
        created_at=float(created),
        updated_at=float(updated),
    )


def _delivery(row: Sequence[Any]) -> WebhookDelivery:
    (job_id, event_id, etype, endpoint_id, url, state, attempts, sends, status, outcome) = row[:10]
    error, due_at, created, updated = row[10:]
    return WebhookDelivery(
        id=job_id,
        event_id=event_id,
        event_type=etype,
        endpoint_id=endpoint_id,
        url=url,
        state=JobState(state),
        attempts=int(attempts),
        sends=int(sends),
        last_status=None if status is None else int(status),
        last_outcome=outcome,
        last_error=error,
        due_at=float(due_at),
        created_at=float(created),
        updated_at=float(updated),
    )


#: A :class:`WebhookDelivery` from a row of the delivery columns (the console's pages).
delivery_from_row = _delivery


def _event(row: Sequence[Any]) -> WebhookEvent:
    return WebhookEvent(
        id=row[0], event_type=row[1], payload=bytes(row[2]), created_at=float(row[3])
    )


def _endpoint_params(clock: Clock, e: WebhookEndpoint, now: float) -> dict[str, Any]:
    return {
        "id": e.id,
        "url": e.url,
        "secrets": json.dumps([[s, exp] for s, exp in e.secrets]),
        "event_types": json.dumps(list(e.event_types)),
        "description": e.description,
        "schedule": e.schedule,
        "rate_limit": e.rate_limit,
        "enabled": bool(e.enabled),
        "disabled_reason": e.disabled_reason,
        "now": caller_now(clock, now),
    }


def _ids(ids: Sequence[str] | None) -> str | None:
    return None if ids is None else json.dumps(list(ids))


# ---------------------------------------------------------------------- operations
def insert_endpoint(clock: Clock, endpoint: WebhookEndpoint) -> Op[WebhookEndpoint]:
    row = yield one(_SQL["insert_endpoint"], _endpoint_params(clock, endpoint, endpoint.created_at))
    return _endpoint(row)


def get_endpoint(clock: Clock, endpoint_id: str) -> Op[WebhookEndpoint | None]:
    row = yield one(_SQL["get_endpoint"], {"id": endpoint_id})
    return None if row is None else _endpoint(row)


def get_endpoints(clock: Clock, ids: Sequence[str]) -> Op[dict[str, WebhookEndpoint]]:
    """The endpoints of ``ids`` that exist, by id (one statement for many)."""
    rows = yield all_rows(_SQL["get_endpoints"], {"ids": _ids(ids)})
    return {e.id: e for e in map(_endpoint, rows)}


def list_endpoints(clock: Clock) -> Op[list[WebhookEndpoint]]:
    rows = yield all_rows(_SQL["list_endpoints"], {})
    return [_endpoint(r) for r in rows]


def update_endpoint(
    clock: Clock, endpoint: WebhookEndpoint, *, now: float, retarget: bool
) -> Op[WebhookEndpoint | None]:
    params = _endpoint_params(clock, endpoint, now)
    row = yield one(_SQL["update_endpoint"], params)
    if row is None:
        return None
    if retarget:
        params["destination"] = destination_of(endpoint.url)
        yield count(_SQL["retarget_endpoint_jobs"], params)
    return _endpoint(row)


def set_endpoint_enabled(
    clock: Clock,
    endpoint_id: str,
    *,
    enabled: bool,
    reason: str | None,
    now: float,
    only_if_enabled: bool = False,
) -> Op[WebhookEndpoint | None]:
    params = {
        "id": endpoint_id,
        "enabled": bool(enabled),
        "reason": reason,
        "now": caller_now(clock, now),
        "only_if_enabled": bool(only_if_enabled),
    }
    row = yield one(_SQL["set_endpoint_enabled"], params)
    if row is None:
        return None
    if not enabled:
        params["reason"] = f"endpoint disabled: {reason}"
        yield count(_SQL["cancel_endpoint_jobs"], params)
    return _endpoint(row)


def record_endpoint_failure(
    clock: Clock, endpoint_id: str, *, now: float
) -> Op[tuple[int, float | None, bool] | None]:
    params = {"id": endpoint_id, "now": caller_now(clock, now)}
    row = yield one(_SQL["record_endpoint_failure"], params)
    if row is None:
        return None
    return int(row[0]), None if row[1] is None else float(row[1]), bool(row[2])


def reset_endpoint_failures(clock: Clock, endpoint_id: str) -> Op[None]:
    yield count(_SQL["reset_endpoint_failures"], {"id": endpoint_id})


def finish_deliveries(clock: Clock, finishes: Sequence[Finish]) -> Op[list[Attempt | None]]:
    """The webhook worker's record of a batch of attempts: the outbox's
    :func:`~retrysafe.client._store.finish_attempts`, then, in the same transaction (run it
    atomic), the end of the failure run of the endpoint of every recorded 2xx
    (:func:`ends_failure_run`) that has one: one statement for the batch, decided by the
    store after the answers, whichever worker recorded the run (SPEC §6). A success is
    never recorded without its run's end: should that statement fail, nothing of the batch
    is written and the error is the record's (a locked SQLite file waits, as any record
    does; the worker sends the deliveries again, with their same ``webhook-id``).
    """
    recorded = yield from finish_attempts(clock, finishes)
    ends = [a.job_id for a in recorded if a is not None and ends_failure_run(a.outcome)]
    if ends:
        yield count(_SQL["end_delivery_runs"], {"ids": _ids(sorted(ends))})
    return recorded


def delete_endpoint(clock: Clock, endpoint_id: str) -> Op[bool]:
    yield count(_SQL["delete_endpoint_jobs"], {"id": endpoint_id})
    deleted: int = yield count(_SQL["delete_endpoint"], {"id": endpoint_id})
    return deleted == 1


def insert_event(
    clock: Clock,
    event: WebhookEvent,
    deliveries: Sequence[tuple[NewJob, str, bool]],
    *,
    now: float,
) -> Op[tuple[bool, WebhookEvent]]:
    at = caller_now(clock, now)
    params = {"id": event.id, "event_type": event.event_type, "payload": event.payload, "now": at}
    # On the caller's clock the event as stored is known without reading it back (its time
    # is this ``now``): RETURNING costs SQLite an ephemeral table per statement.
    stored: WebhookEvent
    if clock == "caller" and (yield count(_SQL["add_event"], params)):
        stored = WebhookEvent(
            id=event.id,
            event_type=event.event_type,
            payload=bytes(event.payload),
            created_at=float(now),
        )
    else:
        row = yield one(_SQL["insert_event"], params)
        if row is None:
            existing = yield one(_SQL["get_event"], {"id": event.id})
            if existing is None:  # deleted between the two statements: nothing to return
                raise StoreError(f"event {event.id!r} vanished while it was recorded")
            return False, _event(existing)
        stored = _event(row)
    for job, endpoint_id, parked in deliveries:
        created, stored_job = yield from insert_job(clock, job, now=now)
        if not created:
            # Raising rolls the whole event back: nothing is half-recorded.
            raise StoreError(f"delivery key {job.key!r} is already used by job {stored_job.id}")
        delivery = {"job_id": stored_job.id, "event_id": event.id, "endpoint_id": endpoint_id}
        yield count(_SQL["insert_delivery"], {**delivery, "now": at})
        if parked:
            yield count(_SQL["park_job"], {"id": stored_job.id, "now": at})
    return True, stored


def get_event(clock: Clock, event_id: str) -> Op[WebhookEvent | None]:
    row = yield one(_SQL["get_event"], {"id": event_id})
    return None if row is None else _event(row)


def delivery_context(clock: Clock, job_id: str) -> Op[tuple[str, WebhookEndpoint] | None]:
    row = yield one(_SQL["delivery_context"], {"job_id": job_id})
    return None if row is None else (str(row[0]), _endpoint(row[1:]))


def delivery_contexts(
    clock: Clock, job_ids: Sequence[str]
) -> Op[dict[str, tuple[str, WebhookEndpoint]]]:
    """:func:`delivery_context` of each of ``job_ids`` that is a delivery, by job id (one
    statement for many)."""
    rows = yield all_rows(_SQL["delivery_contexts"], {"ids": _ids(job_ids)})
    return {str(r[0]): (str(r[1]), _endpoint(r[2:])) for r in rows}


def list_deliveries(
    clock: Clock,
    *,
    event_id: str | None = None,
    endpoint_id: str | None = None,
    event_type: str | None = None,
    states: Sequence[JobState] | None = None,
    ids: Sequence[str] | None = None,
    limit: int = 100,
) -> Op[list[WebhookDelivery]]:
    params = {
        "event_id": event_id,
        "endpoint_id": endpoint_id,
        "event_type": event_type,
        "states": states_param(states),
        "job_ids": _ids(ids),
        "limit": limit,
    }
    rows = yield all_rows(_SQL["list_deliveries"], params)
    return [_delivery(r) for r in rows]


def delivery_ids_with_prefix(clock: Clock, prefix: str) -> Op[list[str]]:
    """Up to two delivery ids starting with ``prefix`` (compared literally), in id order."""
    rows = yield all_rows(_SQL["find_delivery_by_prefix"], {"prefix": prefix})
    return [str(r[0]) for r in rows]


def purge_deliveries(
    clock: Clock,
    *,
    states: Sequence[JobState],
    before: float,
    endpoint_id: str | None = None,
    event_type: str | None = None,
    batch: int = 1000,
) -> Op[int]:
    batch = positive(batch, "batch")
    cut = caller_time(clock, before, time.time())
    params = {
        "states": states_param(states),
        "before_at": cut["at"],
        "before_in": cut["in"],
        "endpoint_id": endpoint_id,
        "event_type": event_type,
        "batch": batch,
    }
    total = 0
    while True:
        deleted: int = yield count(_SQL["purge_deliveries"], params)
        total += deleted
        if deleted < batch:
            return total


# ---------------------------------------------------------------------- faces
class SQLWebhookStore(OnConnector):
    """:class:`~retrysafe.webhooks.WebhookStore` on a SQL
    :class:`~retrysafe.stores._connector.Connector` (the connector of a
    :class:`~retrysafe.stores.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore`, shared
    with the outbox that carries the deliveries).

    Concurrency contract: see :class:`~retrysafe.webhooks.WebhookStore`. It does not own the
    connector: closing the store it came from closes it.
    """

    insert_endpoint = sync_op(insert_endpoint)
    get_endpoint = sync_op(get_endpoint)
    list_endpoints = sync_op(list_endpoints)
    update_endpoint = sync_op(update_endpoint, atomic=True)
    set_endpoint_enabled = sync_op(set_endpoint_enabled, atomic=True)
    record_endpoint_failure = sync_op(record_endpoint_failure)
    reset_endpoint_failures = sync_op(reset_endpoint_failures)
    delete_endpoint = sync_op(delete_endpoint, atomic=True)
    insert_event = sync_op(insert_event, atomic=True)
    get_event = sync_op(get_event)
    delivery_context = sync_op(delivery_context)
    list_deliveries = sync_op(list_deliveries)
    delivery_ids_with_prefix = sync_op(delivery_ids_with_prefix)
    purge_deliveries = sync_op(purge_deliveries)

    def asyncio_webhook_store(self) -> AsyncSQLWebhookStore:
        """A new :class:`~retrysafe.webhooks.AsyncWebhookStore` face (its own connection or
        pool, bound to the event loop that first uses it; close it with ``aclose()``)."""
        return AsyncSQLWebhookStore(self.connector.async_connector())


class AsyncSQLWebhookStore(OnAsyncConnector):
    """The async face of :class:`SQLWebhookStore`: what the webhook worker's hooks read and
    write per attempt, on an :class:`~retrysafe.stores._connector.AsyncConnector`.

    :meth:`get_endpoint` and :meth:`delivery_context` are batched (:mod:`retrysafe._batch`):
    what concurrent attempts ask for together is one statement (a worker at concurrency 32
    sent dozens of one-row statements where a few do). The webhook worker ends failure runs
    with its records (:class:`DeliveryOutboxStore`), not here.
    """

    _get_endpoints = async_op(get_endpoints, skippable=True)
    _delivery_contexts = async_op(delivery_contexts, skippable=True)
    set_endpoint_enabled = async_op(set_endpoint_enabled, atomic=True)
    record_endpoint_failure = async_op(record_endpoint_failure)
    reset_endpoint_failures = async_op(reset_endpoint_failures)

    def __init__(self, connector: AsyncConnector) -> None:
        super().__init__(connector)
        self._endpoints: Batcher[str, WebhookEndpoint | None] = Batcher(self._endpoints_of)
        self._contexts: Batcher[str, tuple[str, WebhookEndpoint] | None] = Batcher(
            self._contexts_of
        )

    async def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint | None:
        """The endpoint as stored now, or None (read with the others asked for together)."""
        return await self._endpoints.submit(endpoint_id)

    async def delivery_context(self, job_id: str) -> tuple[str, WebhookEndpoint] | None:
        """``(event_id, endpoint)`` of the delivery that is job ``job_id``, or None (read
        with the others asked for together)."""
        return await self._contexts.submit(job_id)

    async def _endpoints_of(self, ids: list[str]) -> list[WebhookEndpoint | None]:
        found = await self._get_endpoints(sorted(set(ids)))
        return [found.get(i) for i in ids]

    async def _contexts_of(self, job_ids: list[str]) -> list[tuple[str, WebhookEndpoint] | None]:
        found = await self._delivery_contexts(sorted(set(job_ids)))
        return [found.get(i) for i in job_ids]


class DeliveryOutboxStore(SQLOutboxStore):
    """The webhook worker's outbox store: :class:`~retrysafe.client._store.SQLOutboxStore`
    whose batch record, :meth:`finish_attempts`, also ends the failure run of the endpoint of
    each 2xx (:func:`finish_deliveries`): the run ends with the record, not in a write of its
    own after it (a second transaction per batch of successes). Atomic: a record that had
    committed before a failed end would be run again whole, and come back as leases lost."""

    finish_attempts = sync_op(finish_deliveries, atomic=True)

    def asyncio_outbox_store(self) -> AsyncDeliveryOutboxStore:
        return AsyncDeliveryOutboxStore(self.connector.async_connector())


class AsyncDeliveryOutboxStore(AsyncSQLOutboxStore):
    """The async face of :class:`DeliveryOutboxStore` (the webhook worker's hot path)."""

    finish_attempts = async_op(finish_deliveries, atomic=True)


def delivery_outbox(store: OutboxStore) -> tuple[OutboxStore, bool]:
    """``(store, ends runs)``: the outbox store the webhook worker records on, and whether
    its records end failure runs themselves. A :class:`SQLOutboxStore` becomes a
    :class:`DeliveryOutboxStore` on the same connector (True); any other outbox store (one of
    one's own, beside one's own :class:`~retrysafe.webhooks.WebhookStore`) is kept, and each
    2xx ends the run with ``reset_endpoint_failures`` after its record (False)."""
    if type(store) is SQLOutboxStore:
        return DeliveryOutboxStore(store.connector), True
    return store, False


def webhook_store(store: object) -> WebhookStore:
    """The :class:`~retrysafe.webhooks.WebhookStore` of ``store``: itself when it is one, else
    a :class:`SQLWebhookStore` on its SQL connector (``SQLiteStore``, ``PostgresStore``, or an
    outbox store on one of them).

    Raises:
        ConfigurationError: the store keeps no webhook tables (Redis, memory, …).
    """
    found: WebhookStore = feature_store(
        store,
        WebhookStore,
        SQLWebhookStore,
        "has no webhook tables; webhooks need SQLite (sqlite:///path.db) or "
        "PostgreSQL (postgresql://…)",
    )
    return found
