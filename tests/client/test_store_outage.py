"""A store that is unavailable for a while (locked by another connection for longer than the
busy timeout, read-only) does not stop the worker or reconcile; errors that waiting cannot fix
do, and so does an outage longer than ``store_outage_limit`` in a run with ``until_idle``."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from _readonly import ReadOnly
from retrysafe import (
    AsyncOutbox,
    ConfigurationError,
    JobState,
    Outbox,
    RetryPolicy,
    SchemaError,
    SQLiteStore,
    StoreUnavailableError,
    SubmitOutcomeUnknownError,
    Worker,
    reconcile,
)
from retrysafe.client import OutboxStore, outbox_store
from retrysafe.client._worker import DEFAULT_STORE_OUTAGE_LIMIT
from retrysafe.webhooks import Webhooks

from .conftest import FAST, RecordsDown, Script, Step

BUSY = 0.05  # the store's busy timeout: every lock below is held much longer


@contextmanager
def _locked(path: Path, seconds: float) -> Iterator[threading.Thread]:
    """Another connection holds ``BEGIN EXCLUSIVE`` on ``path`` for ``seconds`` (in a thread)."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(seconds, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        yield release
    finally:
        release.join()
        holder.close()


class ShiftedClock:
    """Real time plus an offset the test moves forward: an outage "lasts" without waiting.
    ``calls`` counts the reads (the worker reads it once per claim it tries)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return time.time() + self.offset


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.01)


@contextmanager
def _held(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holds ``BEGIN EXCLUSIVE`` on ``path`` until the block ends."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield holder
    finally:
        holder.execute("COMMIT")
        holder.close()


class _Run(threading.Thread):
    """``worker.run(until_idle=…)`` in a thread, keeping what it returned or raised."""

    def __init__(self, worker: Worker, *, until_idle: bool) -> None:
        super().__init__(daemon=True)
        self.worker = worker
        self.until_idle = until_idle
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> None:
        try:
            self.result = self.worker.run(until_idle=self.until_idle)
        except BaseException as exc:
            self.error = exc


@pytest.fixture
def store(sqlite_path: Path) -> Iterator[SQLiteStore]:
    s = SQLiteStore(sqlite_path, busy_timeout=BUSY)
    yield s
    s.close()


@pytest.fixture
def jobs(store: SQLiteStore) -> OutboxStore:
    """The outbox of ``store``, to read jobs and attempts with."""
    return outbox_store(store)


def _outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "store unavailable" in r.getMessage()]


def test_worker_records_an_attempt_that_ended_while_the_store_was_locked(
    store: SQLiteStore,
    jobs: OutboxStore,
    sqlite_path: Path,
    script: Script,
    base_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock held past the busy timeout during an attempt: its outcome is still recorded."""
    caplog.set_level(logging.WARNING, logger="retrysafe.client")
    script.plan("/slow", Step(201, sleep=0.3))
    job = Outbox(store, policy=FAST).submit(base_url + "/slow", json={})
    worker = Worker(store, policy=FAST, poll_interval=0.01)
    thread = threading.Thread(target=worker.run_until_idle)
    thread.start()
    assert script.started.wait(10)
    with _locked(sqlite_path, 0.8):
        pass
    thread.join(20)
    assert not thread.is_alive()
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert [a.status for a in jobs.list_attempts(job.id)] == [201]
    assert len(script.requests("/slow")) == 1
    assert worker.stats.store_outages == 1
    assert len(_outage_warnings(caplog)) == 1  # once per outage, not once per try


def test_worker_keeps_serving_after_the_store_comes_back(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """An idle worker waits out a lock, then delivers jobs submitted after it."""
    worker = Worker(store, policy=FAST, poll_interval=0.01)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        with _held(sqlite_path):
            _wait_for(lambda: worker.stats.store_outages == 1, "the worker to see the outage")
        job = Outbox(store, policy=FAST).submit(base_url + "/after", json={})
        _wait_for(lambda: worker.stats.succeeded == 1, "the job to be delivered")
    finally:
        worker.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert worker.stats.store_outages == 1
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]


def test_an_outcome_unrecorded_past_the_lease_lands_while_no_one_took_the_job(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Locked past the lease, with no other worker: the outcome is written once the store is
    back (the lease token still holds the job), and the job is sent once. It was given up at
    the lease's end and sent again (a fresh user's check: 4 jobs re-sent after a 20-s lock,
    15 after a 15-s PostgreSQL outage)."""
    policy = RetryPolicy(attempts=4, wait_initial=0.01, wait_max=0.05, timeout=0.4)
    script.plan("/lease", Step(201, sleep=0.3))
    job = Outbox(store, policy=policy).submit(base_url + "/lease", json={})
    worker = Worker(store, policy=policy, lease=0.8, poll_interval=0.01)
    thread = threading.Thread(target=worker.run_until_idle)
    thread.start()
    assert script.started.wait(10)
    with _locked(sqlite_path, 1.4):
        pass
    thread.join(20)
    assert not thread.is_alive()
    assert worker.stats.lease_lost == 0 and worker.stats.succeeded == 1
    assert [s.key for s in script.requests("/lease")] == [job.key]
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert [a.status for a in jobs.list_attempts(job.id)] == [201]


def test_an_outcome_unrecorded_until_another_worker_took_the_job_is_not_written(
    store: SQLiteStore, jobs: OutboxStore, script: Script, base_url: str
) -> None:
    """The same, but another worker claims the job once its lease has ended, before the store
    is back for the first: the first worker's write changes nothing (the token fences it),
    it says so, and the job is the second worker's, to send again with the same key."""
    script.plan("/taken", Step(201))
    job = Outbox(store, policy=FAST).submit(base_url + "/taken", json={})
    worker = Worker(store, policy=FAST, lease=0.8, poll_interval=0.01)
    face = RecordsDown(worker._astore)
    worker._astore = face
    run = _Run(worker, until_idle=False)  # idle would wait for the second worker's lease
    run.start()
    try:
        assert face.failed.wait(10)  # answered 201, its outcome not written
        (taken,) = jobs.claim_jobs(
            queue="default", token="second-worker", now=time.time() + 60, lease=60, limit=1
        )
        assert taken.id == job.id
        face.down.clear()
        _wait_for(lambda: worker.stats.lease_lost == 1, "the write to change nothing")
    finally:
        face.down.clear()
        worker.stop()
        run.join(20)
    assert run.error is None
    assert not run.is_alive()
    assert worker.stats.lease_lost == 1 and worker.stats.succeeded == 0
    after = jobs.get_job(job.id)
    assert after is not None and after.state is JobState.IN_FLIGHT
    assert after.lease_token == "second-worker" and jobs.list_attempts(job.id) == []
    assert [s.key for s in script.requests("/taken")] == [job.key]


def test_the_store_is_said_back_only_once_it_took_an_operation_again(
    store: SQLiteStore,
    sqlite_path: Path,
    script: Script,
    base_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its one slot busy with a slow attempt, the worker's lease renewal fails on a locked
    store: the store was said "available again" by the next poll, which claimed nothing
    (every slot busy), while the lock was still held -- false recoveries, and the outage's
    clock (``store_outage_limit``) started again (a fresh user's check: 75 s to give up
    after a limit of 60). Now the line comes once the store has taken an operation again."""
    caplog.set_level(logging.WARNING, logger="retrysafe.client")
    policy = RetryPolicy(attempts=1, timeout=5.0)
    script.plan("/slow", Step(201, sleep=2.0))
    Outbox(store, policy=policy).submit(base_url + "/slow", json={})
    worker = Worker(store, policy=policy, concurrency=1, lease=2.0, poll_interval=0.01)
    thread = threading.Thread(target=worker.run_until_idle)
    thread.start()
    assert script.started.wait(10)
    with _held(sqlite_path):
        _wait_for(lambda: worker.stats.store_outages == 1, "the renewal to fail")
        time.sleep(0.2)  # twenty polls with every slot busy
        released_at = time.time()
    thread.join(20)
    assert not thread.is_alive()
    back = [r for r in caplog.records if "available again" in r.getMessage()]
    assert back and all(r.created >= released_at for r in back), [
        (r.created - released_at, r.getMessage()) for r in back
    ]
    assert worker.stats.succeeded == 1


def test_missing_schema_stops_the_worker(store: SQLiteStore, sqlite_path: Path) -> None:
    """A SchemaError is not waited out: the worker stops with it."""
    worker = Worker(store, policy=FAST, poll_interval=0.01)
    other = sqlite3.connect(sqlite_path, isolation_level=None)
    other.executescript("DROP TABLE outbox_attempts; DROP TABLE outbox_jobs;")
    other.close()
    with pytest.raises(SchemaError):
        worker.run()


def test_reconcile_waits_out_a_locked_store(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """reconcile on a store locked past its busy timeout claims once the lock is gone."""
    once = RetryPolicy(attempts=1, wait_initial=0.01, wait_max=0.05, timeout=2.0)
    script.plan("/rec", Step(503), Step(201))
    job = Outbox(store, policy=once).submit(base_url + "/rec", json={})
    Worker(store, policy=once, poll_interval=0.01).run_until_idle()
    assert jobs.get_job(job.id).state is JobState.UNKNOWN  # type: ignore[union-attr]
    with _locked(sqlite_path, 0.5):
        report = reconcile(store, policy=once)
    assert report.succeeded == 1
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]


# ---------------------------------------------------------------------- recovering, giving up
def test_a_worker_on_a_store_read_only_when_first_used_delivers_once_it_is_writable(
    tmp_path: Path, script: Script, base_url: str
) -> None:
    """The store's file is read-only when the worker starts: it waits (one outage), and once
    the file is writable it delivers the job and returns, with no restart."""
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "jobs.db"
    with SQLiteStore(path) as setup:
        job = Outbox(setup, policy=FAST).submit(base_url + "/ro", json={})
    with ReadOnly(path) as ro:
        store = SQLiteStore(path, busy_timeout=BUSY)
        worker = Worker(store, policy=FAST, poll_interval=0.01)
        run = _Run(worker, until_idle=True)
        run.start()
        _wait_for(lambda: worker.stats.store_outages == 1, "the worker to see the outage")
        ro.restore()
        run.join(20)
    assert not run.is_alive() and run.error is None
    assert worker.stats.store_outages == 1 and worker.stats.succeeded == 1
    assert outbox_store(store).get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert len(script.requests("/ro")) == 1
    store.close()


def test_until_idle_gives_up_once_the_store_outage_lasted_the_limit(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, base_url: str
) -> None:
    """With until_idle, a store unavailable for the default limit (60 s on the worker's clock)
    ends the run with StoreUnavailableError saying so; the job is untouched."""
    job = Outbox(store, policy=FAST).submit(base_url + "/never", json={})
    clock = ShiftedClock()
    worker = Worker(store, policy=FAST, poll_interval=0.01, clock=clock)
    assert worker.store_outage_limit == DEFAULT_STORE_OUTAGE_LIMIT == 60.0
    with _held(sqlite_path):
        run = _Run(worker, until_idle=True)
        run.start()
        _wait_for(lambda: worker.stats.store_outages == 1, "the worker to see the outage")
        assert run.is_alive()  # within the limit it waits
        clock.offset += DEFAULT_STORE_OUTAGE_LIMIT
        run.join(20)
        assert not run.is_alive()
    assert isinstance(run.error, StoreUnavailableError)
    message = str(run.error)
    assert "has been unavailable for" in message and "store_outage_limit 60 s" in message
    assert "giving up" in message and store.url in message
    assert isinstance(run.error.__cause__, StoreUnavailableError)
    assert jobs.get_job(job.id).state is JobState.PENDING  # type: ignore[union-attr]
    assert jobs.list_attempts(job.id) == []


class _AnswerLost:
    """The worker's async store face whose first record lands and then fails as if its
    answer were lost on the way back (a connection cut after the commit)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def finish_attempts(self, finishes: Any) -> Any:
        result = await self._inner.finish_attempts(finishes)
        if not self.lost:
            self.lost += 1
            raise StoreUnavailableError("connection lost after the commit")
        return result


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_record_that_landed_before_its_answer_was_lost_is_counted_once(
    kind: str,
    request: pytest.FixtureRequest,
    script: Script,
    base_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The record's commit landed, its answer did not: the write tried again changes
    nothing (the first cleared the token), and that was counted as a lost lease with a
    warning that another worker had the job (a fresh user's check, one worker alone). It
    is counted as the record it is; the job was sent once. On PostgreSQL, which stamps the
    job's update with its own clock, the landed record was still taken for a lost lease (a
    second fresh user's check, behind a store that hung for 20 s): there the attempt's own
    start time, stored as the worker gave it, tells."""
    if kind == "sqlite":
        store: Any = request.getfixturevalue("store")
    else:
        from retrysafe.stores import PostgresStore

        url, schema = request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema")
        store = PostgresStore(url, schema=schema)
        request.addfinalizer(store.close)
    jobs = outbox_store(store)
    caplog.set_level(logging.WARNING, logger="retrysafe.client")
    script.plan("/once", Step(201))
    job = Outbox(store, policy=FAST).submit(base_url + "/once", json={})
    worker = Worker(store, policy=FAST, poll_interval=0.01)
    face = worker._astore = _AnswerLost(worker._astore)
    stats = worker.run_until_idle()
    assert face.lost == 1
    assert (stats.succeeded, stats.lease_lost, stats.attempts) == (1, 0, 1)
    assert not [r for r in caplog.records if "not recorded" in r.getMessage()]
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert len(jobs.list_attempts(job.id)) == 1
    assert len(script.requests("/once")) == 1


def test_until_idle_gives_up_at_the_limit_with_every_slot_writing(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Its one slot writing an outcome through the outage (no claim is tried, so no claim
    fails): the run still ends once the outage has lasted the limit, and the job, answered
    but not recorded, keeps its lease (sent again with the same key once it ends)."""
    script.plan("/answered", Step(201))
    job = Outbox(store, policy=FAST).submit(base_url + "/answered", json={})
    clock = ShiftedClock()
    worker = Worker(store, policy=FAST, poll_interval=0.01, clock=clock, concurrency=1)
    face = RecordsDown(worker._astore)
    worker._astore = face
    run = _Run(worker, until_idle=True)
    run.start()
    assert face.failed.wait(10)
    with _held(sqlite_path):  # its give-back on the way out fails too
        time.sleep(0.1)
        assert run.is_alive()
        clock.offset += DEFAULT_STORE_OUTAGE_LIMIT
        run.join(20)
        assert not run.is_alive()
    assert isinstance(run.error, StoreUnavailableError), run.error
    assert "store_outage_limit 60 s" in str(run.error)
    assert len(script.requests("/answered")) == 1
    assert jobs.get_job(job.id).state is JobState.IN_FLIGHT  # type: ignore[union-attr]
    assert worker.stats.unreleased == 1


def test_without_until_idle_the_worker_waits_past_the_store_outage_limit(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Without until_idle the limit does not apply: an outage far longer than it is waited
    out, and the job is delivered once the store is back."""
    job = Outbox(store, policy=FAST).submit(base_url + "/later", json={})
    clock = ShiftedClock()
    worker = Worker(store, policy=FAST, poll_interval=0.01, clock=clock, store_outage_limit=1)
    run = _Run(worker, until_idle=False)
    try:
        with _held(sqlite_path):
            run.start()
            _wait_for(lambda: worker.stats.store_outages == 1, "the worker to see the outage")
            clock.offset += 100.0
            calls = clock.calls
            # More failed tries long after the limit passed, and it is still running.
            _wait_for(lambda: clock.calls >= calls + 3, "more tries")
            assert run.is_alive() and run.error is None
            assert worker.stats.succeeded == 0
        _wait_for(lambda: worker.stats.succeeded == 1, "the job to be delivered")
    finally:
        worker.stop()
        run.join(20)
    assert not run.is_alive() and run.error is None
    assert worker.stats.store_outages == 1
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert len(script.requests("/later")) == 1


@pytest.mark.parametrize("limit", [0, -1.0, float("nan"), float("inf"), "60", True])
def test_store_outage_limit_must_be_positive_seconds(store: SQLiteStore, limit: Any) -> None:
    """store_outage_limit: positive finite seconds (or a timedelta), or None; nothing else."""
    with pytest.raises(ConfigurationError, match="store_outage_limit"):
        Worker(store, store_outage_limit=limit)
    assert Worker(store, store_outage_limit=None).store_outage_limit is None
    assert Worker(store, store_outage_limit=timedelta(minutes=2)).store_outage_limit == 120.0



def _submit(store: SQLiteStore, face: str) -> None:
    """One submission through ``face``: the outbox, its async face, or a webhook send."""
    if face == "outbox":
        Outbox(store).submit("http://example.test/x", json={"n": 1})
    elif face == "async":

        async def main() -> None:
            async with AsyncOutbox(store) as outbox:
                await outbox.submit("http://example.test/x", json={"n": 1})

        asyncio.run(main())
    else:
        with Webhooks(store, allow_private=True) as hooks:
            hooks.send("invoice.paid", {"n": 1})


@pytest.mark.parametrize("face", ["outbox", "async", "webhooks"])
def test_a_submission_sqlite_refused_is_no_unknown_outcome(
    store: SQLiteStore, sqlite_path: Path, face: str
) -> None:
    """SQLite commits in this process, so a write that raised was rolled back: a submission
    refused by a lock held past the busy timeout is the store's own StoreUnavailableError,
    not "may have been recorded, submit again with key=…" (a fresh user's check: a held
    lock, a full disk and a read-only file all said so, with nothing recorded)."""
    if face == "webhooks":
        with Webhooks(store, allow_private=True) as hooks:
            hooks.add_endpoint("http://127.0.0.1:9/hook")
    with _locked(sqlite_path, 0.5), pytest.raises(StoreUnavailableError) as caught:
        _submit(store, face)
    assert not isinstance(caught.value, SubmitOutcomeUnknownError)
    assert outbox_store(store).count_jobs(queue="default")[JobState.PENDING] == 0


@pytest.mark.parametrize("face", ["outbox", "async", "webhooks"])
def test_a_submission_after_the_store_file_was_deleted_is_refused(
    tmp_path: Path, face: str
) -> None:
    """The store's file deleted while the process has it open: the next submission was
    written into the unlinked file and reported recorded, though no worker could ever see
    it (a fresh user's check, 2 of 2; a file's replacement was only noticed once a
    second). A submission now compares the file first: StoreUnavailableError, nothing
    written, and no empty file created in its place."""
    path = tmp_path / "gone.db"
    with SQLiteStore(path) as store:
        _submit(store, face)  # the connections are open and in use
        for name in ("gone.db", "gone.db-wal", "gone.db-shm"):
            (tmp_path / name).unlink(missing_ok=True)
        with pytest.raises(StoreUnavailableError) as caught:
            _submit(store, face)
        assert not isinstance(caught.value, SubmitOutcomeUnknownError)
    assert not path.exists()
