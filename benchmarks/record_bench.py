"""The outbox worker's SQLite statements per job: the claim, and two ways to record a batch of
finished attempts (not a timed test; run it by hand).

Submits N jobs to a fresh SQLite file, then claims them 32 at a time and records each batch as
succeeded, on one connection, in a transaction per claim and per record, as the worker's group
commit does:

(json)  the baseline: the batch as one JSON array, taken apart by two statements
        (``json_each`` and ``json_extract``), the worker's way until 2026-12-03 (its
        statements are kept here as they were shipped, the insert given the job's creation
        time that schema version 3 keys attempts by);
(rows)  the store's ``finish_attempts`` operation now: on SQLite its block runs once per
        finish with plain parameters (a ``SELECT`` of the attempt's number, an insert, an
        update), in the same one transaction;
(file)  (rows) on a connection with SQLite's default ``temp_store``: statement journals
        (the savepoint of each operation in a group commit) in a temporary file, as the
        store did until 2026-12-05;
(plain)  the store's three statements run by hand, without the operation around them (the
        driver that runs it, the attempts it returns): what the SQL itself costs;
(returning)  as (plain), the number from the insert's ``RETURNING`` (an ephemeral table per
        statement) instead of the ``SELECT`` before it, as the store did until 2026-12-06;
(random)  (plain) into an attempts table of the layout before schema version 3, made beside
        the store's for the run: keyed by the job id and the number, so that each attempt of
        a batch lands on a random page (job ids are random); the store's own layout keys
        them by the job's creation time first, so a batch's attempts share a page.

``--history N`` first fills the attempts tables with N attempts of older jobs (a store that has
run for a while; the default 0 is a new one) and reopens the connection, so that the record
starts with a cold page cache, as a worker that starts on a big store does.

Every connection is opened as the store opens its own (WAL, ``synchronous=NORMAL``, foreign
keys, ``temp_store=MEMORY``). Prints CPU microseconds per job of the claim and of each
record, and the ratios that tell each change apart: (rows) to (json) and (file), (plain) to
(returning) and (random).

    python benchmarks/record_bench.py --jobs 20000
    python benchmarks/record_bench.py --jobs 10000 --history 300000
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

from retrysafe import Outbox, SQLiteStore
from retrysafe.client import _store as ops
from retrysafe.client._models import Attempt, Finish, Job, JobState
from retrysafe.client._store import _numbered
from retrysafe.stores._connector import drive
from retrysafe.stores._sqlite import SQLiteConnector, _execute

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import non_negative_int, positive_int


def _finishes(jobs: list[Job], now: float) -> list[Finish]:
    return [
        Finish(
            job_id=j.id,
            token=j.lease_token or "",
            attempt=Attempt(
                job_id=j.id,
                key=j.key,
                number=0,
                started_at=now,
                duration=0.01,
                outcome="success",
                status=201,
                error_type=None,
                replayed=False,
                counted=True,
            ),
            state=JobState.SUCCEEDED,
            due_at=now,
            last_delay=0.0,
            error=None,
            now=now,
        )
        for j in jobs
    ]


#: The baseline's two statements (``outbox.sqlite.sql``'s ``finish_attempts`` until 2026-12-03;
#: the insert writes ``job_created_at`` too, which the table has since schema version 3).
_JSON_INSERT = """
INSERT INTO outbox_attempts
    (job_created_at, job_id, number, idempotency_key, started_at, duration, outcome, status,
     error_type, replayed, counted)
SELECT j.created_at, j.id, j.sends + 1, f.key, f.started_at, f.duration, f.outcome, f.status,
       f.error_type, f.replayed, f.counted
FROM (
    SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.token') AS token,
           json_extract(value, '$.key') AS key,
           json_extract(value, '$.started_at') AS started_at,
           json_extract(value, '$.duration') AS duration,
           json_extract(value, '$.outcome') AS outcome,
           json_extract(value, '$.status') AS status,
           json_extract(value, '$.error_type') AS error_type,
           json_extract(value, '$.replayed') AS replayed,
           json_extract(value, '$.counted') AS counted
    FROM json_each(:finishes)
) AS f
JOIN outbox_jobs AS j ON j.id = f.id AND j.lease_token = f.token AND j.state = 'in_flight'
RETURNING job_id, number
"""
_JSON_UPDATE = """
UPDATE outbox_jobs
SET state = f.state, due_at = f.due_at,
    attempts = attempts + (CASE WHEN f.counted THEN 1 ELSE 0 END),
    sends = sends + 1,
    polls = polls + (CASE WHEN f.counted THEN 0 ELSE 1 END),
    last_delay = f.last_delay, lease_token = NULL, lease_expires_at = NULL,
    finished_at = CASE WHEN f.terminal THEN f.now END,
    last_status = f.status, last_outcome = f.outcome, last_error = f.error, updated_at = f.now
FROM (
    SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.token') AS token,
           json_extract(value, '$.state') AS state,
           json_extract(value, '$.due_at') AS due_at,
           json_extract(value, '$.terminal') AS terminal,
           json_extract(value, '$.error') AS error,
           json_extract(value, '$.now') AS now,
           json_extract(value, '$.counted') AS counted,
           json_extract(value, '$.last_delay') AS last_delay,
           json_extract(value, '$.status') AS status,
           json_extract(value, '$.outcome') AS outcome
    FROM json_each(:finishes)
) AS f
WHERE outbox_jobs.id = f.id AND outbox_jobs.lease_token = f.token
  AND outbox_jobs.state = 'in_flight'
"""


def _record_json(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    finishes = _finishes(jobs, now)
    rows = ops.finish_rows("caller", finishes)  # the same parameters as the store's
    params = {"finishes": json.dumps(rows)}
    conn.execute("SAVEPOINT bench")
    numbers = dict(conn.execute(_JSON_INSERT, params).fetchall())
    conn.execute(_JSON_UPDATE, params)
    conn.execute("RELEASE bench")
    recorded = [
        _numbered(f.attempt, f.job_id, numbers[f.job_id]) for f in finishes if f.job_id in numbers
    ]
    if len(recorded) != len(jobs):
        raise SystemExit("a job was not recorded")


def _record_rows(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    recorded = drive(
        ops.finish_attempts("caller", _finishes(jobs, now)), lambda req: _execute(conn, req)
    )
    if None in recorded:
        raise SystemExit("a job was not recorded")


# The store's statements of finish_attempts on SQLite (the number, the insert, the update),
# for the variants that run them by hand or change one of them.
_NUMBER, _STORE_INSERT, _STORE_UPDATE = ops._SQL["finish_attempts"].parts["sqlite"]
_RETURNING_INSERT = _STORE_INSERT + "\nRETURNING job_id, number"
_RANDOM_TABLE = """
CREATE TABLE bench_attempts (
    job_id          TEXT NOT NULL,
    number          INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    started_at      REAL NOT NULL,
    duration        REAL NOT NULL,
    outcome         TEXT NOT NULL,
    status          INTEGER,
    error_type      TEXT,
    replayed        INTEGER NOT NULL DEFAULT 0,
    counted         INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (job_id, number)
) WITHOUT ROWID
"""
_RANDOM_INSERT = """
INSERT INTO bench_attempts
    (job_id, number, idempotency_key, started_at, duration, outcome, status, error_type,
     replayed, counted)
SELECT id, sends + 1, :key, :started_at, :duration, :outcome, :status, :error_type,
       :replayed, :counted
FROM outbox_jobs WHERE id = :id AND lease_token = :token AND state = 'in_flight'
"""
_HISTORY = {
    "outbox_attempts": "INSERT INTO outbox_attempts (job_created_at, job_id, number, "
    "idempotency_key, started_at, duration, outcome) VALUES (?, ?, 1, 'k', ?, 0.01, 'success')",
    "bench_attempts": "INSERT INTO bench_attempts (job_id, number, idempotency_key, "
    "started_at, duration, outcome) VALUES (?, 1, 'k', ?, 0.01, 'success')",
}


def _fill_history(conn: sqlite3.Connection, n: int, tables: list[str]) -> None:
    """``n`` attempts of older jobs (created a day ago and later, random ids) in ``tables``."""
    then = time.time() - 86400
    rows = [(then + i * 0.01, uuid.uuid4().hex) for i in range(n)]
    conn.execute("BEGIN IMMEDIATE")
    for table in tables:
        if table == "outbox_attempts":
            conn.executemany(_HISTORY[table], [(at, job, at) for at, job in rows])
        else:
            conn.executemany(_HISTORY[table], [(job, at) for at, job in rows])
    conn.execute("COMMIT")


def _record_each(conn: sqlite3.Connection, jobs: list[Job], now: float, first: object) -> None:
    """The store's per-row block, its number and insert replaced by ``first(conn, row)``
    (which returns the recorded ``(job id, number)`` rows), in one savepoint."""
    finishes = _finishes(jobs, now)
    numbers: dict[str, int] = {}
    conn.execute("SAVEPOINT bench")
    for row in ops.finish_rows("caller", finishes):
        numbers.update(first(conn, row))  # type: ignore[operator]
        conn.execute(_STORE_UPDATE, row)
    conn.execute("RELEASE bench")
    if len(numbers) != len(jobs):
        raise SystemExit("a job was not recorded")


def _record_plain(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    def first(conn: sqlite3.Connection, row: dict[str, object]) -> list[tuple[str, int]]:
        found = conn.execute(_NUMBER, row).fetchall()
        conn.execute(_STORE_INSERT, row)
        return found

    _record_each(conn, jobs, now, first)


def _record_returning(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    def first(conn: sqlite3.Connection, row: dict[str, object]) -> list[tuple[str, int]]:
        return conn.execute(_RETURNING_INSERT, row).fetchall()

    _record_each(conn, jobs, now, first)


def _record_random(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    def first(conn: sqlite3.Connection, row: dict[str, object]) -> list[tuple[str, int]]:
        found = conn.execute(_NUMBER, row).fetchall()
        conn.execute(_RANDOM_INSERT, row)
        return found

    _record_each(conn, jobs, now, first)


def _run(
    n: int,
    record: object,
    temp_store: str | None = None,
    setup: str | None = None,
    history: int = 0,
) -> tuple[float, float]:
    """(claim, record) CPU microseconds per job over N jobs; ``temp_store`` overrides the
    store's own setting on the connection; ``setup`` is run on it first; ``history``
    attempts of older jobs fill the attempts tables before the run."""
    with tempfile.TemporaryDirectory() as d, SQLiteStore(Path(d) / "o.db") as store:
        with Outbox(store) as outbox, store.transaction() as tx:
            for i in range(n):
                outbox.submit("http://127.0.0.1:9/jobs", json={"n": i}, connection=tx)
        connector = SQLiteConnector(str(Path(d) / "o.db"), busy_timeout=5.0, readonly=False)
        conn, _ = connector._connect_writable(5.0)  # as the store opens its own
        if setup is not None:
            conn.execute(setup)
        if history:
            tables = ["outbox_attempts"] + (["bench_attempts"] if setup is not None else [])
            _fill_history(conn, history, tables)
            conn.close()
            conn, _ = connector._connect_writable(5.0)  # a cold page cache
        if temp_store is not None:
            conn.execute(f"PRAGMA temp_store={temp_store}")
        now = time.time() + 1
        claim = write = 0.0
        done = 0
        while done < n:
            t0 = time.process_time()
            conn.execute("BEGIN IMMEDIATE")
            op = ops.claim_jobs(
                "caller", queue="default", token=uuid.uuid4().hex, now=now, lease=30, limit=32
            )
            jobs = drive(op, lambda req: _execute(conn, req))
            conn.execute("COMMIT")
            t1 = time.process_time()
            conn.execute("BEGIN IMMEDIATE")
            record(conn, jobs, now)  # type: ignore[operator]
            conn.execute("COMMIT")
            t2 = time.process_time()
            claim, write, done = claim + t1 - t0, write + t2 - t1, done + len(jobs)
            if not jobs:
                raise SystemExit("no job was claimable")
        (succeeded,) = conn.execute(
            "SELECT count(*) FROM outbox_jobs WHERE state = 'succeeded'"
        ).fetchone()
        conn.close()
        if succeeded != n:
            raise SystemExit(f"recorded {succeeded} of {n}")
        return claim / n * 1e6, write / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=positive_int, default=20000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--history",
        type=non_negative_int,
        default=0,
        help="attempts of older jobs already in the store (default 0: a new store)",
    )
    args = parser.parse_args(argv)
    variants = {
        "json": (_record_json, None, None),
        "rows": (_record_rows, None, None),
        "file": (_record_rows, "FILE", None),  # statement journals in a temporary file
        "plain": (_record_plain, None, None),
        "returning": (_record_returning, None, None),
        "random": (_record_random, None, _RANDOM_TABLE),
    }
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved: noise hits all alike
        for name, (record, temp_store, setup) in variants.items():
            rows[name].append(_run(args.jobs, record, temp_store, setup, args.history))
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    for name, (claim, write) in med.items():
        print(f"({name}) claim {claim:6.1f} us/job   record {write:6.1f} us/job")
    for ours, other in (("rows", "json"), ("rows", "file"), ("plain", "returning")):
        print(f"record ({ours})/({other}) = {med[ours][1] / med[other][1]:.2f}")
    print(f"record (plain)/(random) = {med['plain'][1] / med['random'][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
