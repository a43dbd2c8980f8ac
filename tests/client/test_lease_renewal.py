"""Lease renewal (SPEC §5 "Crash safety"): a live worker renews the lease of every job it is
sending, so a short lease works with a long request timeout; a dead worker stops renewing and
its job is taken over one lease later, re-sent with the same key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe import JobState, Outbox, RetryPolicy, RetrysafeWarning, Worker
from retrysafe._serving import ServerThread
from retrysafe.client import OutboxStore, _worker, outbox_store
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore

from .conftest import OutboxDatabase, Script, Step

LONG_TIMEOUT = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=0.1, poll_interval=0.1)

_WORKER = """
import sys
from retrysafe import RetryPolicy, Worker
from retrysafe.stores import PostgresStore, SQLiteStore
kind, where, schema = sys.argv[1:4]
store = SQLiteStore(where) if kind == "sqlite" else PostgresStore(where, schema=schema)
Worker(store, policy=RetryPolicy(timeout=10.0), lease=1.0, poll_interval=0.05).run_until_idle()
"""


def test_attempt_slower_than_the_lease_is_sent_once_while_two_workers_poll(
    outbox_database: OutboxDatabase, script: Script, base_url: str
) -> None:
    """An endpoint slower than the lease (2.2 s against 1 s, timeout 10 s) with two workers
    polling one store throughout: one request reaches it and the job ends SUCCEEDED."""
    path = script.plan("/slower-than-the-lease", Step(201, sleep=2.2))
    stores = [outbox_database.open() for _ in range(3)]
    try:
        job = Outbox(stores[0], policy=LONG_TIMEOUT).submit(base_url + path, json={})
        workers = [
            Worker(s, policy=LONG_TIMEOUT, lease=1.0, poll_interval=0.02) for s in stores[1:]
        ]
        threads = [threading.Thread(target=w.run_until_idle) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads)
        assert [s.key for s in script.requests(path)] == [job.key]
        final = outbox_store(stores[0]).get_job(job.id)
        assert final is not None and final.state is JobState.SUCCEEDED
        assert [a.status for a in outbox_store(stores[0]).list_attempts(job.id)] == [201]
        assert [(w.stats.succeeded, w.stats.lease_lost) for w in workers].count((1, 0)) == 1
    finally:
        for s in stores:
            s.close()


def test_a_claim_that_waited_for_the_lock_past_the_lease_is_renewed_before_it_sends(
    script: Script, base_url: str, tmp_path: Path
) -> None:
    """The claim waited 1.5 s for another process's SQLite write lock against a 1 s lease, so
    it landed with the job's lease already over; a second worker starting just after would
    claim the job too and send it while the first did. The first worker now renews a claim
    that took over a quarter of the lease before sending: one request."""
    path = script.plan("/late-claim", Step(201, sleep=1.0))
    db = tmp_path / "late.db"
    stores = [SQLiteStore(db, busy_timeout=30) for _ in range(3)]
    try:
        job = Outbox(stores[0], policy=LONG_TIMEOUT).submit(base_url + path, json={})
        first, second = (
            Worker(s, policy=LONG_TIMEOUT, lease=1.0, poll_interval=0.02) for s in stores[1:]
        )
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        threads = [threading.Thread(target=first.run_until_idle)]
        try:
            threads[0].start()
            time.sleep(1.5)  # its claim meets the lock and waits past the lease
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        time.sleep(0.1)  # the claim lands, and its renewal after it
        threads.append(threading.Thread(target=second.run_until_idle))
        threads[1].start()
        for thread in threads:
            thread.join(15)
        assert not any(thread.is_alive() for thread in threads)
        assert [s.key for s in script.requests(path)] == [job.key]
        final = outbox_store(stores[0]).get_job(job.id)
        assert final is not None and final.state is JobState.SUCCEEDED
    finally:
        for s in stores:
            s.close()


def test_sigkilled_worker_job_is_taken_over_one_short_lease_later_with_one_effect(
    outbox_database: OutboxDatabase, tmp_path: Path
) -> None:
    """kill -9 mid-attempt under a 1 s lease (timeout 10 s): another worker re-sends the job
    with the same key about a lease later; SUCCEEDED, one effect behind the middleware."""
    effects: list[str] = []
    arrivals: list[tuple[float, str | None]] = []
    arrived = threading.Event()

    async def create(request: Request) -> Response:
        arrived.set()
        await asyncio.sleep(0.5)  # the attempt is in flight when the worker dies
        effects.append((await request.body()).decode())
        return JSONResponse({"created": True}, status_code=201)

    inner = Starlette(routes=[Route("/posts", create, methods=["POST"])])
    middleware = IdempotencyMiddleware(inner, f"sqlite:///{tmp_path / 'keys.db'}")

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            key = dict(scope["headers"]).get(b"idempotency-key")
            arrivals.append((time.monotonic(), None if key is None else key.decode()))
        await middleware(scope, receive, send)

    store = outbox_database.open()
    try:
        with ServerThread(app) as server:
            outbox = Outbox(store, policy=LONG_TIMEOUT)
            job = outbox.submit(server.url + "/posts", json={"text": "once"})
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            argv = [sys.executable, "-c", _WORKER, *outbox_database.argv]
            proc = subprocess.Popen(argv, env=env)
            try:
                assert arrived.wait(20), "the first attempt never reached the server"
                assert outbox.get(job.id).state is JobState.IN_FLIGHT
                proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
            outbox.worker(lease=1.0, poll_interval=0.05).run_until_idle()
        final = outbox.get(job.id)
        assert final.state is JobState.SUCCEEDED
        assert len(arrivals) >= 2 and {key for _, key in arrivals} == {job.key}
        assert arrivals[1][0] - killed < 3.0  # one short lease, not 3 × the 10 s timeout
        assert effects == ['{"text":"once"}']
        assert outbox.attempts(job.id)[-1].replayed  # the server replayed, did not re-run
    finally:
        middleware.close()
        store.close()


def test_worker_whose_lease_was_taken_over_logs_it_and_records_nothing(
    sqlite_store: SQLiteStore,
    sqlite_outbox: OutboxStore,
    script: Script,
    base_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renewal refused mid-attempt (another claimant took the job): one ERROR naming the job
    and its key, no attempt recorded, counted in lease_lost; the new owner's lease stays."""
    caplog.set_level(logging.WARNING, logger="retrysafe.client")
    path = script.plan("/taken-over", Step(201, sleep=1.0))
    job = Outbox(sqlite_store, policy=LONG_TIMEOUT).submit(base_url + path, json={})
    worker = Worker(sqlite_store, policy=LONG_TIMEOUT, lease=0.6, heartbeat=0.2, poll_interval=0.02)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert script.started.wait(10)
        [taken] = sqlite_outbox.claim_jobs(
            queue="default", token="other", now=time.time() + 60, lease=600, limit=1
        )
        assert taken.id == job.id
        deadline = time.monotonic() + 10
        while worker.stats.lease_lost == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
        thread.join(20)
    assert (worker.stats.lease_lost, worker.stats.attempts, worker.stats.succeeded) == (1, 0, 0)
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and job.id in r.getMessage()
    ]
    assert len(errors) == 1 and job.key in errors[0] and "lease lost" in errors[0]
    after = sqlite_outbox.get_job(job.id)
    assert after is not None and (after.state, after.lease_token) == (JobState.IN_FLIGHT, "other")
    assert sqlite_outbox.list_attempts(job.id) == []


def test_attempt_past_max_run_time_stops_renewing_and_is_taken_over(
    sqlite_store: SQLiteStore, sqlite_outbox: OutboxStore, script: Script, base_url: str
) -> None:
    """A worker wedged past max_run_time stops renewing: another worker re-sends the job with
    the same key once the lease ends, and only one outcome is recorded."""
    path = script.plan("/wedged", Step(201, sleep=2.0), Step(201))
    job = Outbox(sqlite_store, policy=LONG_TIMEOUT).submit(base_url + path, json={})
    with pytest.warns(RetrysafeWarning, match="max_run_time"):
        # One slot, held by the wedged attempt: it cannot claim the job again itself.
        wedged = Worker(
            sqlite_store,
            policy=LONG_TIMEOUT,
            concurrency=1,
            lease=0.6,
            heartbeat=0.2,
            max_run_time=0.3,
        )
    other = Worker(sqlite_store, policy=LONG_TIMEOUT, lease=5.0, poll_interval=0.02)
    first = threading.Thread(target=wedged.run_until_idle)
    first.start()
    assert script.started.wait(10)
    second = threading.Thread(target=other.run_until_idle)
    second.start()
    first.join(20)
    second.join(20)
    assert [s.key for s in script.requests(path)] == [job.key, job.key]
    assert (wedged.stats.lease_lost, other.stats.succeeded) == (1, 1)
    assert [a.status for a in sqlite_outbox.list_attempts(job.id)] == [201]


def test_reconcile_renews_its_jobs_while_a_worker_polls(
    sqlite_store: SQLiteStore,
    sqlite_outbox: OutboxStore,
    script: Script,
    base_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """reconcile re-sending an UNKNOWN job slower than its lease (1.5 s against 0.6 s) while a
    worker polls the store: one request, the job ends SUCCEEDED."""
    monkeypatch.setattr(_worker, "DEFAULT_LEASE", 0.6)
    path = script.plan("/reconcile-slow", Step(201, sleep=1.5))
    outbox = Outbox(sqlite_store, policy=LONG_TIMEOUT)
    job = outbox.submit(base_url + path, json={})
    sqlite_outbox.transition_job(
        job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=time.time()
    )
    worker = Worker(sqlite_store, policy=LONG_TIMEOUT, lease=5.0, poll_interval=0.02)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        report = outbox.reconcile()
    finally:
        worker.stop()
        thread.join(20)
    assert report.succeeded == 1 and worker.stats.claimed == 0
    assert [s.key for s in script.requests(path)] == [job.key]
    assert outbox.get(job.id).state is JobState.SUCCEEDED


def test_a_cancelled_reconcile_gives_every_claimed_job_back_as_unknown(sql_store: Any) -> None:
    """``areconcile`` claims all its jobs up front and sends ``concurrency`` at a time.
    Cancelled (a console stopped, Ctrl-C) with two attempts in flight and ten jobs waiting
    for a slot: all twelve are UNKNOWN again at once — the waiting ones were left IN_FLIGHT,
    for a worker to take over one day; on PostgreSQL (a fresh user's check) most were left
    IN_FLIGHT whatever the signal."""
    from retrysafe.client import areconcile

    store = sql_store
    outbox = Outbox(store)
    box = outbox_store(store)

    async def main() -> None:
        arrived = asyncio.Event()
        reached = 0

        async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal reached
            reached += 1
            if reached == 2:
                arrived.set()
            await asyncio.Event().wait()  # never answers

        server = await asyncio.start_server(hang, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        for i in range(12):
            job = outbox.submit(f"http://127.0.0.1:{port}/x", json={"n": i})
            box.transition_job(
                job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0.0
            )
        task = asyncio.ensure_future(
            areconcile(store, policy=RetryPolicy(attempts=1, timeout=60), concurrency=2)
        )
        await asyncio.wait_for(arrived.wait(), 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()

    asyncio.run(main())
    counts = box.count_jobs(queue="default")
    assert (counts[JobState.UNKNOWN], counts[JobState.IN_FLIGHT]) == (12, 0), counts
