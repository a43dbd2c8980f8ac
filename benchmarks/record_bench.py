"""The outbox worker's SQLite statements per job: the claim, and two ways to record a batch of
finished attempts (not a timed test; run it by hand).

Submits N jobs to a fresh SQLite file, then claims them 32 at a time and records each batch as
succeeded, on one connection, in a transaction per claim and per record, as the worker's group
commit does:

(json)  the store's ``finish_attempts`` operation: the batch as one JSON array, taken apart
        by two statements (``json_each`` and ``json_extract``), the shipped way;
(many)  the same two writes as ``executemany`` with positional parameters, one row per
        finish: the candidate (it learns only a row count, so it is not shipped).

Prints CPU microseconds per job of the claim and of each record, and (many)/(json).

    python benchmarks/record_bench.py --jobs 20000
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

from retrysafe import Outbox, SQLiteStore
from retrysafe.client import _store as ops
from retrysafe.client._models import Attempt, Finish, Job, JobState
from retrysafe.stores._connector import drive
from retrysafe.stores._sqlite import _execute

_INSERT = """
INSERT INTO outbox_attempts (job_id, number, idempotency_key, started_at, duration, outcome,
                             status, error_type, replayed, counted)
SELECT id, sends + 1, ?, ?, ?, ?, ?, ?, ?, ? FROM outbox_jobs
WHERE id = ? AND lease_token = ? AND state = 'in_flight'"""
_UPDATE = """
UPDATE outbox_jobs
SET state = ?, due_at = ?, attempts = attempts + 1, sends = sends + 1, last_delay = ?,
    lease_token = NULL, lease_expires_at = NULL, finished_at = ?, last_status = ?,
    last_outcome = ?, last_error = NULL, updated_at = ?
WHERE id = ? AND lease_token = ? AND state = 'in_flight'"""


def _record_json(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    finishes = [
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
    drive(ops.finish_attempts("caller", finishes), lambda req: _execute(conn, req))


def _record_many(conn: sqlite3.Connection, jobs: list[Job], now: float) -> None:
    conn.executemany(
        _INSERT, [(j.key, now, 0.01, "success", 201, None, 0, 1, j.id, j.lease_token) for j in jobs]
    )
    conn.executemany(
        _UPDATE,
        [("succeeded", now, 0.0, now, 201, "success", now, j.id, j.lease_token) for j in jobs],
    )


def _run(n: int, record: object) -> tuple[float, float]:
    """(claim, record) CPU microseconds per job over N jobs."""
    with tempfile.TemporaryDirectory() as d, SQLiteStore(Path(d) / "o.db") as store:
        with Outbox(store) as outbox, store.transaction() as tx:
            for i in range(n):
                outbox.submit("http://127.0.0.1:9/jobs", json={"n": i}, connection=tx)
        conn = sqlite3.connect(Path(d) / "o.db", isolation_level=None)
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
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows: dict[str, list[tuple[float, float]]] = {"json": [], "many": []}
    for _ in range(args.rounds):  # interleaved: noise hits both alike
        rows["json"].append(_run(args.jobs, _record_json))
        rows["many"].append(_run(args.jobs, _record_many))
    med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    for name, (claim, write) in med.items():
        print(f"({name}) claim {claim:6.1f} us/job   record {write:6.1f} us/job")
    print(f"record (many)/(json) = {med['many'][1] / med['json'][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
