"""A store that is unavailable for a while (locked by another connection for longer than the
busy timeout) does not stop the worker or reconcile; errors that waiting cannot fix do."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from retrysafe import JobState, Outbox, RetryPolicy, SchemaError, SQLiteStore, Worker, reconcile
from retrysafe.client import OutboxStore, outbox_store

from .conftest import FAST, Script, Step

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
        with _locked(sqlite_path, 0.5):
            pass
        job = Outbox(store, policy=FAST).submit(base_url + "/after", json={})
        for _ in range(200):
            if worker.stats.succeeded:
                break
            threading.Event().wait(0.05)
    finally:
        worker.stop()
        thread.join(20)
    assert not thread.is_alive()
    assert worker.stats.store_outages == 1
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]


def test_outcome_not_recorded_before_the_lease_expired_is_re_sent_with_the_same_key(
    store: SQLiteStore, jobs: OutboxStore, sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Locked past the lease: the worker gives up recording, then re-sends with the same key."""
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
    assert worker.stats.lease_lost == 1
    assert [s.key for s in script.requests("/lease")] == [job.key, job.key]
    assert jobs.get_job(job.id).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert len(jobs.list_attempts(job.id)) == 1  # the unrecorded send left no attempt row


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
