"""Four worker processes on one PostgreSQL outbox through the chaos proxy, one SIGKILLed
(SPEC §5, §9): every job ends SUCCEEDED with exactly one effect.

1. A fresh PostgreSQL database (``CREATE DATABASE``, dropped at the end).
2. A publishing endpoint (one effect per call, counted in an :class:`EffectLedger`) behind
   :class:`~retrysafe.IdempotencyMiddleware` on a :class:`PostgresStore` in that database
   (schema ``endpoint``), served on loopback.
3. :class:`ChaosProxy` in front: 2.5 % of answers lost after commit, plus small rates of 503
   after commit, resets and 503 before forwarding, and latency.
4. ``--jobs`` jobs recorded in the PostgreSQL outbox (one transaction), then ``--workers``
   ``retrysafe worker --store postgresql://… --until-idle`` processes; once a third of the jobs
   have had their effect, the first worker is SIGKILLed. Its leased jobs are taken over by the
   others when their leases (``--lease``) expire.
5. The link heals; UNKNOWN jobs are reconciled with their same keys (up to 5 passes: a
   reconcile attempt can itself end UNKNOWN).

Prints jobs/s, the SUCCEEDED count, duplicate effects and lost jobs (a job without an effect):
a summary on stderr, one JSON line on stdout. Exit status 0 only when every job SUCCEEDED with
0 duplicates and 0 lost, and every worker but the killed one settled: it exited 0, or 1 after
leaving jobs UNKNOWN (attempts that ran out on lost answers; step 5 reconciles them).

    python benchmarks/pg_workers.py --jobs 10000 --workers 4

PostgreSQL: ``--pg`` (default ``RETRYSAFE_TEST_POSTGRES`` or
``postgresql://postgres@127.0.0.1:5432/test``), a role allowed to create databases.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from retrysafe import JobState, Outbox, RetryPolicy
from retrysafe._serving import ServerThread
from retrysafe.chaos import ChaosProxy, EffectLedger, FaultRates
from retrysafe.demo import PublishingService
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import PostgresStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_float, positive_int

DEFAULT_PG = os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
RATES = FaultRates(
    lose_after_commit=0.025,
    error_after_commit=0.005,
    reset_before_forward=0.005,
    error_before_forward=0.005,
    latency=0.02,
    latency_seconds=(0.01, 0.05),
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def fresh_database(pg_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``pg_url``; its URL. Dropped afterwards."""
    import psycopg

    name = f"rs_pg_workers_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield urlsplit(pg_url)._replace(path="/" + name).geturl()
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


#: Reconcile passes at most, until no job is UNKNOWN.
RECONCILE_PASSES = 5
#: What a ``worker --until-idle`` that left jobs UNKNOWN says as it exits 1.
_UNKNOWN_LEFT = "jobs left UNKNOWN:"


def _start_worker(db_url: str, args: argparse.Namespace, log: TextIO) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "retrysafe",
        "worker",
        "--store",
        db_url,
        "--until-idle",
        "-c",
        str(args.concurrency),
        "--attempts",
        "6",
        "--timeout",
        str(args.timeout),
        "--wait-initial",
        "0.05",
        "--wait-max",
        "0.5",
        "--lease",
        str(args.lease),
        "--json",
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run; the figures as a dict (see the module docstring)."""
    with fresh_database(args.pg) as db_url, tempfile.TemporaryDirectory() as tmp:
        ledger = EffectLedger()
        keys = PostgresStore(db_url, schema="endpoint")
        outbox_store = PostgresStore(db_url)
        app = IdempotencyMiddleware(PublishingService(ledger, work_seconds=0.001), store=keys)
        policy = RetryPolicy(attempts=6, wait_initial=0.05, wait_max=0.5, timeout=args.timeout)
        try:
            with (
                ServerThread(app) as server,
                ChaosProxy(server.url, rates=RATES, seed=args.seed) as proxy,
                Outbox(outbox_store, policy=policy) as outbox,
            ):
                url = proxy.url + "/posts"
                with outbox_store.transaction() as conn:
                    for i in range(args.jobs):
                        body = {"operation": f"pg:{i}", "channel": "feed", "text": f"post {i}"}
                        outbox.submit(url, json=body, connection=conn)
                _say(f"{args.jobs} jobs in the outbox; starting {args.workers} workers")
                logs = [(Path(tmp) / f"worker-{n}.log").open("w") for n in range(args.workers)]
                started = time.monotonic()
                workers = [_start_worker(db_url, args, log) for log in logs]
                killed: int | None = None
                kill_at = args.jobs // 3
                deadline = started + args.max_seconds
                while any(w.poll() is None for w in workers):
                    if killed is None and ledger.total() >= kill_at:
                        workers[0].send_signal(signal.SIGKILL)
                        killed = workers[0].pid
                        _say(f"SIGKILLed worker {killed} after {ledger.total()} effects")
                    if time.monotonic() > deadline:
                        for w in workers:
                            w.kill()
                        raise SystemExit(f"workers still running after {args.max_seconds} s")
                    time.sleep(0.02)
                delivered = time.monotonic() - started
                exit_codes = [w.returncode for w in workers]
                for log in logs:
                    log.close()
                tails = [
                    (Path(tmp) / f"worker-{n}.log").read_text()[-2000:] for n in range(len(workers))
                ]
                # Exit 1 with "left UNKNOWN" is a worker that did its work: its attempts ran out
                # on answers the proxy lost (more of them time out on a loaded host), and the
                # reconcile below settles those jobs. Any other non-zero exit is a failure.
                settled = [
                    code == 0 or (code == 1 and _UNKNOWN_LEFT in tail)
                    for code, tail in zip(exit_codes, tails, strict=True)
                ]
                for n, text in enumerate(tails):
                    if n > 0 and not settled[n]:
                        _say(f"worker failed:\n{text}")
                before = outbox.counts()
                unknown = before.get(JobState.UNKNOWN, 0)
                proxy.heal()
                # A reconcile attempt can itself end UNKNOWN (it timed out on a loaded host,
                # or met the key still running): pass again, as an operator would, up to
                # RECONCILE_PASSES times, 0.5 s apart.
                reconciled = passes = 0
                while outbox.counts().get(JobState.UNKNOWN, 0) and passes < RECONCILE_PASSES:
                    if passes:
                        time.sleep(0.5)
                    reconciled += outbox.reconcile().succeeded
                    passes += 1
                after = outbox.counts()
                faults = proxy.stats().to_dict()
        finally:
            keys.close()
    counts = ledger.counts()
    operations = [f"pg:{i}" for i in range(args.jobs)]
    duplicates = sum(max(0, counts.get(op, 0) - 1) for op in operations)
    lost = sum(1 for op in operations if counts.get(op, 0) == 0)
    succeeded = after.get(JobState.SUCCEEDED, 0)
    return {
        "jobs": args.jobs,
        "workers": args.workers,
        "killed_worker": killed,
        "worker_exit_codes": exit_codes,
        "workers_settled": settled,
        "seconds": round(delivered, 2),
        "jobs_per_second": round(args.jobs / delivered, 1),
        "unknown_before_reconcile": unknown,
        "reconciled": reconciled,
        "reconcile_passes": passes,
        "states": {state.value: n for state, n in after.items() if n},
        "succeeded": succeeded,
        "effects": ledger.total(),
        "duplicates": duplicates,
        "lost": lost,
        "faults": faults,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=positive_int, default=10_000)
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("-c", "--concurrency", type=positive_int, default=16, help="per worker")
    parser.add_argument("--timeout", type=positive_float, default=2.0, help="seconds per attempt")
    parser.add_argument("--lease", type=positive_float, default=5.0, help="job lease, seconds")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL URL (creates a database)")
    parser.add_argument("--max-seconds", type=positive_float, default=900.0)
    args = parser.parse_args()
    logging.getLogger("retrysafe").setLevel(logging.ERROR)
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    result = run(args)
    _say(
        f"{result['jobs']} jobs, {result['workers']} workers (one SIGKILLed): "
        f"{result['seconds']} s, {result['jobs_per_second']} jobs/s; "
        f"SUCCEEDED {result['succeeded']}, duplicates {result['duplicates']}, "
        f"lost {result['lost']} (UNKNOWN reconciled: {result['reconciled']})"
    )
    print(json.dumps(result))
    ok = (
        result["succeeded"] == result["jobs"]
        and result["duplicates"] == 0
        and result["lost"] == 0
        and result["killed_worker"] is not None
        and all(result["workers_settled"][1:])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
