"""Outbox throughput against the wire limit (not a timed test; run it by hand).

Starts a local uvicorn endpoint in a child process, then, in each of ``--rounds``
interleaved rounds, delivers N jobs with the same concurrency:

(a) a bare aiohttp loop: no persistence, no key, no retries -- the practical wire limit of
    a Python client here;
(h) a bare httpx loop (httpx's own pool), the engine the outbox used before;
(b) the retrysafe outbox on a fresh SQLite file: ``submit`` N jobs (timed too), then a
    :class:`~retrysafe.Worker` delivers them until every job is terminal.

Prints the median jobs/s of each and the ratio (b)/(a). Target: (b) >= 0.5 x (a).

    python benchmarks/outbox_bench.py --jobs 2000 --concurrency 32 --rounds 3

With ``--store postgresql://…`` (a role allowed to create databases), (b) is replaced by

(c) the outbox on PostgreSQL: a fresh database (``CREATE DATABASE``, dropped at the end; the
    ``retrysafe worker`` CLI has no ``--schema`` option), N jobs submitted in one transaction,
    then ``--workers`` ``python -m retrysafe worker --store URL --until-idle`` processes
    sharing the concurrency; timed from spawning them until every job is terminal and every
    worker has exited (process start-up included). Target: (c) >= 2,000 jobs/s.

(p) with ``--workers`` above 1, also the same workers forked by one ``python -m retrysafe
    worker --processes N -c C`` command (C: the smallest share), timed the same way: one
    start-up instead of N. Target: (p) >= 2,000 jobs/s.

    python benchmarks/outbox_bench.py --jobs 2000 --concurrency 32 \\
        --store postgresql://postgres@127.0.0.1:5432/test --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from retrysafe import JobState, Outbox, RetryPolicy, SQLiteStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import bare_aiohttp, bare_httpx, endpoint, json_body


def _outbox(
    url: str, jobs: int, concurrency: int, db: Path, body_bytes: int | None = None
) -> tuple[float, float]:
    """(b): submit N jobs, then deliver them; returns (submit seconds, deliver seconds)."""
    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    padded = None if body_bytes is None else json_body(body_bytes)
    json_type = {"content-type": "application/json"}
    with SQLiteStore(db) as store, Outbox(store, policy=policy) as outbox:
        start = time.perf_counter()
        with store.transaction() as conn:
            for i in range(jobs):
                if padded is None:
                    outbox.submit(url, json={"n": i}, connection=conn)
                else:
                    outbox.submit(url, content=padded, headers=json_type, connection=conn)
        submitted = time.perf_counter()
        stats = outbox.worker(concurrency=concurrency, poll_interval=0.05).run_until_idle()
        delivered = time.perf_counter()
        counts = outbox.counts()
        if stats.succeeded != jobs:
            raise SystemExit(f"outbox delivered {stats.succeeded} of {jobs}: {counts}")
        return submitted - start, delivered - submitted


@contextmanager
def _fresh_database(pg_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``pg_url``; its URL. Dropped afterwards."""
    import psycopg

    name = f"rs_outbox_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield urlsplit(pg_url)._replace(path="/" + name).geturl()
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _split(total: int, parts: int) -> list[int]:
    """``total`` concurrency over ``parts`` workers, at least 1 each."""
    base, extra = divmod(total, parts)
    return [max(1, base + (1 if n < extra else 0)) for n in range(parts)]


def _outbox_pg(
    url: str, jobs: int, concurrency: int, pg_url: str, workers: int, *, forked: bool = False
) -> tuple[float, float, list[int]]:
    """(c): submit N jobs to a fresh PostgreSQL database, then ``workers`` worker processes
    deliver them -- each started on its own, or (``forked``, (p)) one ``retrysafe worker
    --processes`` command forking them; returns (submit seconds, deliver seconds, per-worker
    concurrency)."""
    from retrysafe.stores import PostgresStore

    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    shares = _split(concurrency, workers)
    with _fresh_database(pg_url) as db_url:
        with PostgresStore(db_url) as store, Outbox(store, policy=policy) as outbox:
            start = time.perf_counter()
            with store.transaction() as conn:
                for i in range(jobs):
                    outbox.submit(url, json={"n": i}, connection=conn)
            submitted = time.perf_counter()
            commands = [["-c", str(share)] for share in shares]
            if forked:  # one command; its --processes share one -c each
                commands = [["-c", str(shares[-1]), "--processes", str(workers)]]
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "retrysafe",
                        "worker",
                        "--store",
                        db_url,
                        "--until-idle",
                        *command,
                        "--timeout",
                        "10",
                        "--wait-initial",
                        "0.05",
                        "--wait-max",
                        "1.0",
                        "--json",
                    ],
                    stdout=subprocess.DEVNULL,
                )
                for command in commands
            ]
            codes = [p.wait() for p in procs]
            delivered = time.perf_counter()
            counts = outbox.counts()
        succeeded = counts.get(JobState.SUCCEEDED, 0)
        if succeeded != jobs or any(codes):
            raise SystemExit(
                f"outbox delivered {succeeded} of {jobs}: {counts}; worker exit codes {codes}"
            )
    return submitted - start, delivered - submitted, shares


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _check_store(parser: argparse.ArgumentParser, url: str) -> None:
    """Exit with a usage error (not a driver traceback) when ``url`` cannot be reached."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        parser.error(f"--store: cannot use {url.split('@')[-1]}: {str(exc).strip()[:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--jobs", type=positive_int, default=2000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)"
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="postgresql://… to run (c) on a fresh database instead of (b) on SQLite",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=1, help="worker processes for --store (default 1)"
    )
    parser.add_argument(
        "--body-bytes",
        type=positive_int,
        default=None,
        metavar="N",
        help="every request (every loop's, every job's) a JSON body of N bytes (default: "
        '{"n": i}, a dozen bytes); SQLite keeps a body over 3.5 KiB in a table of its own',
    )
    args = parser.parse_args(argv)
    if args.store is not None:
        if not args.store.startswith(("postgresql://", "postgres://")):
            parser.error("--store must be a postgresql:// URL (unset: SQLite)")
        _check_store(parser, args.store)
    elif args.workers != 1:
        parser.error("--workers needs --store (the SQLite run has one worker)")
    if args.body_bytes is not None and args.store is not None:
        parser.error("--body-bytes is for the SQLite run (no --store)")
    if args.body_bytes is not None and args.body_bytes < 8:
        parser.error("--body-bytes must be at least 8 (the smallest padded JSON object)")
    size = args.body_bytes
    n, c = args.jobs, args.concurrency
    rates: dict[str, list[float]] = {"a": [], "h": [], "b": [], "b+submit": [], "p": []}
    shares: list[int] = []
    with endpoint() as base:
        url = f"{base}/bench"
        asyncio.run(bare_aiohttp([url], min(200, n), c))  # warm-up
        for _ in range(args.rounds):
            rates["a"].append(n / asyncio.run(bare_aiohttp([url], n, c, size)))
            rates["h"].append(n / asyncio.run(bare_httpx([url], n, c, size)))
            if args.store is not None:
                submit_s, deliver_s, shares = _outbox_pg(url, n, c, args.store, args.workers)
                if args.workers > 1:
                    forked = _outbox_pg(url, n, c, args.store, args.workers, forked=True)
                    rates["p"].append(n / forked[1])
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    submit_s, deliver_s = _outbox(url, n, c, Path(tmp) / "b.db", size)
            rates["b"].append(n / deliver_s)
            rates["b+submit"].append(n / (submit_s + deliver_s))
    a, h, b, bt = (_median(rates[k]) for k in ("a", "h", "b", "b+submit"))

    def each(k: str) -> str:
        return ", ".join(f"{v:.0f}" for v in rates[k])

    bodies = "" if size is None else f" body={size} bytes"
    print(
        f"jobs={n} concurrency={c}{bodies} rounds={args.rounds} cpus={os.cpu_count()}"
        " (median; rounds)"
    )
    print(f"(a) bare aiohttp loop, no persistence : {a:8.0f} jobs/s  ({each('a')})")
    print(f"(h) bare httpx loop, no persistence   : {h:8.0f} jobs/s  ({each('h')})")
    if args.store is not None:
        label = f"(c) outbox on PostgreSQL, {len(shares)} workers"
        print(f"{label:<38}: {b:8.0f} jobs/s  ({each('b')}; -c {'+'.join(map(str, shares))})")
        print(f"    including submit                  : {bt:8.0f} jobs/s  ({each('b+submit')})")
        print(f"ratio (c)/(a) = {b / a:.2f}   (c)/(h) = {b / h:.2f}")
        print(f"target (c) >= 2,000 jobs/s: {'met' if b >= 2000 else 'MISSED'}")
        if rates["p"]:
            p = _median(rates["p"])
            label = f"(p) one worker --processes {len(shares)}"
            print(f"{label:<38}: {p:8.0f} jobs/s  ({each('p')}; -c {shares[-1]} each)")
            print(f"target (p) >= 2,000 jobs/s: {'met' if p >= 2000 else 'MISSED'}")
        return 0
    print(f"(b) outbox worker on SQLite           : {b:8.0f} jobs/s  ({each('b')})")
    print(f"    including submit                  : {bt:8.0f} jobs/s  ({each('b+submit')})")
    verdict = "met" if b / a >= 0.5 else "MISSED"
    print(f"ratio (b)/(a) = {b / a:.3f}   including submit = {bt / a:.2f}   (b)/(h) = {b / h:.2f}")
    print(f"target (b) >= 0.50 x (a): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
