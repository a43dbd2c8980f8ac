"""The outbox store contract (SPEC §5, §9), run against every store with an outbox: SQLite and
PostgreSQL (a fresh schema per test; CI=true fails instead of skipping when it is down)."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from retrysafe import DamagedJobError, JobState, RetrysafeWarning
from retrysafe.client import AsyncOutboxStore, Attempt, NewJob, OutboxStore, outbox_store
from retrysafe.client._models import Finish
from retrysafe.client._store import parked_by

from .conftest import open_test_store

OUTBOX_STORES = ["sqlite", "postgres"]
T0 = 1_700_000_000.0


@pytest.fixture(name="outbox_store", params=OUTBOX_STORES)
def _outbox_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """An empty outbox store on the caller's clock (the tests drive time with ``now``)."""
    store = open_test_store(request.param, request, tmp_path)
    yield outbox_store(store)
    store.close()


def _job(i: int = 0, *, queue: str = "default", key: str | None = None) -> NewJob:
    return NewJob(
        id=uuid.uuid4().hex,
        key=key or str(uuid.uuid4()),
        method="POST",
        url=f"http://example.test/{i}",
        destination="http://example.test:80",
        headers=(("content-type", "application/json"),),
        body=b'{"i": %d}' % i,
        deadline_at=None,
        queue=queue,
    )


def _attempt(job_id: str, key: str, *, counted: bool = True) -> Attempt:
    return Attempt(
        job_id=job_id,
        key=key,
        number=0,
        started_at=T0,
        duration=0.25,
        outcome="success" if counted else "in_progress",
        status=200 if counted else 409,
        error_type=None,
        replayed=False,
        counted=counted,
    )


def _insert(store: OutboxStore, n: int, *, queue: str = "default", at: float = T0) -> list[str]:
    return [store.insert_job(_job(i, queue=queue), now=at)[1].id for i in range(n)]


def test_store_implements_both_outbox_protocols(outbox_store: Any) -> None:
    """The store is an OutboxStore and its async face an AsyncOutboxStore."""
    face = outbox_store.asyncio_outbox_store()
    assert isinstance(outbox_store, OutboxStore)
    assert isinstance(face, AsyncOutboxStore)


def test_insert_is_idempotent_on_the_key(outbox_store: OutboxStore) -> None:
    """A second insert with the same key inserts nothing and returns the first job."""
    created, first = outbox_store.insert_job(_job(key="k-1"), now=T0)
    again, same = outbox_store.insert_job(_job(key="k-1"), now=T0 + 1)
    assert created and not again and same.id == first.id
    assert (first.state, first.due_at, first.attempts) == (JobState.PENDING, T0, 0)
    assert first.headers == (("content-type", "application/json"),)


def test_an_inserted_job_is_the_job_the_store_holds(outbox_store: OutboxStore) -> None:
    """What insert_job returns is what the store wrote, field for field (a SQL store on the
    caller's clock builds it from the job and its ``now`` instead of reading it back): awkward
    times, a deadline, odd headers and bytes, and a second insert's answer too."""
    job = replace(
        _job(),
        headers=(("x-é", "ü \u2028 ok"), ("content-type", "application/json")),
        body=bytes(range(256)),
        deadline_at=T0 + 0.1 + 0.2,
    )
    now = T0 + 1 / 3
    created, stored = outbox_store.insert_job(job, now=now)
    assert created and outbox_store.get_job(job.id) == stored
    assert (stored.created_at, stored.updated_at, stored.due_at) == (now, now, now)
    again, same = outbox_store.insert_job(replace(job, id=uuid.uuid4().hex), now=now + 1)
    assert not again and same == stored


def test_claim_leases_due_jobs_earliest_first_up_to_the_limit(outbox_store: OutboxStore) -> None:
    """Only due jobs are claimed, earliest due first, at most ``limit``, to the token."""
    early = outbox_store.insert_job(_job(1), now=T0)[1]
    late = outbox_store.insert_job(_job(2), now=T0 + 10)[1]
    outbox_store.insert_job(_job(3), now=T0 + 100)
    claimed = outbox_store.claim_jobs(queue="default", token="t", now=T0 + 50, lease=500, limit=5)
    assert [j.id for j in claimed] == [early.id, late.id]
    assert all(
        j.state is JobState.IN_FLIGHT and j.lease_token == "t" and j.lease_expires_at == T0 + 550
        for j in claimed
    )
    more = outbox_store.claim_jobs(queue="default", token="u", now=T0 + 200, lease=5, limit=1)
    assert len(more) == 1 and more[0].id not in {early.id, late.id}


def test_claims_see_only_their_own_queue(outbox_store: OutboxStore) -> None:
    """A claimant of one queue never leases another queue's jobs; counts are per queue."""
    [hook] = _insert(outbox_store, 1, queue="webhooks")
    assert outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=5, limit=9) == []
    [got] = outbox_store.claim_jobs(queue="webhooks", token="t", now=T0, lease=5, limit=9)
    assert got.id == hook and got.queue == "webhooks"
    assert outbox_store.count_jobs(queue="default")[JobState.IN_FLIGHT] == 0
    assert outbox_store.count_jobs(queue="webhooks")[JobState.IN_FLIGHT] == 1


def test_expired_lease_makes_an_in_flight_job_claimable_again(outbox_store: OutboxStore) -> None:
    """A job IN_FLIGHT under an expired lease (owner crashed) is claimed again, same key."""
    [job_id] = _insert(outbox_store, 1)
    [first] = outbox_store.claim_jobs(queue="default", token="a", now=T0 + 1, lease=10, limit=5)
    assert outbox_store.claim_jobs(queue="default", token="b", now=T0 + 5, lease=10, limit=5) == []
    [again] = outbox_store.claim_jobs(queue="default", token="b", now=T0 + 11, lease=10, limit=5)
    assert again.id == first.id == job_id and again.key == first.key and again.lease_token == "b"


def test_a_claim_leaves_the_jobs_of_skipped_destinations_where_they_are(
    outbox_store: Any,
) -> None:
    """Jobs to the ``skip_destinations`` are neither claimed nor changed, pending or under an
    expired lease; the jobs behind them in due order are claimed instead."""
    def new(i: int, destination: str) -> str:
        job = replace(_job(i), destination=destination, url=f"{destination}/{i}")
        return str(outbox_store.insert_job(job, now=T0 + i)[1].id)

    a, b, c = "http://a.test:80", "http://b.test:80", "http://c.test:80"
    a1, a2, b1, c1 = new(1, a), new(2, a), new(3, b), new(4, c)
    [expired] = outbox_store.claim_jobs(queue="default", token="old", now=T0 + 1, lease=5, limit=1)
    assert expired.id == a1
    skip = {"queue": "default", "token": "t", "now": T0 + 10, "lease": 60, "limit": 9}
    claimed = outbox_store.claim_jobs(**skip, skip_destinations=[a, "http://other.test:80"])
    assert sorted(j.id for j in claimed) == sorted([b1, c1])
    untouched = outbox_store.get_job(a2)
    assert (untouched.state, untouched.due_at) == (JobState.PENDING, T0 + 2)
    assert outbox_store.get_job(a1).lease_token == "old"  # expired, but skipped
    # An empty skip list skips nothing (and the async face takes the argument too).
    face = outbox_store.asyncio_outbox_store()

    async def claim() -> list[Any]:
        try:
            return list(await face.claim_jobs(**{**skip, "token": "u"}, skip_destinations=[]))
        finally:
            await face.aclose()

    got = asyncio.run(claim())
    assert sorted(j.id for j in got) == sorted([a1, a2])


def test_a_claim_for_one_destination_takes_only_its_jobs(outbox_store: Any) -> None:
    """``only_destination`` claims that destination's due jobs, earliest due first, pending
    or under an expired lease, up to the limit; the others stay where they are."""
    a, b = "http://a.test:80", "http://b.test:80"
    ids = []
    for i, destination in enumerate([b, a, b, a, a]):
        job = replace(_job(i), destination=destination, url=f"{destination}/{i}")
        ids.append(str(outbox_store.insert_job(job, now=T0 + i)[1].id))
    args = {"queue": "default", "token": "t", "now": T0 + 10, "lease": 60}
    got = outbox_store.claim_jobs(**args, limit=2, only_destination=a)
    assert [j.id for j in got] == [ids[1], ids[3]]
    assert outbox_store.get_job(ids[0]).state is JobState.PENDING
    assert [j.id for j in outbox_store.claim_jobs(**args, limit=9, only_destination=a)] == [
        ids[4]
    ]
    assert outbox_store.claim_jobs(**args, limit=9, only_destination="http://c.test:80") == []


def test_writes_are_fenced_by_the_lease_token(outbox_store: OutboxStore) -> None:
    """After a take-over the old owner can neither finish nor release the job."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="old", now=T0, lease=1, limit=1)
    outbox_store.claim_jobs(queue="default", token="new", now=T0 + 2, lease=10, limit=1)
    stale = outbox_store.finish_attempt(
        job.id,
        "old",
        _attempt(job.id, job.key),
        state=JobState.SUCCEEDED,
        due_at=T0 + 3,
        last_delay=0,
        error=None,
        now=T0 + 3,
    )
    assert stale is None
    assert not outbox_store.release_job(
        job.id, "old", state=JobState.PENDING, due_at=T0 + 3, error=None, now=T0 + 3
    )
    assert outbox_store.list_attempts(job.id) == []
    done = outbox_store.finish_attempt(
        job.id,
        "new",
        _attempt(job.id, job.key),
        state=JobState.SUCCEEDED,
        due_at=T0 + 3,
        last_delay=0,
        error=None,
        now=T0 + 3,
    )
    assert done is not None and done.number == 1
    final = outbox_store.get_job(job.id)
    assert final is not None and final.state is JobState.SUCCEEDED
    assert (final.finished_at, final.lease_token, final.last_status) == (T0 + 3, None, 200)


def test_lease_renewal_moves_the_owners_lease_end(outbox_store: OutboxStore) -> None:
    """extend_job_lease renews the owner's lease to now + lease: no claim before its new end."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=10, limit=1)
    assert outbox_store.extend_job_lease(job.id, "t", now=T0 + 8, lease=10)
    renewed = outbox_store.get_job(job.id)
    assert renewed is not None and renewed.lease_expires_at == T0 + 18
    assert (renewed.state, renewed.lease_token, renewed.updated_at) == (JobState.IN_FLIGHT, "t", T0)
    assert outbox_store.claim_jobs(queue="default", token="u", now=T0 + 17, lease=5, limit=1) == []
    assert outbox_store.next_due(queue="default") == T0 + 18


def test_a_leased_jobs_due_time_is_its_lease_end(outbox_store: OutboxStore) -> None:
    """While IN_FLIGHT a job's due_at is its lease's end (one index finds due jobs and expired
    leases): set by the claim, moved by every renewal, replaced by the finish."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    [leased] = outbox_store.claim_jobs(queue="default", token="t", now=T0 + 1, lease=10, limit=1)
    assert leased.due_at == leased.lease_expires_at == T0 + 11
    assert outbox_store.extend_job_lease(job.id, "t", now=T0 + 9, lease=10)
    renewed = outbox_store.get_job(job.id)
    assert renewed is not None and renewed.due_at == renewed.lease_expires_at == T0 + 19
    outbox_store.finish_attempt(
        job.id,
        "t",
        _attempt(job.id, job.key),
        state=JobState.PENDING,
        due_at=T0 + 30,
        last_delay=1,
        error="503",
        now=T0 + 12,
    )
    retried = outbox_store.get_job(job.id)
    assert retried is not None and (retried.due_at, retried.lease_expires_at) == (T0 + 30, None)


def test_a_lease_taken_by_an_earlier_release_is_never_taken_while_it_lives(
    outbox_store: Any,
) -> None:
    """A worker of an earlier release left due_at at the claim's due time: its live lease is
    still not claimed (the claim checks lease_expires_at too), and is once it has ended."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="old", now=T0 + 1, lease=10, limit=1)
    with outbox_store.transaction() as conn:  # the row as the earlier release left it
        conn.execute(f"UPDATE outbox_jobs SET due_at = {T0} WHERE id = '{job.id}'")
    early = outbox_store.claim_jobs(queue="default", token="new", now=T0 + 5, lease=10, limit=1)
    assert early == []
    assert outbox_store.next_due(queue="default") == T0 + 11
    [taken] = outbox_store.claim_jobs(queue="default", token="new", now=T0 + 11, lease=10, limit=1)
    assert (taken.id, taken.lease_token, taken.due_at) == (job.id, "new", T0 + 21)


def test_lease_renewal_is_refused_to_a_stale_token(outbox_store: OutboxStore) -> None:
    """After a take-over the old owner's renewal returns False and leaves the new lease alone."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="old", now=T0, lease=1, limit=1)
    outbox_store.claim_jobs(queue="default", token="new", now=T0 + 2, lease=10, limit=1)
    assert not outbox_store.extend_job_lease(job.id, "old", now=T0 + 3, lease=100)
    got = outbox_store.get_job(job.id)
    assert got is not None and (got.lease_token, got.lease_expires_at) == ("new", T0 + 12)


def test_lease_renewal_is_refused_once_the_job_is_not_in_flight(outbox_store: OutboxStore) -> None:
    """A finished job cannot be renewed by its last owner: False, still SUCCEEDED, no lease."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=10, limit=1)
    outbox_store.finish_attempt(
        job.id,
        "t",
        _attempt(job.id, job.key),
        state=JobState.SUCCEEDED,
        due_at=T0 + 1,
        last_delay=0,
        error=None,
        now=T0 + 1,
    )
    assert not outbox_store.extend_job_lease(job.id, "t", now=T0 + 2, lease=10)
    assert not outbox_store.extend_job_lease("no-such-job", "t", now=T0 + 2, lease=10)
    got = outbox_store.get_job(job.id)
    assert got is not None and (got.state, got.lease_expires_at) == (JobState.SUCCEEDED, None)


@pytest.mark.anyio
async def test_async_face_renews_and_refuses_like_the_store(outbox_store: Any) -> None:
    """The async face's extend_job_lease renews for the owner and refuses a stale token."""
    face = outbox_store.asyncio_outbox_store()
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=10, limit=1)
    assert await face.extend_job_lease(job.id, "t", now=T0 + 5, lease=10)
    assert not await face.extend_job_lease(job.id, "u", now=T0 + 5, lease=10)
    await face.aclose()
    got = outbox_store.get_job(job.id)
    assert got is not None and got.lease_expires_at == T0 + 15


def test_finish_records_attempts_and_polls_do_not_count(outbox_store: OutboxStore) -> None:
    """Each finish adds a numbered attempt; a 409 poll raises sends and polls, not attempts."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    for n, counted in enumerate([True, False, True], start=1):
        [claimed] = outbox_store.claim_jobs(
            queue="default", token=f"t{n}", now=T0 + 10 * n, lease=5, limit=1
        )
        assert claimed.id == job.id
        outbox_store.finish_attempt(
            job.id,
            f"t{n}",
            _attempt(job.id, job.key, counted=counted),
            state=JobState.PENDING,
            due_at=T0 + 10 * n + 1,
            last_delay=0.5,
            error="boom",
            now=T0 + 10 * n,
        )
    got = outbox_store.get_job(job.id)
    assert got is not None
    assert (got.attempts, got.sends, got.polls, got.last_delay) == (2, 3, 1, 0.5)
    assert (got.state, got.due_at, got.finished_at) == (JobState.PENDING, T0 + 31, None)
    attempts = outbox_store.list_attempts(job.id)
    assert [(a.number, a.counted, a.status) for a in attempts] == [
        (1, True, 200),
        (2, False, 409),
        (3, True, 200),
    ]


def test_release_gives_the_job_back_due_later(outbox_store: OutboxStore) -> None:
    """A released job is PENDING, not claimable before its new due time, no attempt recorded."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=30, limit=1)
    assert outbox_store.release_job(
        job.id, "t", state=JobState.PENDING, due_at=T0 + 20, error="deferred", now=T0 + 1
    )
    assert outbox_store.next_due(queue="default") == T0 + 20
    assert outbox_store.claim_jobs(queue="default", token="u", now=T0 + 19, lease=5, limit=1) == []
    assert len(outbox_store.claim_jobs(queue="default", token="u", now=T0 + 20, lease=5, limit=1))
    assert outbox_store.list_attempts(job.id) == []


def test_next_due_covers_pending_and_expiring_leases(outbox_store: OutboxStore) -> None:
    """next_due is the earliest due time or lease expiry of the queue; None when idle."""
    assert outbox_store.next_due(queue="default") is None
    _insert(outbox_store, 1, at=T0 + 50)
    outbox_store.insert_job(_job(9), now=T0)
    outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=7, limit=1)
    assert outbox_store.next_due(queue="default") == T0 + 7


def test_unknown_jobs_are_claimed_for_reconciliation(outbox_store: OutboxStore) -> None:
    """claim_unknown_jobs leases UNKNOWN jobs only, all or those listed."""
    ids = _insert(outbox_store, 3)
    for job_id in ids[:2]:
        outbox_store.transition_job(
            job_id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=T0
        )
    only = outbox_store.claim_unknown_jobs(
        queue="default", token="r", now=T0, lease=5, limit=10, ids=[ids[1]]
    )
    assert [j.id for j in only] == [ids[1]]
    rest = outbox_store.claim_unknown_jobs(
        queue="default", token="r", now=T0, lease=5, limit=10, ids=None
    )
    assert [j.id for j in rest] == [ids[0]] and rest[0].state is JobState.IN_FLIGHT


def test_transition_with_reset_restarts_the_budget_same_key(outbox_store: OutboxStore) -> None:
    """transition_job moves only from the given states; reset clears attempts and deadline."""
    job = outbox_store.insert_job(_job(), now=T0)[1]
    assert (
        outbox_store.transition_job(
            job.id, from_states=[JobState.UNKNOWN], state=JobState.PENDING, now=T0
        )
        is None
    )
    cancelled = outbox_store.transition_job(
        job.id, from_states=[JobState.PENDING], state=JobState.CANCELLED, now=T0 + 1
    )
    assert cancelled is not None and cancelled.finished_at == T0 + 1
    again = outbox_store.transition_job(
        job.id,
        from_states=[JobState.CANCELLED],
        state=JobState.PENDING,
        now=T0 + 2,
        reset=True,
        deadline_at=T0 + 99,
    )
    assert again is not None and again.key == job.key
    assert (again.due_at, again.finished_at, again.deadline_at) == (T0 + 2, None, T0 + 99)


def test_prefix_lookup_and_listing_are_per_queue(outbox_store: Any) -> None:
    """resolve_job_id finds a unique prefix within the queue; list_jobs filters by state."""
    [job_id] = _insert(outbox_store, 1)
    _insert(outbox_store, 1, queue="webhooks")
    assert outbox_store.resolve_job_id(job_id[:10], queue="default") == job_id
    assert outbox_store.resolve_job_id(job_id[:10], queue="webhooks") is None
    assert outbox_store.resolve_job_id("xyz", queue="default") is None
    assert outbox_store.job_ids_with_prefix("", queue="default") == []
    listed = outbox_store.list_jobs(queue="default", states=[JobState.PENDING], limit=10)
    assert [j.id for j in listed] == [job_id]
    assert outbox_store.list_jobs(queue="default", states=[JobState.UNKNOWN], limit=10) == []


def test_purge_deletes_old_terminal_jobs_in_batches(outbox_store: OutboxStore) -> None:
    """purge_jobs removes jobs in the given states last changed at or before the cut-off,
    with their attempts, batch after batch, and nothing else."""
    ids = _insert(outbox_store, 5)
    for job_id in ids:
        outbox_store.transition_job(
            job_id, from_states=[JobState.PENDING], state=JobState.CANCELLED, now=T0 + 1
        )
    keep = _insert(outbox_store, 1)
    outbox_store.transition_job(
        keep[0], from_states=[JobState.PENDING], state=JobState.CANCELLED, now=T0 + 100
    )
    assert (
        outbox_store.purge_jobs(
            queue="default", states=[JobState.CANCELLED], before=T0 + 10, batch=2
        )
        == 5
    )
    assert [j.id for j in outbox_store.list_jobs(queue="default", states=None, limit=10)] == keep


def test_four_threads_claiming_one_queue_never_get_the_same_job(outbox_store: Any) -> None:
    """Concurrent claim_jobs calls from 4 threads each get disjoint jobs, and all of them."""
    ids = set(_insert(outbox_store, 200))
    got: list[list[str]] = []
    lock = threading.Lock()

    def claim(n: int) -> None:
        mine: list[str] = []
        while jobs := outbox_store.claim_jobs(
            queue="default", token=f"t{n}", now=T0 + 1, lease=600, limit=7
        ):
            mine += [j.id for j in jobs]
        with lock:
            got.append(mine)

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    flat = [i for mine in got for i in mine]
    assert len(flat) == len(set(flat)) == 200 and set(flat) == ids


def _claim_in_process(spec: tuple[str, str, str | None], out: Any) -> None:
    kind, where, schema = spec
    opened: Any
    if kind == "sqlite":
        from retrysafe.stores import SQLiteStore

        opened = SQLiteStore(where)
    else:
        from retrysafe.stores import PostgresStore

        opened = PostgresStore(where, schema=schema or "public", clock="caller")
    store = outbox_store(opened)
    mine: list[str] = []
    while jobs := store.claim_jobs(
        queue="default", token=uuid.uuid4().hex, now=T0 + 1, lease=600, limit=5
    ):
        mine += [j.id for j in jobs]
    store.close()
    out.put(mine)


def test_two_processes_claiming_one_queue_never_get_the_same_job(
    outbox_store: Any, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two processes (own connections) claiming one queue get disjoint jobs, and all of them."""
    ids = set(_insert(outbox_store, 300))
    if request.node.callspec.params["outbox_store"] == "sqlite":
        spec: tuple[str, str, str | None] = ("sqlite", str(tmp_path / "keys.db"), None)
    else:
        spec = ("postgres", request.getfixturevalue("pg_url"), outbox_store.connector.schema)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(spec, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    flat = [i for mine in got for i in mine]
    assert len(flat) == len(set(flat)) == 300 and set(flat) == ids


def test_postgres_server_clock_ignores_the_callers_now(pg_url: str, pg_schema: str) -> None:
    """With clock="server" leases and due times are measured on the database's clock: a
    caller clock far in the future claims nothing early, and due offsets are kept."""
    from retrysafe.stores import PostgresStore

    with PostgresStore(pg_url, schema=pg_schema) as pg:
        store = outbox_store(pg)
        job = store.insert_job(_job(), now=0.0)[1]
        assert abs(job.created_at - time.time()) < 60
        [claimed] = store.claim_jobs(queue="default", token="t", now=0.0, lease=30, limit=1)
        assert claimed.lease_expires_at is not None
        assert 25 < claimed.lease_expires_at - claimed.updated_at <= 30.001
        assert store.release_job(
            job.id, "t", state=JobState.PENDING, due_at=1000.0 + 60, error=None, now=1000.0
        )
        assert store.claim_jobs(queue="default", token="u", now=1e12, lease=30, limit=1) == []
        due = store.next_due(queue="default")
        assert due is not None and 55 < due - time.time() <= 60.5


def test_postgres_server_clock_renews_leases_from_the_servers_now(
    pg_url: str, pg_schema: str
) -> None:
    """With clock="server" a renewal's lease is measured from the database's now, not the
    caller's (a worker whose clock lags a day still renews for the full lease)."""
    from retrysafe.stores import PostgresStore

    with PostgresStore(pg_url, schema=pg_schema) as pg:
        store = outbox_store(pg)
        job = store.insert_job(_job(), now=0.0)[1]
        store.claim_jobs(queue="default", token="t", now=0.0, lease=5, limit=1)
        before = time.time()
        assert store.extend_job_lease(job.id, "t", now=before - 86_400, lease=600)
        got = store.get_job(job.id)
        assert got is not None and got.lease_expires_at is not None
        assert abs(got.lease_expires_at - (before + 600)) < 5


def test_postgres_transactional_outbox_commits_or_rolls_back_with_the_business_row(
    pg_url: str, pg_schema: str
) -> None:
    """insert_job(connection=…) inside store.transaction() commits and rolls back with it."""
    from retrysafe.stores import PostgresStore

    with PostgresStore(pg_url, schema=pg_schema, clock="caller") as pg:
        store = outbox_store(pg)
        with pg.transaction() as conn:
            conn.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
            conn.execute("INSERT INTO orders (id) VALUES (1)")
            kept = store.insert_job(_job(1), now=T0, connection=conn)[1]
        lost = _job(2)

        def business_transaction() -> None:
            with pg.transaction() as conn:
                conn.execute("INSERT INTO orders (id) VALUES (2)")
                store.insert_job(lost, now=T0, connection=conn)
                raise RuntimeError("business rule failed")

        with pytest.raises(RuntimeError):
            business_transaction()
        assert store.get_job(kept.id) is not None and store.get_job(lost.id) is None
        with pg.transaction() as conn:
            row = conn.execute("SELECT count(*) FROM orders").fetchone()
        assert row is not None and row[0] == 1


def test_a_batch_of_finishes_records_each_owner_and_fences_each_stale_token(
    outbox_store: OutboxStore,
) -> None:
    """finish_attempts records every finish whose token still owns its job, in batch order,
    and writes nothing for one whose lease was taken over."""
    ids = _insert(outbox_store, 3)
    outbox_store.claim_jobs(queue="default", token="w", now=T0, lease=1, limit=3)
    stale_id = ids[1]
    # Another worker takes over only the middle job after the lease expired.
    outbox_store.extend_job_lease(ids[0], "w", now=T0 + 0.5, lease=10)
    outbox_store.extend_job_lease(ids[2], "w", now=T0 + 0.5, lease=10)
    [taken] = outbox_store.claim_jobs(queue="default", token="x", now=T0 + 2, lease=10, limit=3)
    assert taken.id == stale_id
    jobs = {i: outbox_store.get_job(i) for i in ids}
    states = [JobState.SUCCEEDED, JobState.SUCCEEDED, JobState.PENDING]
    finishes = [
        Finish(
            job_id=i,
            token="w",
            attempt=_attempt(i, jobs[i].key),  # type: ignore[union-attr]
            state=state,
            due_at=T0 + 30,
            last_delay=1.5,
            error=None if state is JobState.SUCCEEDED else "503 from upstream",
            now=T0 + 3,
        )
        for i, state in zip(ids, states, strict=True)
    ]
    got = outbox_store.finish_attempts(finishes)
    assert [a is not None for a in got] == [True, False, True]
    assert [a.job_id for a in got if a is not None] == [ids[0], ids[2]]
    assert all(a.number == 1 for a in got if a is not None)
    first, middle, last = (outbox_store.get_job(i) for i in ids)
    assert first is not None and first.state is JobState.SUCCEEDED and first.finished_at == T0 + 3
    assert middle is not None and middle.state is JobState.IN_FLIGHT and middle.lease_token == "x"
    assert outbox_store.list_attempts(stale_id) == []
    assert last is not None and last.state is JobState.PENDING and last.due_at == T0 + 30
    assert (last.last_error, last.last_delay, last.sends, last.lease_token) == (
        "503 from upstream",
        1.5,
        1,
        None,
    )
    assert outbox_store.finish_attempts([]) == []


def test_a_batch_naming_one_job_twice_is_refused_and_writes_nothing(
    outbox_store: OutboxStore,
) -> None:
    """A batch with the same job twice raises ValueError before anything is written."""
    [job_id] = _insert(outbox_store, 1)
    [job] = outbox_store.claim_jobs(queue="default", token="w", now=T0, lease=10, limit=1)
    finish = Finish(
        job_id=job_id,
        token="w",
        attempt=_attempt(job_id, job.key),
        state=JobState.SUCCEEDED,
        due_at=T0 + 1,
        last_delay=0,
        error=None,
        now=T0 + 1,
    )
    with pytest.raises(ValueError, match="same job twice"):
        outbox_store.finish_attempts([finish, finish])
    assert outbox_store.list_attempts(job_id) == []


def test_a_claimed_job_whose_row_cannot_be_read_is_parked_unknown_and_the_others_go(
    outbox_store: OutboxStore,
) -> None:
    """A row something else wrote or changed (headers that are no JSON array) stopped every
    worker that claimed it: the claim raised, and the next claim met the same row once its
    lease ended. The claim now returns the others and parks it UNKNOWN without an attempt,
    the reason in last_error; reads of it raise DamagedJobError naming it."""
    good, bad = _insert(outbox_store, 2)
    with outbox_store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(f"UPDATE outbox_jobs SET headers = '{{not json' WHERE id = '{bad}'")
    claimed = outbox_store.claim_jobs(queue="default", token="t", now=T0 + 1, lease=30, limit=9)
    assert [j.id for j in claimed] == [good]
    assert parked_by(claimed) == (bad,)  # what the worker counts as left UNKNOWN
    with outbox_store.transaction() as conn:  # type: ignore[attr-defined]
        state, token, attempts, error = conn.execute(
            "SELECT state, lease_token, attempts, last_error FROM outbox_jobs "
            f"WHERE id = '{bad}'"
        ).fetchone()
    assert (state, token, attempts) == ("unknown", None, 0)
    assert "its headers: JSONDecodeError" in error and bad in error
    with pytest.raises(DamagedJobError, match="headers") as info:
        outbox_store.get_job(bad)
    assert info.value.job_id == bad
    # An operator's retry of it fails, and changes nothing (it moved the job to PENDING
    # and then reported the failure, so the next worker parked it again).
    with pytest.raises(DamagedJobError):
        outbox_store.transition_job(
            bad, from_states=[JobState.UNKNOWN], state=JobState.PENDING, now=T0 + 2, reset=True
        )
    with outbox_store.transaction() as conn:  # type: ignore[attr-defined]
        row = conn.execute(f"SELECT state FROM outbox_jobs WHERE id = '{bad}'").fetchone()
    assert row[0] == "unknown"
    # Reconcile's claim of UNKNOWN jobs parks it the same way, and never returns it.
    again = outbox_store.claim_unknown_jobs(
        queue="default", token="r", now=T0 + 2, lease=5, limit=10, ids=None
    )
    assert again == [] and parked_by(again) == (bad,)


#: Damage only something other than retrysafe writes (SQL SET clauses): on either store, and
#: what only SQLite's loosely typed columns can hold.
_DAMAGE = {
    "content-length header": """headers = '[["Content-Length", "1"]]'""",
    "line break in a header": """headers = '[["X-A", "b\\r\\nHost: evil"]]'""",
    "headers object": """headers = '{"ab": 1}'""",
    "header pair of numbers": "headers = '[[1, 2]]'",
    "NaN creation time": "created_at = 'NaN'",
    # An empty or overlong key went out as it was (a fresh-user pass).
    "empty key": "idempotency_key = ''",
    "overlong key": f"idempotency_key = '{'k' * 300}'",
    "key with a space": "idempotency_key = 'a b'",
}
_SQLITE_DAMAGE = {
    "integer body": "body = 100",
    "infinite attempts": "attempts = 9e999",
    # TEXT that is no UTF-8 failed the claim statement itself, after its leases were made:
    # the worker stopped, naming no job.
    "url that is no UTF-8": "url = CAST(X'687474703aff' AS TEXT)",
    "headers that are no UTF-8": "headers = CAST(X'5b5b2258222c2022ff225d5d' AS TEXT)",
    "last error that is no UTF-8": "last_error = CAST(X'ff' AS TEXT)",
    "last error as a BLOB": "last_error = X'00ff'",
}


def _parked(store: OutboxStore, clause: str) -> None:
    good, bad = _insert(store, 2)
    with store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(f"UPDATE outbox_jobs SET {clause} WHERE id = '{bad}'")
    # A listing leaves it out, saying so, and shows the others (one damaged row made every
    # listing fail).
    with pytest.warns(RetrysafeWarning, match=f"left out of this listing: job {bad}"):
        listed = store.list_jobs(queue="default", states=None, limit=9)
    assert [j.id for j in listed] == [good]
    claimed = store.claim_jobs(queue="default", token="t", now=T0 + 1, lease=30, limit=9)
    assert [j.id for j in claimed] == [good]
    if "last_error" in clause:  # the parking wrote the reason over it: readable again
        parked = store.get_job(bad)
        assert parked is not None and parked.state is JobState.UNKNOWN
        assert parked.last_error is not None and "cannot be read" in parked.last_error
        return
    with pytest.raises(DamagedJobError):
        store.get_job(bad)


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_every_kind_of_damage_is_parked_never_claimed(
    outbox_store: OutboxStore, damage: str
) -> None:
    """Values that would send something else than what was submitted (a Content-Length of 1,
    "a: b" for {"ab": 1}) or that cannot be read: parked, not returned."""
    _parked(outbox_store, _DAMAGE[damage])


@pytest.mark.parametrize("damage", list(_SQLITE_DAMAGE))
def test_damage_only_sqlite_can_hold_is_parked_never_claimed(
    tmp_path: Path, request: pytest.FixtureRequest, damage: str
) -> None:
    """100 zero bytes sent for an integer body; an infinite count raised OverflowError and
    stopped the worker. (A method stored as the number 5 is the text "5" in SQLite, which a
    submission may send.)"""
    store = open_test_store("sqlite", request, tmp_path)
    try:
        _parked(outbox_store(store), _SQLITE_DAMAGE[damage])
    finally:
        store.close()


def test_a_due_time_that_is_no_number_is_no_next_due(outbox_store: OutboxStore) -> None:
    """A NaN due time made an idle worker wait NaN seconds (it polled the store without a
    pause); one stored as text stopped it with a ValueError."""
    (job_id,) = _insert(outbox_store, 1)
    with outbox_store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(f"UPDATE outbox_jobs SET due_at = 'NaN' WHERE id = '{job_id}'")
    assert outbox_store.next_due(queue="default") is None


def test_hasten_moves_a_deferred_job_only_while_its_due_time_is_the_deferrals(
    outbox_store: OutboxStore,
) -> None:
    """What brings a retry the retry budget deferred forward: only a job still PENDING until
    exactly the time its deferral set. One an operator retried and a server's Retry-After
    rescheduled since was sent again long before that Retry-After (a fresh-user pass)."""
    deferred, rescheduled = _insert(outbox_store, 2)
    claimed = outbox_store.claim_jobs(queue="default", token="t", now=T0, lease=30, limit=9)
    assert {j.id for j in claimed} == {deferred, rescheduled}
    for job_id, due in ((deferred, T0 + 40.25), (rescheduled, T0 + 30.5)):
        assert outbox_store.release_job(
            job_id, "t", state=JobState.PENDING, due_at=due, error=None, now=T0
        )
    astore: Any = outbox_store.asyncio_outbox_store()  # hasten_jobs: no protocol method

    async def hasten() -> int:
        try:
            changed: int = await astore.hasten_jobs(
                [(deferred, T0 + 40.25, T0), (rescheduled, T0 + 60.0, T0)], now=T0 + 1
            )
            return changed
        finally:
            await astore.aclose()

    assert asyncio.run(hasten()) == 1
    got = outbox_store.get_job(deferred)
    assert got is not None and got.due_at == T0 + 1 and got.state is JobState.PENDING
    other = outbox_store.get_job(rescheduled)
    assert other is not None and other.due_at == T0 + 30.5


def test_a_state_retrysafe_never_writes_is_left_alone_with_a_warning(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A row in a state of no JobState (its CHECK constraint ignored) made the counts raise
    ValueError: `worker --until-idle`, `jobs list` and the console's overview stopped with a
    traceback (a fresh-user pass). It is neither claimed nor counted, with a warning."""
    store = open_test_store("sqlite", request, tmp_path)
    try:
        box = outbox_store(store)
        good, bad = _insert(box, 2)
        with box.transaction() as conn:  # type: ignore[attr-defined]
            conn.execute("PRAGMA ignore_check_constraints = ON")
            conn.execute(f"UPDATE outbox_jobs SET state = 'bogus' WHERE id = '{bad}'")
        with pytest.warns(RetrysafeWarning, match=r"1 job\(s\) in a state .*'bogus'"):
            counts = box.count_jobs(queue="default")
        assert counts[JobState.PENDING] == 1 and sum(counts.values()) == 1
        with pytest.warns(RetrysafeWarning, match="'bogus'"):
            stats = box.job_stats(now=T0)  # type: ignore[attr-defined]
        assert [(s, n) for _, s, n, _ in stats] == [(JobState.PENDING, 1)]
        claimed = box.claim_jobs(queue="default", token="t", now=T0 + 1, lease=30, limit=9)
        assert [j.id for j in claimed] == [good]
    finally:
        store.close()


@pytest.mark.parametrize(
    "clause",
    [
        "due_at = 'abc'",  # text sorts after every number: never <= now
        "due_at = X'00'",  # so does a BLOB
        "due_at = 9e999",  # infinite
        "state = 'in_flight', lease_token = 'gone', lease_expires_at = NULL",
        "state = 'in_flight', lease_token = 'gone', lease_expires_at = 'abc'",
    ],
)
def test_a_job_sqlite_would_never_find_due_is_claimed(
    tmp_path: Path, request: pytest.FixtureRequest, clause: str
) -> None:
    """A due time that is no number, or a lease without an end, made a job wait for ever,
    and `worker --until-idle` with it, silently (a fresh-user pass): it is claimed now (the
    claim sets its due time and lease afresh)."""
    store = open_test_store("sqlite", request, tmp_path)
    try:
        box = outbox_store(store)
        (job_id,) = _insert(box, 1)
        with box.transaction() as conn:  # type: ignore[attr-defined]
            conn.execute(f"UPDATE outbox_jobs SET {clause} WHERE id = '{job_id}'")
        claimed = box.claim_jobs(queue="default", token="t", now=T0 + 1, lease=30, limit=9)
        assert [j.id for j in claimed] == [job_id]
        assert claimed[0].due_at == T0 + 31 and claimed[0].lease_token == "t"
    finally:
        store.close()
