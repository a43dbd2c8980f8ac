"""The webhook store contract (SPEC §6, §9), run against every store that keeps webhooks:
SQLite and PostgreSQL (a fresh schema per test; CI=true fails instead of skipping when it is
down). One test per operation and promise of :class:`~retrysafe.webhooks.WebhookStore`."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from retrysafe import ConfigurationError, JobState, StoreError
from retrysafe.client import NewJob, OutboxStore, outbox_store
from retrysafe.client._jobs import build_job
from retrysafe.client._models import Attempt, Finish
from retrysafe.client._store import SQLOutboxStore
from retrysafe.stores import MemoryStore, PostgresStore, SQLiteStore
from retrysafe.webhooks import (
    Endpoint,
    Event,
    Webhooks,
    WebhookStore,
    webhook_store,
)
from retrysafe.webhooks._store import DeliveryOutboxStore, SQLWebhookStore, delivery_outbox

from .conftest import FAST, WEBHOOK_STORES, Receiver, add

T0 = 1_700_000_000.0


@dataclasses.dataclass
class Stores:
    """One database's webhook store and the outbox store its deliveries are jobs of."""

    hooks: WebhookStore
    outbox: OutboxStore


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path, **options: Any) -> Any:
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "contract.db")
    url = request.getfixturevalue("pg_url")
    options.setdefault("clock", "caller")
    return PostgresStore(url, schema=request.getfixturevalue("pg_schema"), **options)


@pytest.fixture(params=WEBHOOK_STORES)
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    """Empty webhook and outbox stores on one database, on the caller's clock (the tests
    drive time with ``now``)."""
    store = _open(request.param, request, tmp_path)
    yield Stores(webhook_store(store), outbox_store(store))
    store.close()


def _endpoint(n: int = 0, **changes: Any) -> Endpoint:
    endpoint = Endpoint(
        id=f"ep_{n:032x}",
        url=f"https://hooks.example/{n}",
        secrets=(("whsec_new", None), ("whsec_old", T0 + 3600.0)),
        event_types=("invoice.*", "user.created"),
        description="é first",
        schedule="default",
        rate_limit=2.5,
        enabled=True,
        disabled_reason=None,
        failure_count=0,
        first_failure_at=None,
        created_at=T0 + n,
        updated_at=T0 + n,
    )
    return dataclasses.replace(endpoint, **changes)


def _event(event_id: str = "evt_1", event_type: str = "invoice.paid") -> Event:
    return Event(id=event_id, event_type=event_type, payload=b'{"n": 1}', created_at=T0)


def _job(event: Event, endpoint: Endpoint, *, job_id: str | None = None) -> NewJob:
    job = build_job(
        endpoint.url,
        content=event.payload,
        headers={"webhook-id": event.id},
        key=f"{event.id}:{endpoint.id}",
        now=T0,
        queue="webhooks",
    )
    return job if job_id is None else dataclasses.replace(job, id=job_id)


def _send(
    s: Stores, event: Event, *endpoints: Endpoint, parked: bool = False, now: float = T0
) -> list[str]:
    """Record ``event`` with one delivery per endpoint; the delivery (job) ids."""
    jobs = [(_job(event, e), e.id, parked) for e in endpoints]
    created, _ = s.hooks.insert_event(event, jobs, now=now)
    assert created
    return [job.id for job, _, _ in jobs]


def _finish(s: Stores, job_id: str, state: JobState, now: float) -> None:
    """Move a delivery to ``state`` (as a worker's outcome would), changed at ``now``."""
    job = s.outbox.transition_job(job_id, from_states=[JobState.PENDING], state=state, now=now)
    assert job is not None


# ---------------------------------------------------------------------- endpoints
def test_an_inserted_endpoint_reads_back_field_for_field(stores: Stores) -> None:
    """insert_endpoint stores every field; get_endpoint and list_endpoints return it."""
    endpoint = _endpoint()
    assert stores.hooks.insert_endpoint(endpoint) == endpoint
    assert stores.hooks.get_endpoint(endpoint.id) == endpoint
    assert stores.hooks.list_endpoints() == [endpoint]


def test_optional_endpoint_fields_round_trip_as_none_and_false(stores: Stores) -> None:
    """No rate limit, every type, registered disabled: None, (), False and the reason."""
    endpoint = _endpoint(
        rate_limit=None, event_types=(), enabled=False, disabled_reason="registered disabled"
    )
    assert stores.hooks.insert_endpoint(endpoint) == endpoint


def test_an_unknown_endpoint_is_none(stores: Stores) -> None:
    """get_endpoint of an id nobody registered is None; the list is empty."""
    assert stores.hooks.get_endpoint("ep_missing") is None
    assert stores.hooks.list_endpoints() == []


def test_endpoints_are_listed_oldest_first(stores: Stores) -> None:
    """list_endpoints orders by creation time."""
    for n in (2, 0, 1):
        stores.hooks.insert_endpoint(_endpoint(n))
    assert [e.created_at for e in stores.hooks.list_endpoints()] == [T0, T0 + 1, T0 + 2]


def test_update_endpoint_writes_the_mutable_fields(stores: Stores) -> None:
    """update_endpoint writes url, secrets, types, description, schedule and rate limit,
    stamps updated_at, and leaves the failure run and creation time alone."""
    stores.hooks.insert_endpoint(_endpoint())
    stores.hooks.record_endpoint_failure(_endpoint().id, now=T0 + 5)
    changed = _endpoint(
        url="https://other.example/x",
        secrets=(("whsec_newer", None),),
        event_types=("*",),
        description="second",
        schedule="svix",
        rate_limit=None,
    )
    updated = stores.hooks.update_endpoint(changed, now=T0 + 10, retarget=False)
    assert updated == dataclasses.replace(
        changed, updated_at=T0 + 10, failure_count=1, first_failure_at=T0 + 5
    )
    assert stores.hooks.get_endpoint(changed.id) == updated


def test_update_of_an_unknown_endpoint_is_none(stores: Stores) -> None:
    """update_endpoint of a missing id writes nothing and returns None."""
    assert stores.hooks.update_endpoint(_endpoint(), now=T0, retarget=True) is None
    assert stores.hooks.list_endpoints() == []


def test_retarget_moves_every_unfinished_delivery_to_the_new_url(stores: Stores) -> None:
    """With retarget, pending, in-flight and dead deliveries get the new URL and destination
    in the same transaction; a succeeded one keeps the URL it was delivered to."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    (flying,) = _send(stores, _event("evt_0"), endpoint)
    (claimed,) = stores.outbox.claim_jobs(
        queue="webhooks", token="t", now=T0 + 1, lease=30.0, limit=5
    )
    assert claimed.id == flying
    pending, dead, done = (_send(stores, _event(f"evt_{i}"), endpoint)[0] for i in (1, 2, 3))
    _finish(stores, dead, JobState.UNKNOWN, T0)
    _finish(stores, done, JobState.SUCCEEDED, T0)
    new = dataclasses.replace(endpoint, url="https://moved.example:8443/in")
    stores.hooks.update_endpoint(new, now=T0 + 2, retarget=True)
    for job_id in (pending, flying, dead):
        job = stores.outbox.get_job(job_id)
        assert job is not None
        assert (job.url, job.destination) == (new.url, "https://moved.example:8443")
    kept = stores.outbox.get_job(done)
    assert kept is not None and kept.url == endpoint.url
    flown = stores.outbox.get_job(flying)
    assert flown is not None and flown.lease_token is not None  # the lease is left alone


def test_update_without_retarget_leaves_deliveries_alone(stores: Stores) -> None:
    """retarget=False changes the endpoint only."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    (job_id,) = _send(stores, _event(), endpoint)
    new = dataclasses.replace(endpoint, url="https://moved.example/in")
    stores.hooks.update_endpoint(new, now=T0 + 2, retarget=False)
    job = stores.outbox.get_job(job_id)
    assert job is not None and job.url == endpoint.url


def test_disabling_parks_the_pending_deliveries_in_the_same_transaction(stores: Stores) -> None:
    """set_endpoint_enabled(False) records the reason, starts a new failure run and parks
    the endpoint's PENDING deliveries (CANCELLED, with the reason), not the others'."""
    a, b = stores.hooks.insert_endpoint(_endpoint(0)), stores.hooks.insert_endpoint(_endpoint(1))
    stores.hooks.record_endpoint_failure(a.id, now=T0)
    (of_a, of_b) = _send(stores, _event(), a, b)
    disabled = stores.hooks.set_endpoint_enabled(a.id, enabled=False, reason="gone", now=T0 + 3)
    assert disabled is not None
    assert (disabled.enabled, disabled.disabled_reason, disabled.failure_count) == (
        False,
        "gone",
        0,
    )
    assert disabled.first_failure_at is None and disabled.updated_at == T0 + 3
    parked = stores.outbox.get_job(of_a)
    assert parked is not None and parked.state is JobState.CANCELLED
    assert parked.last_error == "endpoint disabled: gone" and parked.finished_at == T0 + 3
    other = stores.outbox.get_job(of_b)
    assert other is not None and other.state is JobState.PENDING


def test_enabling_clears_the_reason_and_leaves_parked_deliveries_parked(stores: Stores) -> None:
    """set_endpoint_enabled(True) enables; replaying what was parked is the caller's call."""
    endpoint = stores.hooks.insert_endpoint(_endpoint(enabled=False, disabled_reason="x"))
    (job_id,) = _send(stores, _event(), endpoint, parked=True)
    enabled = stores.hooks.set_endpoint_enabled(endpoint.id, enabled=True, reason=None, now=T0)
    assert enabled is not None and enabled.enabled and enabled.disabled_reason is None
    job = stores.outbox.get_job(job_id)
    assert job is not None and job.state is JobState.CANCELLED


def test_enabling_an_unknown_endpoint_is_none(stores: Stores) -> None:
    """set_endpoint_enabled of a missing id is None either way."""
    for enabled in (True, False):
        found = stores.hooks.set_endpoint_enabled("ep_x", enabled=enabled, reason=None, now=T0)
        assert found is None


def test_failures_add_up_from_the_first_until_reset(stores: Stores) -> None:
    """record_endpoint_failure counts the run and keeps its first time; reset ends it."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    assert stores.hooks.record_endpoint_failure(endpoint.id, now=T0 + 1) == (1, T0 + 1, True)
    assert stores.hooks.record_endpoint_failure(endpoint.id, now=T0 + 9) == (2, T0 + 1, True)
    stores.hooks.reset_endpoint_failures(endpoint.id)
    fresh = stores.hooks.get_endpoint(endpoint.id)
    assert fresh is not None and (fresh.failure_count, fresh.first_failure_at) == (0, None)
    assert stores.hooks.record_endpoint_failure(endpoint.id, now=T0 + 20) == (1, T0 + 20, True)


def test_a_failure_of_an_unknown_endpoint_is_none(stores: Stores) -> None:
    """record_endpoint_failure of a missing id is None; reset of one does nothing."""
    assert stores.hooks.record_endpoint_failure("ep_x", now=T0) is None
    stores.hooks.reset_endpoint_failures("ep_x")


def test_concurrent_failures_all_count(stores: Stores) -> None:
    """record_endpoint_failure is atomic: 4 threads × 10 failures make a run of 40."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())

    def fail_ten() -> None:
        for _ in range(10):
            stores.hooks.record_endpoint_failure(endpoint.id, now=T0)

    threads = [threading.Thread(target=fail_ten) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = stores.hooks.get_endpoint(endpoint.id)
    assert got is not None and got.failure_count == 40


def test_delete_endpoint_takes_its_deliveries_jobs_and_attempts(stores: Stores) -> None:
    """delete_endpoint removes the endpoint, its delivery rows and their jobs (in flight
    too); the event and other endpoints' deliveries stay."""
    a, b = stores.hooks.insert_endpoint(_endpoint(0)), stores.hooks.insert_endpoint(_endpoint(1))
    of_a, of_b = _send(stores, _event(), a, b)
    stores.outbox.claim_jobs(queue="webhooks", token="t", now=T0, lease=30.0, limit=10)
    assert stores.hooks.delete_endpoint(a.id) is True
    assert stores.hooks.get_endpoint(a.id) is None
    assert stores.outbox.get_job(of_a) is None
    assert [d.id for d in stores.hooks.list_deliveries()] == [of_b]
    assert stores.hooks.get_event("evt_1") is not None
    assert stores.hooks.delete_endpoint(a.id) is False


# ---------------------------------------------------------------------- events
def test_an_event_is_recorded_with_its_deliveries(stores: Stores) -> None:
    """insert_event writes the event, one outbox job per delivery (queue 'webhooks',
    PENDING, due now) and the delivery rows."""
    a, b = stores.hooks.insert_endpoint(_endpoint(0)), stores.hooks.insert_endpoint(_endpoint(1))
    event = _event()
    jobs = [(_job(event, a), a.id, False), (_job(event, b), b.id, False)]
    assert stores.hooks.insert_event(event, jobs, now=T0) == (True, event)
    assert stores.hooks.get_event(event.id) == event
    for job, _, _ in jobs:
        stored = stores.outbox.get_job(job.id)
        assert stored is not None
        assert (stored.queue, stored.state, stored.due_at) == ("webhooks", JobState.PENDING, T0)
    listed = stores.hooks.list_deliveries(event_id=event.id)
    assert {(d.id, d.endpoint_id, d.event_type) for d in listed} == {
        (jobs[0][0].id, a.id, event.event_type),
        (jobs[1][0].id, b.id, event.event_type),
    }


def test_a_parked_delivery_is_recorded_cancelled(stores: Stores) -> None:
    """A delivery recorded as parked (disabled endpoint) is CANCELLED at once, replayable."""
    endpoint = stores.hooks.insert_endpoint(_endpoint(enabled=False, disabled_reason="x"))
    (job_id,) = _send(stores, _event(), endpoint, parked=True)
    job = stores.outbox.get_job(job_id)
    assert job is not None and job.state is JobState.CANCELLED
    assert job.last_error == "endpoint disabled"


def test_an_event_id_is_recorded_once(stores: Stores) -> None:
    """A second insert_event with the same id writes nothing and returns the first."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    first = _event()
    _send(stores, first, endpoint)
    other = dataclasses.replace(first, event_type="user.created", payload=b"{}")
    again = [(_job(other, endpoint), endpoint.id, False)]
    assert stores.hooks.insert_event(other, again, now=T0 + 5) == (False, first)
    assert stores.outbox.get_job(again[0][0].id) is None
    assert len(stores.hooks.list_deliveries()) == 1


def test_an_event_is_recorded_whole_or_not_at_all(stores: Stores) -> None:
    """A delivery whose key is already used fails insert_event and rolls back everything:
    no event, no job, no delivery row."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    event = _event()
    job = _job(event, endpoint)
    clash = dataclasses.replace(_job(event, endpoint), id="f" * 32)  # the same key
    with pytest.raises(StoreError, match="already used"):
        stores.hooks.insert_event(
            event, [(job, endpoint.id, False), (clash, endpoint.id, False)], now=T0
        )
    assert stores.hooks.get_event(event.id) is None
    assert stores.outbox.get_job(job.id) is None
    assert stores.hooks.list_deliveries() == []


def test_an_unknown_event_is_none(stores: Stores) -> None:
    """get_event of an id never recorded is None."""
    assert stores.hooks.get_event("evt_missing") is None


# ---------------------------------------------------------------------- deliveries
def test_delivery_context_is_the_event_and_the_current_endpoint(stores: Stores) -> None:
    """delivery_context gives the event id and the endpoint as it is now; None for a job
    that is no delivery and for an unknown id."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    (job_id,) = _send(stores, _event(), endpoint)
    stores.hooks.record_endpoint_failure(endpoint.id, now=T0)
    context = stores.hooks.delivery_context(job_id)
    assert context is not None
    assert context[0] == "evt_1"
    assert context[1] == dataclasses.replace(endpoint, failure_count=1, first_failure_at=T0)
    plain = dataclasses.replace(_job(_event("evt_2"), endpoint), key="plain")
    stores.outbox.insert_job(plain, now=T0)
    assert stores.hooks.delivery_context(plain.id) is None
    assert stores.hooks.delivery_context("0" * 32) is None


def test_list_deliveries_filters_and_orders(stores: Stores) -> None:
    """list_deliveries filters by event, endpoint, event type, state and ids, oldest first,
    at most ``limit``; each delivery shows its job's state and counters."""
    a, b = stores.hooks.insert_endpoint(_endpoint(0)), stores.hooks.insert_endpoint(_endpoint(1))
    a1, b1 = _send(stores, _event("evt_1", "invoice.paid"), a, b, now=T0)
    (a2,) = _send(stores, _event("evt_2", "user.created"), a, now=T0 + 1)
    _finish(stores, b1, JobState.REJECTED, T0 + 2)
    lists = stores.hooks.list_deliveries

    def ids(found: list[Any]) -> list[str]:
        return [d.id for d in found]

    assert ids(lists()) == [*sorted([a1, b1]), a2]  # by creation, then by id
    assert set(ids(lists(event_id="evt_1"))) == {a1, b1}
    assert ids(lists(endpoint_id=a.id)) == [a1, a2]
    assert ids(lists(event_type="user.created")) == [a2]
    assert ids(lists(states=[JobState.REJECTED])) == [b1]
    assert set(ids(lists(states=[JobState.PENDING, JobState.REJECTED]))) == {a1, b1, a2}
    assert ids(lists(ids=[a2, "0" * 32])) == [a2]
    assert ids(lists(ids=[])) == []
    assert len(lists(limit=2)) == 2
    (rejected,) = lists(states=[JobState.REJECTED])
    assert (rejected.state, rejected.endpoint_id, rejected.event_id) == (
        JobState.REJECTED,
        b.id,
        "evt_1",
    )
    assert rejected.url == b.url and rejected.created_at == T0


def test_delivery_ids_with_prefix_are_literal_and_at_most_two(stores: Stores) -> None:
    """delivery_ids_with_prefix gives the one, or two of an ambiguous prefix, in id order;
    an empty prefix or a LIKE wildcard names none."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    for n, job_id in enumerate(("abc1" + "0" * 28, "abc2" + "0" * 28, "abd" + "0" * 29)):
        event = _event(f"evt_{n}")
        jobs = [(_job(event, endpoint, job_id=job_id), endpoint.id, False)]
        stores.hooks.insert_event(event, jobs, now=T0)
    prefix = stores.hooks.delivery_ids_with_prefix
    assert prefix("abd") == ["abd" + "0" * 29]
    assert prefix("abc") == ["abc1" + "0" * 28, "abc2" + "0" * 28]
    assert prefix("ab") == ["abc1" + "0" * 28, "abc2" + "0" * 28]
    assert prefix("") == [] and prefix("%") == [] and prefix("_bc") == []
    assert prefix("abe") == []


def test_purge_deletes_old_deliveries_in_the_given_states_only(stores: Stores) -> None:
    """purge_deliveries deletes deliveries in ``states`` unchanged since ``before`` (with
    their jobs and attempts), filtered by endpoint and type; the rest and events stay."""
    a, b = stores.hooks.insert_endpoint(_endpoint(0)), stores.hooks.insert_endpoint(_endpoint(1))
    old_a, old_b = _send(stores, _event("evt_1", "invoice.paid"), a, b)
    (new_a,) = _send(stores, _event("evt_2", "user.created"), a)
    (live_a,) = _send(stores, _event("evt_3", "invoice.paid"), a)
    (done_a,) = _send(stores, _event("evt_4", "invoice.paid"), a)
    for job_id in (old_a, old_b):
        _finish(stores, job_id, JobState.UNKNOWN, T0 + 10)
    _finish(stores, new_a, JobState.REJECTED, T0 + 100)
    _finish(stores, done_a, JobState.SUCCEEDED, T0 + 10)
    dead = [JobState.UNKNOWN, JobState.REJECTED]
    purge = stores.hooks.purge_deliveries
    assert purge(states=dead, before=T0 + 50, endpoint_id=a.id, event_type="user.created") == 0
    assert purge(states=dead, before=T0 + 50, endpoint_id=b.id) == 1
    assert purge(states=dead, before=T0 + 50) == 1
    assert {d.id for d in stores.hooks.list_deliveries()} == {new_a, live_a, done_a}
    assert stores.outbox.get_job(old_a) is None
    assert purge(states=dead, before=T0 + 100, event_type="user.created") == 1
    assert {d.id for d in stores.hooks.list_deliveries()} == {live_a, done_a}
    assert stores.hooks.get_event("evt_1") is not None


def test_purge_works_in_batches(stores: Stores) -> None:
    """purge_deliveries deletes ``batch`` at a time until none is left, and counts them all;
    a batch below 1 is refused."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    for i in range(5):
        (job_id,) = _send(stores, _event(f"evt_{i}"), endpoint)
        _finish(stores, job_id, JobState.UNKNOWN, T0)
    assert stores.hooks.purge_deliveries(states=[JobState.UNKNOWN], before=T0, batch=2) == 5
    assert stores.hooks.list_deliveries() == []
    with pytest.raises(ConfigurationError):
        stores.hooks.purge_deliveries(states=[JobState.UNKNOWN], before=T0, batch=0)


# ---------------------------------------------------------------------- async face
def _count_statements(face: Any) -> list[int]:
    """``[n]``: how many operations ``face`` sends to its connector from now on (each batch
    is one)."""
    runs = [0]
    run = face.connector.run

    async def counted(*args: Any, **kwargs: Any) -> Any:
        runs[0] += 1
        return await run(*args, **kwargs)

    face.connector.run = counted
    return runs


@pytest.mark.anyio
async def test_the_async_face_reads_and_writes_the_same_tables(stores: Stores) -> None:
    """asyncio_webhook_store: delivery_context, get_endpoint, the failure run and
    set_endpoint_enabled, with the sync methods' results."""
    endpoint = stores.hooks.insert_endpoint(_endpoint())
    (job_id,) = _send(stores, _event(), endpoint)
    face = stores.hooks.asyncio_webhook_store()
    try:
        context = await face.delivery_context(job_id)
        assert context == ("evt_1", endpoint)
        assert await face.get_endpoint(endpoint.id) == endpoint
        assert await face.record_endpoint_failure(endpoint.id, now=T0 + 1) == (1, T0 + 1, True)
        await face.reset_endpoint_failures(endpoint.id)
        disabled = await face.set_endpoint_enabled(
            endpoint.id, enabled=False, reason="gone", now=T0 + 2
        )
        assert disabled is not None and not disabled.enabled
    finally:
        await face.aclose()
    job = stores.outbox.get_job(job_id)
    assert job is not None and job.state is JobState.CANCELLED


@pytest.mark.anyio
async def test_the_async_faces_reads_asked_for_together_are_one_statement_each(
    stores: Stores,
) -> None:
    """get_endpoint and delivery_context of concurrent attempts are batched: one statement
    for each kind of read, every caller with the result a read of its own gives (None for a
    missing id, the same endpoint twice for a repeated one)."""
    endpoints = [stores.hooks.insert_endpoint(_endpoint(n)) for n in range(3)]
    job_ids = _send(stores, _event(), *endpoints)
    face: Any = stores.hooks.asyncio_webhook_store()
    runs = _count_statements(face)
    try:
        ids = [e.id for e in endpoints] + [endpoints[0].id, "ep_" + "f" * 32]
        contexts = [*job_ids, "0" * 32]
        got = await asyncio.gather(
            *(face.get_endpoint(i) for i in ids), *(face.delivery_context(j) for j in contexts)
        )
        assert runs[0] == 2
        assert got[: len(ids)] == [*endpoints, endpoints[0], None]
        assert got[len(ids) :] == [("evt_1", e) for e in endpoints] + [None]
        assert await face.get_endpoint(endpoints[1].id) == endpoints[1] and runs[0] == 3
    finally:
        await face.aclose()


def _record(job_id: str, token: str, outcome: str, status: int | None) -> Finish:
    ok = outcome == "success"
    attempt = Attempt(
        job_id=job_id,
        key="k",
        number=1,
        started_at=T0 + 1,
        duration=0.01,
        outcome=outcome,
        status=status,
        error_type=None,
        replayed=False,
        counted=True,
    )
    return Finish(
        job_id=job_id,
        token=token,
        attempt=attempt,
        state=JobState.SUCCEEDED if ok else JobState.PENDING,
        due_at=T0 + 2,
        last_delay=0.0,
        error=None if ok else "HTTP 500",
        now=T0 + 1,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("face", ["sync", "async"])
async def test_the_delivery_records_end_the_runs_of_their_successes(
    stores: Stores, face: str
) -> None:
    """finish_deliveries (the webhook worker's record, :class:`DeliveryOutboxStore`) records
    every attempt as finish_attempts does, and ends the failure run of the endpoint of each
    recorded 2xx: not the run of an endpoint whose attempt failed, nor of one whose success
    was not recorded (its lease was taken over), nor of an endpoint not in the batch."""
    endpoints = [stores.hooks.insert_endpoint(_endpoint(n)) for n in range(4)]
    for e in endpoints:
        stores.hooks.record_endpoint_failure(e.id, now=T0)
    jobs = _send(stores, _event(), *endpoints)
    claimed = stores.outbox.claim_jobs(queue="webhooks", token="t", now=T0, lease=30, limit=9)
    assert sorted(j.id for j in claimed) == sorted(jobs)
    finishes = [
        _record(jobs[0], "t", "success", 200),
        _record(jobs[1], "t", "success", 204),
        _record(jobs[2], "t", "failure", 500),
        _record(jobs[3], "other", "success", 200),  # not this token's lease: not recorded
    ]
    assert isinstance(stores.outbox, SQLOutboxStore)
    store, ends = delivery_outbox(stores.outbox)
    assert ends and isinstance(store, DeliveryOutboxStore)
    if face == "sync":
        recorded = store.finish_attempts(finishes)
    else:
        astore = store.asyncio_outbox_store()
        try:
            recorded = await astore.finish_attempts(finishes)
        finally:
            await astore.aclose()
    assert [a is not None for a in recorded] == [True, True, True, False]
    runs = {
        e.id: (got.failure_count, got.first_failure_at)
        for e in endpoints
        if (got := stores.hooks.get_endpoint(e.id)) is not None
    }
    assert runs == {
        endpoints[0].id: (0, None),
        endpoints[1].id: (0, None),
        endpoints[2].id: (1, T0),
        endpoints[3].id: (1, T0),
    }
    states = [stores.outbox.get_job(j) for j in jobs]
    assert [j.state if j else None for j in states] == [
        JobState.SUCCEEDED,
        JobState.SUCCEEDED,
        JobState.PENDING,
        JobState.IN_FLIGHT,
    ]


def test_a_store_of_ones_own_keeps_ending_runs_itself(stores: Stores) -> None:
    """delivery_outbox leaves an outbox store that is no plain SQLOutboxStore (one of one's
    own, here a subclass whose records may do anything) as it is: its webhook worker ends
    each run with reset_endpoint_failures after the record."""
    assert isinstance(stores.outbox, SQLOutboxStore)

    class Own(SQLOutboxStore):
        pass

    own = Own(stores.outbox.connector)
    assert delivery_outbox(own) == (own, False)


# ---------------------------------------------------------------------- opening
def test_webhook_store_of_each_kind_of_store(tmp_path: Path) -> None:
    """webhook_store: a SQL store gives a SQLWebhookStore on its connector, a WebhookStore
    itself; a key-only store is refused, naming the stores that keep webhooks."""
    with SQLiteStore(tmp_path / "x.db") as sqlite:
        found = webhook_store(sqlite)
        assert isinstance(found, SQLWebhookStore) and found.connector is sqlite.connector
        assert webhook_store(found) is found
        assert isinstance(webhook_store(outbox_store(sqlite)), SQLWebhookStore)
    with pytest.raises(ConfigurationError, match=r"SQLite.*PostgreSQL"):
        webhook_store(MemoryStore())


def test_postgres_server_clock_stamps_rows_with_the_servers_time(
    pg_url: str, pg_schema: str
) -> None:
    """On clock="server" (PostgreSQL's default) the caller's ``now`` is ignored: rows get
    the database server's time, so replicas whose clocks drift agree."""
    with PostgresStore(pg_url, schema=pg_schema) as store:
        s = Stores(webhook_store(store), outbox_store(store))
        before = time.time()
        endpoint = s.hooks.insert_endpoint(_endpoint())  # created_at T0, in 2023
        assert before - 5 <= endpoint.created_at <= time.time() + 5
        (job_id,) = _send(s, _event(), endpoint, now=T0)
        (delivery,) = s.hooks.list_deliveries()
        assert delivery.id == job_id and delivery.created_at >= before - 5
        failure = s.hooks.record_endpoint_failure(endpoint.id, now=T0)
        assert failure is not None and failure[1] is not None and failure[1] >= before - 5
        # The claim (server clock) sees the delivery due: it was stamped with the server's now.
        claimed = s.outbox.claim_jobs(queue="webhooks", token="t", now=T0, lease=30, limit=5)
        assert [j.id for j in claimed] == [job_id]
        s.outbox.release_job(job_id, "t", state=JobState.UNKNOWN, due_at=T0, error=None, now=T0)
        # A cut-off of "now" on the caller's clock reaches the row stamped on the server's.
        assert s.hooks.purge_deliveries(states=[JobState.UNKNOWN], before=time.time() + 1) == 1


# ---------------------------------------------------------------------- many workers
def test_webhook_workers_sharing_postgres_send_each_delivery_once(
    pg_url: str, pg_schema: str, receiver: Receiver, base_url: str
) -> None:
    """Three webhook workers, each with its own pool, on one PostgreSQL database: claims
    skip each other's locked rows, and every delivery is sent exactly once."""
    setup = PostgresStore(pg_url, schema=pg_schema)
    hooks = Webhooks(setup, allow_private=True, policy=FAST)
    add(hooks, receiver, base_url, receiver.plan("/many", 200))
    ids = [hooks.send("a.b", {"i": i}).id for i in range(30)]
    opened = [PostgresStore(pg_url, schema=pg_schema) for _ in range(3)]
    workers = [
        Webhooks(s, allow_private=True, policy=FAST).worker(
            poll_interval=0.01, budget=None, concurrency=4
        )
        for s in opened
    ]
    threads = [threading.Thread(target=w.run_until_idle) for w in workers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        seen = receiver.requests("/many")
        assert sorted(s.headers["webhook-id"] for s in seen) == sorted(ids)
        assert all(s.verified for s in seen)
        assert {d.state for d in hooks.deliveries(limit=100)} == {JobState.SUCCEEDED}
        assert sum(w.stats.attempts for w in workers) == 30
    finally:
        for w in workers:
            w.close()
        for s in opened:
            s.close()
        hooks.close()
        setup.close()
