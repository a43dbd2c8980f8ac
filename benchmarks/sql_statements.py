"""Where a worker's SQLite time goes: every statement on the store's connections timed while
the worker delivers (not a timed test; run it by hand).

Starts the local endpoint (``benchmarks/_wire.py``), fills a fresh SQLite file with N outbox
jobs (``--what outbox``, one transaction) or N webhook deliveries to 10 endpoints (``--what
webhooks``, one ``send`` each), then delivers them with a worker at ``--concurrency``. Only the
delivery is timed: each ``execute`` on the store's connections (the clock read around the
call, so a statement's figure includes the sqlite3 module's own work). Prints, by statement
(its first words), the microseconds per delivered job, the calls and the microseconds per
call, the total, and the worker process's CPU per job.

    python benchmarks/sql_statements.py --what outbox --jobs 10000
    python benchmarks/sql_statements.py --what webhooks --jobs 10000
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import endpoint

ENDPOINTS = 10
_spent: dict[str, float] = collections.defaultdict(float)
_calls: collections.Counter[str] = collections.Counter()
_timing = False


class _TimedConnection(sqlite3.Connection):
    """A connection whose ``execute`` adds its time to the statement's total while timing."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if not _timing:
            return super().execute(sql, *args)
        start = time.perf_counter()
        try:
            return super().execute(sql, *args)
        finally:
            name = " ".join(sql.split())[:64]
            _spent[name] += time.perf_counter() - start
            _calls[name] += 1


def _timed_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
    kwargs.setdefault("factory", _TimedConnection)
    conn: sqlite3.Connection = _connect(*args, **kwargs)
    return conn


_connect = sqlite3.connect
sqlite3.connect = _timed_connect  # type: ignore[assignment]  # every connection from here on


def _deliver(worker: Any, jobs: int) -> float:
    """Run ``worker`` until idle with the statements timed; the process's CPU seconds."""
    global _timing
    _spent.clear()
    _calls.clear()
    _timing = True
    cpu = time.process_time()
    try:
        stats = worker.run_until_idle()
    finally:
        _timing = False
    if stats.succeeded != jobs:
        raise SystemExit(f"delivered {stats.succeeded} of {jobs}")
    return time.process_time() - cpu


def _outbox(base: str, jobs: int, concurrency: int, db: Path) -> float:
    from retrysafe import Outbox, RetryPolicy

    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    with Outbox(f"sqlite:///{db}", policy=policy) as outbox:
        with outbox.store.transaction() as conn:  # type: ignore[attr-defined]
            for n in range(jobs):
                outbox.submit(f"{base}/ep{n % ENDPOINTS}", json={"n": n}, connection=conn)
        return _deliver(outbox.worker(concurrency=concurrency, poll_interval=0.05), jobs)


def _webhooks(base: str, jobs: int, concurrency: int, db: Path) -> float:
    from retrysafe.webhooks import Schedule, WebhookPolicy, Webhooks

    schedule = Schedule(name="default", attempts=6, base=0.05, cap=1.0, jitter=0.01)
    policy = WebhookPolicy(schedules=(schedule,), timeout=10.0)
    with Webhooks(f"sqlite:///{db}", allow_private=True, policy=policy) as hooks:
        for i in range(ENDPOINTS):
            hooks.add_endpoint(f"{base}/ep{i}", event_types=[f"bench.{i}"])
        for n in range(jobs):
            hooks.send(f"bench.{n % ENDPOINTS}", {"n": n})
        return _deliver(hooks.worker(concurrency=concurrency, poll_interval=0.05), jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--what", choices=("outbox", "webhooks"), default="outbox")
    parser.add_argument("--jobs", type=positive_int, default=10000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--top", type=positive_int, default=12, help="statements to show")
    args = parser.parse_args(argv)
    run = _outbox if args.what == "outbox" else _webhooks
    with endpoint() as base, tempfile.TemporaryDirectory() as tmp:
        cpu = run(base, args.jobs, args.concurrency, Path(tmp) / "bench.db")
    per_job = 1e6 / args.jobs
    print(f"{args.what}: {args.jobs} jobs, concurrency {args.concurrency}")
    print(f"worker process CPU: {cpu * per_job:.0f} us/job")
    print(f"SQLite statements:  {sum(_spent.values()) * per_job:.1f} us/job")
    for name, spent in sorted(_spent.items(), key=lambda kv: -kv[1])[: args.top]:
        calls = _calls[name]
        print(
            f"{spent * per_job:7.1f} us/job {calls:7d} calls {spent / calls * 1e6:7.1f} us/call"
            f"  {name}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
