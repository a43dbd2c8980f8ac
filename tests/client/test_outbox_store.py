"""The outbox store's contract on SQLite: one write per job, atomic claims, fenced writes,
and the transactional outbox."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from retrysafe import JobError, JobState, Outbox, SQLiteStore
from retrysafe.client import Attempt, OutboxStore, outbox_store

NOW = 1_700_000_000.0


def _attempt(job_id: str, key: str) -> Attempt:
    return Attempt(
        job_id=job_id,
        key=key,
        number=0,
        started_at=NOW,
        duration=0.1,
        outcome="success",
        status=200,
        error_type=None,
        replayed=False,
        counted=True,
    )


def test_sqlite_store_is_an_outbox_store(sqlite_store: SQLiteStore) -> None:
    """SQLiteStore's outbox implements the OutboxStore protocol."""
    assert isinstance(outbox_store(sqlite_store), OutboxStore)


def test_submit_stores_job_and_key_in_one_write(
    sqlite_store: SQLiteStore, sqlite_outbox: OutboxStore
) -> None:
    """submit returns a PENDING job whose UUIDv4 key is already stored with it."""
    outbox = Outbox(sqlite_store)
    job = outbox.submit("http://example.test/x", json={"a": 1})
    stored = sqlite_outbox.get_job(job.id)
    assert stored is not None and stored.key == job.key and stored.state is JobState.PENDING
    assert len(job.key) == 36 and job.key[14] == "4"
    assert stored.body == b'{"a":1}'


def test_submit_with_an_existing_key_returns_that_job(sqlite_store: SQLiteStore) -> None:
    """The same key and request twice gives one job; a different request is an error."""
    outbox = Outbox(sqlite_store)
    a = outbox.submit("http://example.test/x", json={"a": 1}, key="order-1")
    b = outbox.submit("http://example.test/x", json={"a": 1}, key="order-1")
    assert a.id == b.id and len(outbox.jobs()) == 1
    with pytest.raises(JobError):
        outbox.submit("http://example.test/x", json={"a": 2}, key="order-1")


def test_claims_from_many_threads_never_lease_a_job_twice(sqlite_path: object) -> None:
    """Concurrent claim_jobs calls (own connections) each get disjoint jobs."""
    store = SQLiteStore(str(sqlite_path))
    outbox = Outbox(store)
    ids = {outbox.submit("http://example.test/x", json={"i": i}).id for i in range(200)}
    got: list[list[str]] = []
    lock = threading.Lock()

    def claim(n: int) -> None:
        s = SQLiteStore(str(sqlite_path))
        mine: list[str] = []
        while True:
            jobs = outbox_store(s).claim_jobs(
                queue="default", token=f"t{n}", now=time.time() + 1000, lease=60, limit=7
            )
            if not jobs:
                break
            mine += [j.id for j in jobs]
        with lock:
            got.append(mine)
        s.close()

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [i for mine in got for i in mine]
    assert len(flat) == len(set(flat)) == 200 and set(flat) == ids
    store.close()


def test_expired_lease_makes_an_in_flight_job_claimable_again(
    sqlite_store: SQLiteStore, sqlite_outbox: OutboxStore
) -> None:
    """A job IN_FLIGHT under an expired lease (owner crashed) is claimed again, same key."""
    job = Outbox(sqlite_store).submit("http://example.test/x", json={})
    [first] = sqlite_outbox.claim_jobs(
        queue="default", token="a", now=job.created_at + 1, lease=10, limit=5
    )
    assert (
        sqlite_outbox.claim_jobs(
            queue="default", token="b", now=job.created_at + 5, lease=10, limit=5
        )
        == []
    )
    [again] = sqlite_outbox.claim_jobs(
        queue="default", token="b", now=job.created_at + 12, lease=10, limit=5
    )
    assert again.id == first.id and again.key == job.key and again.lease_token == "b"


def test_writes_are_fenced_by_the_lease_token(
    sqlite_store: SQLiteStore, sqlite_outbox: OutboxStore
) -> None:
    """After a take-over the old owner can neither finish nor release the job."""
    job = Outbox(sqlite_store).submit("http://example.test/x", json={})
    sqlite_outbox.claim_jobs(queue="default", token="old", now=job.created_at + 1, lease=1, limit=1)
    sqlite_outbox.claim_jobs(
        queue="default", token="new", now=job.created_at + 3, lease=10, limit=1
    )
    stale = sqlite_outbox.finish_attempt(
        job.id,
        "old",
        _attempt(job.id, job.key),
        state=JobState.SUCCEEDED,
        due_at=NOW,
        last_delay=0,
        error=None,
        now=NOW,
    )
    assert stale is None
    assert not sqlite_outbox.release_job(
        job.id, "old", state=JobState.PENDING, due_at=NOW, error=None, now=NOW
    )
    assert sqlite_outbox.list_attempts(job.id) == []
    done = sqlite_outbox.finish_attempt(
        job.id,
        "new",
        _attempt(job.id, job.key),
        state=JobState.SUCCEEDED,
        due_at=NOW,
        last_delay=0,
        error=None,
        now=NOW,
    )
    assert done is not None and done.number == 1
    assert sqlite_outbox.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]


def test_transactional_outbox_commits_job_with_the_business_row(
    sqlite_store: SQLiteStore, sqlite_outbox: OutboxStore
) -> None:
    """submit(connection=…) inside store.transaction(): the job commits with the app's row."""
    sqlite_store.run(lambda c: c.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    outbox = Outbox(sqlite_store)
    with sqlite_store.transaction() as conn:
        conn.execute("INSERT INTO orders (id) VALUES (1)")
        job = outbox.submit("http://example.test/charge", json={"order": 1}, connection=conn)
    assert sqlite_outbox.get_job(job.id) is not None
    assert sqlite_store.run(lambda c: c.execute("SELECT COUNT(*) FROM orders").fetchone()[0]) == 1


def test_transactional_outbox_rollback_leaves_no_job(sqlite_store: SQLiteStore) -> None:
    """A rolled-back transaction leaves neither the app's row nor the job."""
    sqlite_store.run(lambda c: c.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    outbox = Outbox(sqlite_store)

    def business_transaction() -> None:
        with sqlite_store.transaction() as conn:
            conn.execute("INSERT INTO orders (id) VALUES (1)")
            outbox.submit("http://example.test/charge", json={"order": 1}, connection=conn)
            assert isinstance(conn, sqlite3.Connection)
            raise RuntimeError("business rule failed")

    with pytest.raises(RuntimeError):
        business_transaction()
    assert outbox.jobs() == []
    assert sqlite_store.run(lambda c: c.execute("SELECT COUNT(*) FROM orders").fetchone()[0]) == 0


def test_cancel_retry_and_purge_follow_the_states(sqlite_store: SQLiteStore) -> None:
    """cancel only PENDING; retry UNKNOWN/REJECTED/CANCELLED with the same key; purge terminal."""
    outbox = Outbox(sqlite_store)
    job = outbox.submit("http://example.test/x", json={})
    cancelled = outbox.cancel(job.id[:8])
    assert cancelled.state is JobState.CANCELLED
    with pytest.raises(JobError):
        outbox.cancel(job.id)
    again = outbox.retry(job.id)
    assert (again.state, again.key, again.attempts) == (JobState.PENDING, job.key, 0)
    with pytest.raises(JobError):
        outbox.retry(job.id)
    with pytest.raises(JobError):
        outbox.purge(states=[JobState.PENDING])
    outbox.cancel(job.id)
    assert outbox.purge(states=[JobState.CANCELLED]) == 1
    assert outbox.jobs() == []


# ---------------------------------------------------------------------- large bodies
def _wal_bytes(path: object) -> int:
    import os

    wal = f"{path}-wal"
    return os.path.getsize(wal) if os.path.exists(wal) else 0


def test_a_large_body_is_written_once_and_read_back_alike(sqlite_path: object) -> None:
    """SQLite keeps a body over 3.5 KiB in outbox_bodies and its length in the job's row
    (schema version 4): a claim and a recorded attempt no longer rewrite it (they did, twice
    per attempt: SQLite rewrites a whole row when an update changes its size), and the
    submit writes it once. Every read gives the same bytes: get, the listing, the claim the
    worker sends from."""
    import os

    import httpx

    large, small = os.urandom(256 * 1024), b"x" * 3584
    sent: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(201)

    with Outbox(f"sqlite:///{sqlite_path}") as outbox:
        with sqlite3.connect(str(sqlite_path)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        big = outbox.submit("http://api.test/a", content=large)
        # Written once at submit too (a trigger that moved it wrote it twice).
        assert _wal_bytes(sqlite_path) < 1.2 * len(large)
        inline = outbox.submit("http://api.test/b", content=small)
        assert outbox.get(big.id).body == large and outbox.get(inline.id).body == small
        assert {j.id: j.body for j in outbox.jobs()} == {big.id: large, inline.id: small}
        with sqlite3.connect(str(sqlite_path)) as conn:
            kinds = dict(conn.execute("SELECT id, typeof(body) FROM outbox_jobs").fetchall())
            kept = conn.execute("SELECT job_id, length(body) FROM outbox_bodies").fetchall()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert kinds == {big.id: "integer", inline.id: "blob"}
        assert kept == [(big.id, len(large))]
        before = _wal_bytes(sqlite_path)
        stats = outbox.worker(transport=httpx.MockTransport(answer)).run_until_idle()
        assert stats.succeeded == 2 and sorted(sent, key=len) == [small, large]
        # The claim, the attempt and the finish wrote a few pages, not the body again.
        assert _wal_bytes(sqlite_path) - before < 64 * 1024
        assert outbox.get(big.id).body == large


def test_a_deleted_job_takes_its_large_body_with_it(sqlite_path: object) -> None:
    """Purging a job deletes its row of outbox_bodies (a trigger, as for its attempts)."""
    import os

    with Outbox(f"sqlite:///{sqlite_path}") as outbox:
        jobs = [outbox.submit("http://api.test/a", content=os.urandom(8192)) for _ in range(3)]
        outbox.cancel(jobs[0].id)
        assert outbox.purge(states=[JobState.CANCELLED], older_than=0) == 1
        with sqlite3.connect(str(sqlite_path)) as conn:
            kept = {r[0] for r in conn.execute("SELECT job_id FROM outbox_bodies")}
        assert kept == {jobs[1].id, jobs[2].id}


def test_a_large_body_written_in_the_row_before_version_4_is_still_read(
    sqlite_path: object,
) -> None:
    """A job an earlier release wrote keeps its large body in its own row: read as before."""
    import os

    body = os.urandom(10_000)
    with Outbox(f"sqlite:///{sqlite_path}") as outbox:
        job = outbox.submit("http://api.test/a", content=b"{}")
        with sqlite3.connect(str(sqlite_path)) as conn:
            conn.execute("UPDATE outbox_jobs SET body = ? WHERE id = ?", (body, job.id))
        assert outbox.get(job.id).body == body


@pytest.mark.parametrize(
    "damage",
    [
        "DELETE FROM outbox_bodies WHERE job_id = ?",
        "UPDATE outbox_bodies SET body = X'0102030405' WHERE job_id = ?",
        "UPDATE outbox_bodies SET body = 'text' WHERE job_id = ?",
    ],
    ids=["gone", "other length", "text"],
)
def test_a_large_body_damaged_by_hand_is_parked_never_sent(
    sqlite_path: object, damage: str
) -> None:
    """A job whose row of outbox_bodies is gone or changed (a body of another length than its
    row records, text) is damaged: reads name outbox_bodies, a claim parks it UNKNOWN unsent
    (a 5-byte body would have gone out as the 5,000-byte job), the other jobs flow."""
    import os

    import httpx

    from retrysafe import DamagedJobError

    sent: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(201)

    with Outbox(f"sqlite:///{sqlite_path}") as outbox:
        bad = outbox.submit("http://api.test/a", content=os.urandom(5000))
        good = outbox.submit("http://api.test/b", content=b"ok")
        with sqlite3.connect(str(sqlite_path)) as conn:
            conn.execute(damage, (bad.id,))
        with pytest.raises(DamagedJobError, match="outbox_bodies"):
            outbox.get(bad.id)
        stats = outbox.worker(transport=httpx.MockTransport(answer)).run_until_idle()
        assert stats.succeeded == 1 and sent == [b"ok"]
        assert outbox.get(good.id).state is JobState.SUCCEEDED
        with sqlite3.connect(str(sqlite_path)) as conn:
            state, error = conn.execute(
                "SELECT state, last_error FROM outbox_jobs WHERE id = ?", (bad.id,)
            ).fetchone()
        assert state == "unknown" and "outbox_bodies" in error
