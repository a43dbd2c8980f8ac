"""The webhooks half of :class:`~retrysafe.stores.SQLiteStore` (SPEC §6, §9).

Endpoints, events and deliveries live next to the outbox jobs that carry the deliveries.
Every multi-statement write is one ``BEGIN IMMEDIATE`` … ``COMMIT``, so nothing is ever
half-recorded. Statements live in ``sql/sqlite.sql``; the functions here only bind
parameters and convert rows.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from retrysafe.client._models import JobState, NewJob
from retrysafe.stores._sql import queries
from retrysafe.stores._sqlite_outbox import _insert_job, _states
from retrysafe.webhooks._models import WebhookDelivery, WebhookEndpoint, WebhookEvent

__all__ = ["SQLiteWebhooksMixin"]

_T = TypeVar("_T")
_Q = queries("sqlite")


def _row_to_endpoint(row: Sequence[Any]) -> WebhookEndpoint:
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


def _row_to_delivery(row: Sequence[Any]) -> WebhookDelivery:
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


def _row_to_event(row: Sequence[Any]) -> WebhookEvent:
    return WebhookEvent(
        id=row[0], event_type=row[1], payload=bytes(row[2]), created_at=float(row[3])
    )


def _endpoint_params(e: WebhookEndpoint) -> dict[str, Any]:
    return {
        "id": e.id,
        "url": e.url,
        "secrets": json.dumps([[s, exp] for s, exp in e.secrets]),
        "event_types": json.dumps(list(e.event_types)),
        "description": e.description,
        "schedule": e.schedule,
        "rate_limit": e.rate_limit,
        "enabled": 1 if e.enabled else 0,
        "disabled_reason": e.disabled_reason,
        "now": e.created_at,
    }


@contextmanager
def _tx(c: sqlite3.Connection) -> Iterator[None]:
    c.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    c.execute("COMMIT")


def _insert_event(
    c: sqlite3.Connection,
    event: WebhookEvent,
    deliveries: Sequence[tuple[NewJob, str, bool]],
    now: float,
) -> tuple[bool, WebhookEvent]:
    with _tx(c):
        row = c.execute(
            _Q["insert_event"],
            {"id": event.id, "event_type": event.event_type, "payload": event.payload, "now": now},
        ).fetchone()
        if row is None:
            existing = c.execute(_Q["get_event"], {"id": event.id}).fetchone()
            return False, _row_to_event(existing)
        for job, endpoint_id, parked in deliveries:
            created, stored = _insert_job(c, job, now)
            if not created:
                raise sqlite3.IntegrityError(f"delivery key {job.key!r} already used")
            c.execute(
                _Q["insert_delivery"],
                {"job_id": stored.id, "event_id": event.id, "endpoint_id": endpoint_id, "now": now},
            )
            if parked:
                c.execute(_Q["park_job"], {"id": stored.id, "now": now})
        return True, _row_to_event(row)


def _update(
    c: sqlite3.Connection, e: WebhookEndpoint, now: float, retarget: bool
) -> WebhookEndpoint | None:
    from retrysafe.client._jobs import destination_of

    with _tx(c):
        params = _endpoint_params(e)
        params["now"] = now
        row = c.execute(_Q["update_endpoint"], params).fetchone()
        if row is None:
            return None
        if retarget:
            c.execute(
                _Q["retarget_endpoint_jobs"],
                {"id": e.id, "url": e.url, "destination": destination_of(e.url), "now": now},
            )
        return _row_to_endpoint(row)


def _set_enabled(
    c: sqlite3.Connection, endpoint_id: str, enabled: bool, reason: str | None, now: float
) -> WebhookEndpoint | None:
    with _tx(c):
        row = c.execute(
            _Q["set_endpoint_enabled"],
            {"id": endpoint_id, "enabled": 1 if enabled else 0, "reason": reason, "now": now},
        ).fetchone()
        if row is None:
            return None
        if not enabled:
            c.execute(
                _Q["cancel_endpoint_jobs"],
                {"id": endpoint_id, "now": now, "reason": f"endpoint disabled: {reason}"},
            )
        return _row_to_endpoint(row)


def _delete(c: sqlite3.Connection, endpoint_id: str) -> bool:
    with _tx(c):
        c.execute(_Q["delete_endpoint_jobs"], {"id": endpoint_id})
        return c.execute(_Q["delete_endpoint"], {"id": endpoint_id}).rowcount == 1


class SQLiteWebhooksMixin:
    """:class:`~retrysafe.stores.WebhookStore` for :class:`~retrysafe.stores.SQLiteStore`."""

    if TYPE_CHECKING:

        def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T: ...

    def insert_endpoint(self, endpoint: WebhookEndpoint) -> WebhookEndpoint:
        row = self.run(
            lambda c: c.execute(_Q["insert_endpoint"], _endpoint_params(endpoint)).fetchone()
        )
        return _row_to_endpoint(row)

    def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint | None:
        row = self.run(lambda c: c.execute(_Q["get_endpoint"], {"id": endpoint_id}).fetchone())
        return None if row is None else _row_to_endpoint(row)

    def list_endpoints(self) -> list[WebhookEndpoint]:
        rows = self.run(lambda c: c.execute(_Q["list_endpoints"]).fetchall())
        return [_row_to_endpoint(r) for r in rows]

    def update_endpoint(
        self, endpoint: WebhookEndpoint, *, now: float, retarget: bool
    ) -> WebhookEndpoint | None:
        return self.run(lambda c: _update(c, endpoint, now, retarget))

    def set_endpoint_enabled(
        self, endpoint_id: str, *, enabled: bool, reason: str | None, now: float
    ) -> WebhookEndpoint | None:
        return self.run(lambda c: _set_enabled(c, endpoint_id, enabled, reason, now))

    def record_endpoint_failure(
        self, endpoint_id: str, *, now: float
    ) -> tuple[int, float | None, bool] | None:
        row = self.run(
            lambda c: c.execute(
                _Q["record_endpoint_failure"], {"id": endpoint_id, "now": now}
            ).fetchone()
        )
        if row is None:
            return None
        return int(row[0]), None if row[1] is None else float(row[1]), bool(row[2])

    def reset_endpoint_failures(self, endpoint_id: str) -> None:
        self.run(lambda c: c.execute(_Q["reset_endpoint_failures"], {"id": endpoint_id}))

    def delete_endpoint(self, endpoint_id: str) -> bool:
        return self.run(lambda c: _delete(c, endpoint_id))

    def insert_event(
        self,
        event: WebhookEvent,
        deliveries: Sequence[tuple[NewJob, str, bool]],
        *,
        now: float,
    ) -> tuple[bool, WebhookEvent]:
        return self.run(lambda c: _insert_event(c, event, deliveries, now))

    def get_event(self, event_id: str) -> WebhookEvent | None:
        row = self.run(lambda c: c.execute(_Q["get_event"], {"id": event_id}).fetchone())
        return None if row is None else _row_to_event(row)

    def delivery_context(self, job_id: str) -> tuple[str, WebhookEndpoint] | None:
        row = self.run(lambda c: c.execute(_Q["delivery_context"], {"job_id": job_id}).fetchone())
        return None if row is None else (str(row[0]), _row_to_endpoint(row[1:]))

    def list_deliveries(
        self,
        *,
        event_id: str | None = None,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        states: Sequence[JobState] | None = None,
        ids: Sequence[str] | None = None,
        limit: int = 100,
    ) -> list[WebhookDelivery]:
        params = {
            "event_id": event_id,
            "endpoint_id": endpoint_id,
            "event_type": event_type,
            "states": _states(states),
            "job_ids": None if ids is None else json.dumps(list(ids)),
            "limit": limit,
        }
        rows = self.run(lambda c: c.execute(_Q["list_deliveries"], params).fetchall())
        return [_row_to_delivery(r) for r in rows]

    def delivery_ids_with_prefix(self, prefix: str) -> list[str]:
        if not prefix or any(ch not in "0123456789abcdef" for ch in prefix):
            return []
        rows = self.run(
            lambda c: c.execute(_Q["find_delivery_by_prefix"], {"prefix": prefix}).fetchall()
        )
        return [str(r[0]) for r in rows]

    def purge_deliveries(
        self,
        *,
        states: Sequence[JobState],
        before: float,
        endpoint_id: str | None = None,
        event_type: str | None = None,
        batch: int = 1000,
    ) -> int:
        params = {
            "states": _states(states),
            "before": before,
            "endpoint_id": endpoint_id,
            "event_type": event_type,
            "batch": batch,
        }
        total = 0
        while True:
            n = self.run(lambda c: c.execute(_Q["purge_deliveries"], params).rowcount)
            total += n
            if n < batch:
                return total
