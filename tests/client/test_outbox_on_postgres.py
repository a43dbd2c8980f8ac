"""Outbox, Worker, reconcile and the CLI on a PostgreSQL outbox (server clock), delivering to a
real local server. PostgreSQL: ``RETRYSAFE_TEST_POSTGRES`` (a fresh schema per test); when it
is down the tests skip, except under ``CI=true`` where they fail."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from retrysafe import JobState, Outbox, Worker
from retrysafe.cli import cli

from .conftest import FAST, Script, Step


@pytest.fixture
def pg_store(pg_url: str, pg_schema: str) -> Iterator[Any]:
    """A PostgresStore (server clock) on a fresh schema, dropped afterwards."""
    from retrysafe.stores import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema)
    yield store
    store.close()


def test_outbox_and_worker_on_postgres_deliver_every_job(
    pg_store: Any, script: Script, base_url: str
) -> None:
    """Jobs submitted to a PostgreSQL outbox are delivered with their keys and end SUCCEEDED,
    a retried job keeping its key."""
    script.plan("/pg-flaky", Step(503), Step(200))
    script.plan("/pg-ok", Step(200))
    outbox = Outbox(pg_store, policy=FAST)
    flaky = outbox.submit(base_url + "/pg-flaky", json={"order": 1})
    oks = [outbox.submit(base_url + "/pg-ok", json={"i": i}) for i in range(5)]
    stats = outbox.worker(poll_interval=0.01).run_until_idle()
    assert stats.succeeded == 6
    for job in [flaky, *oks]:
        assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert [s.key for s in script.requests("/pg-flaky")] == [flaky.key, flaky.key]
    assert [a.status for a in outbox.attempts(flaky.id)] == [503, 200]


def test_two_workers_on_one_postgres_outbox_never_send_a_job_twice_at_once(
    pg_store: Any, pg_url: str, script: Script, base_url: str
) -> None:
    """Two workers (own pools) on one PostgreSQL outbox: each job sent once, never in parallel."""
    from retrysafe.stores import PostgresStore

    script.plan("/pg-pair", Step(200, sleep=0.02))
    outbox = Outbox(pg_store, policy=FAST)
    jobs = [outbox.submit(base_url + "/pg-pair", json={"i": i}) for i in range(60)]
    stores = [PostgresStore(pg_url, schema=pg_store.schema) for _ in range(2)]
    workers = [Worker(s, policy=FAST, concurrency=8, poll_interval=0.01) for s in stores]
    threads = [threading.Thread(target=w.run_until_idle) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(w.stats.succeeded > 0 for w in workers)
    assert sum(w.stats.succeeded for w in workers) == 60
    keys = [s.key or "" for s in script.requests("/pg-pair")]
    assert sorted(keys) == sorted(j.key for j in jobs)  # each job sent exactly once
    assert max(script.max_in_flight.values()) == 1
    for s in stores:
        s.close()


def test_reconcile_on_postgres_resends_unknown_jobs_with_the_same_key(
    pg_store: Any, script: Script, base_url: str
) -> None:
    """An UNKNOWN job on PostgreSQL is re-sent by reconcile with its key and ends SUCCEEDED."""
    script.plan("/pg-unknown", Step(200))
    outbox = Outbox(pg_store, policy=FAST)
    job = outbox.submit(base_url + "/pg-unknown", json={})
    pg_store.transition_job(job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0.0)
    report = outbox.reconcile()
    assert report.succeeded == 1
    assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert [s.key for s in script.requests("/pg-unknown")] == [job.key]


@pytest.fixture
def pg_database_url(pg_url: str) -> Iterator[str]:
    """The URL of a fresh, empty database (the CLI uses the default schema), dropped after."""
    import psycopg

    name = f"rs_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    yield urlsplit(pg_url)._replace(path="/" + name).geturl()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_cli_submit_worker_and_show_on_a_postgres_store(
    pg_database_url: str, script: Script, base_url: str
) -> None:
    """``--store postgresql://…``: submit → worker --until-idle → show reports SUCCEEDED."""
    store = pg_database_url
    script.plan("/pg-cli", Step(201))
    code, out, err = _run("jobs", "submit", base_url + "/pg-cli", "--store", store, "--json")
    assert code == 0, err
    job = json.loads(out)
    code, out, err = _run(
        "worker", "--store", store, "--until-idle", "--wait-initial", "0.01", "--json"
    )
    assert code == 0 and json.loads(out.splitlines()[-1])["succeeded"] == 1, err
    code, out, _ = _run("jobs", "show", job["id"][:10], "--store", store, "--json")
    shown = json.loads(out)
    assert shown["state"] == "succeeded" and shown["attempt_log"][0]["status"] == 201
    assert [s.key for s in script.requests("/pg-cli")] == [job["key"]]
