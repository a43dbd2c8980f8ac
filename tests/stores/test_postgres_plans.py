"""How PostgreSQL runs the worker's hot statements: each touches the jobs it names, never a
scan of the whole table whatever the table's size (a drained queue's table is small, and
there the planner finds a scan cheap)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from retrysafe import JobState, Outbox
from retrysafe.client import outbox_store
from retrysafe.client._models import Finish
from retrysafe.client._store import _SQL, finish_rows
from retrysafe.stores import PostgresStore
from retrysafe.stores._connector import JsonText

from .test_outbox_store_contract import T0, _attempt


@pytest.fixture
def store(pg_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    with PostgresStore(pg_url, schema=pg_schema, clock="caller") as store:
        yield store


def _reads(plan: dict[str, Any]) -> Iterator[tuple[str, list[str]]]:
    """Every scan of outbox_jobs in the plan tree: (node type, the indexes it walks)."""
    if plan.get("Relation Name") == "outbox_jobs" and plan["Node Type"].endswith("Scan"):
        children = plan.get("Plans", [])
        walks = [plan["Index Name"]] if "Index Name" in plan else []
        walks += [c["Index Name"] for c in children if c["Node Type"] == "Bitmap Index Scan"]
        yield plan["Node Type"], walks
    for child in plan.get("Plans", []):
        yield from _reads(child)


def test_a_batch_of_finishes_reads_its_jobs_by_their_ids(store: PostgresStore) -> None:
    """2,000 jobs, 32 of them leased, statistics fresh: recording 16 attempts looks their jobs
    up by primary key. The planner's first choice here was a scan of every in-flight job (a
    sequential scan, or all of ``outbox_jobs_due``, whose first column the statement does not
    bind), 3-8 ms per batch under four workers (``benchmarks/outbox_bench.py --store``)."""
    outbox = Outbox(store)
    with store.transaction() as conn:
        for i in range(2000):
            outbox.submit(f"http://example.test/{i}", json={"i": i}, connection=conn)
    jobs = outbox_store(store).claim_jobs(
        queue="default", token="t", now=T0 + 1e9, lease=60, limit=32
    )
    assert len(jobs) == 32
    with store.transaction() as conn:
        conn.execute("ANALYZE outbox_jobs")
    finishes = [
        Finish(
            job_id=job.id,
            token="t",
            attempt=_attempt(job.id, job.key),
            state=JobState.SUCCEEDED,
            due_at=T0,
            last_delay=0.0,
            error=None,
            now=T0,
        )
        for job in jobs[:16]
    ]
    [statement] = _SQL["finish_attempts"].parts["postgres"]
    params = {"finishes": JsonText(finish_rows(store.clock, finishes))}
    with store.transaction() as conn:  # EXPLAIN alone runs nothing
        [[[explained]]] = conn.execute(b"EXPLAIN (FORMAT JSON) " + statement, params).fetchall()
    reads = list(_reads(explained["Plan"]))
    assert reads, json.dumps(explained)[:2000]
    assert all(walks == ["outbox_jobs_pkey"] for _, walks in reads), reads
