"""Outbox throughput against a bare httpx loop (not a timed test; run it by hand).

Starts a local uvicorn endpoint in a child process, then delivers N jobs twice with the same
concurrency:

(a) a bare async httpx loop: no persistence, no key, no retries;
(b) the retrysafe outbox on a fresh SQLite file: ``submit`` N jobs (timed too), then a
    :class:`~retrysafe.Worker` delivers them until every job is terminal.

Prints jobs/s for each and the ratio (b)/(a). Target: (b) >= 0.5 x (a).

    python benchmarks/outbox_bench.py --jobs 2000 --concurrency 32

With ``--store postgresql://…`` (a role allowed to create databases), (b) is replaced by

(c) the outbox on PostgreSQL: a fresh database (``CREATE DATABASE``, dropped at the end; the
    ``retrysafe worker`` CLI has no ``--schema`` option), N jobs submitted in one transaction,
    then ``--workers`` ``python -m retrysafe worker --store URL --until-idle`` processes
    sharing the concurrency; timed from spawning them until every job is terminal and every
    worker has exited (process start-up included). Target: (c) >= 0.5 x (a).

    python benchmarks/outbox_bench.py --jobs 2000 --concurrency 32 \\
        --store postgresql://postgres@127.0.0.1:5432/test --workers 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from retrysafe import JobState, Outbox, RetryPolicy, SQLiteStore
from retrysafe._serving import free_port

_SERVER = """
import uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})

uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False,
            lifespan="off")
"""


def _start_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER.replace("{port}", str(port))])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the benchmark endpoint did not start")


async def _bare(url: str, jobs: int, concurrency: int) -> float:
    """(a): N POSTs with ``concurrency`` workers sharing one client; returns seconds."""
    body = json.dumps({"n": 0}).encode()
    transport = httpx.AsyncHTTPTransport(
        retries=0, limits=httpx.Limits(max_connections=concurrency)
    )
    async with httpx.AsyncClient(transport=transport, timeout=10.0) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(jobs):
            queue.put_nowait(i)

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                response = await client.post(
                    url, content=body, headers={"content-type": "application/json"}
                )
                if response.status_code != 201:
                    raise SystemExit(f"unexpected status {response.status_code}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def _outbox(url: str, jobs: int, concurrency: int, db: Path) -> tuple[float, float]:
    """(b): submit N jobs, then deliver them; returns (submit seconds, deliver seconds)."""
    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    with SQLiteStore(db) as store, Outbox(store, policy=policy) as outbox:
        start = time.perf_counter()
        with store.transaction() as conn:
            for i in range(jobs):
                outbox.submit(url, json={"n": i}, connection=conn)
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
    url: str, jobs: int, concurrency: int, pg_url: str, workers: int
) -> tuple[float, float, list[int]]:
    """(c): submit N jobs to a fresh PostgreSQL database, then ``workers`` worker processes
    deliver them; returns (submit seconds, deliver seconds, per-worker concurrency)."""
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
                        "-c",
                        str(share),
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
                for share in shares
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="postgresql://… to run (c) on a fresh database instead of (b) on SQLite",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="worker processes for --store (default 1)"
    )
    args = parser.parse_args(argv)
    if args.store is not None:
        if not args.store.startswith(("postgresql://", "postgres://")):
            parser.error("--store must be a postgresql:// URL (unset: SQLite)")
        if args.workers < 1:
            parser.error("--workers must be at least 1")
    port = free_port()
    proc = _start_server(port)
    url = f"http://127.0.0.1:{port}/bench"
    try:
        asyncio.run(_bare(url, min(200, args.jobs), args.concurrency))  # warm-up
        bare = asyncio.run(_bare(url, args.jobs, args.concurrency))
        if args.store is not None:
            submit_s, deliver_s, shares = _outbox_pg(
                url, args.jobs, args.concurrency, args.store, args.workers
            )
            return _report_pg(args.jobs, args.concurrency, bare, submit_s, deliver_s, shares)
        with tempfile.TemporaryDirectory() as tmp:
            submit_s, deliver_s = _outbox(url, args.jobs, args.concurrency, Path(tmp) / "b.db")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    a = args.jobs / bare
    b = args.jobs / deliver_s
    b_total = args.jobs / (submit_s + deliver_s)
    print(f"jobs={args.jobs} concurrency={args.concurrency} cpus={os.cpu_count()}")
    print(f"(a) bare httpx loop, no persistence : {a:8.0f} jobs/s  ({bare:.2f} s)")
    print(f"(b) outbox worker on SQLite         : {b:8.0f} jobs/s  ({deliver_s:.2f} s delivering)")
    print(
        f"    including submit                : {b_total:8.0f} jobs/s  (+{submit_s:.2f} s submit)"
    )
    print(f"ratio (b)/(a) = {b / a:.2f}   including submit = {b_total / a:.2f}   target >= 0.50")
    return 0


def _report_pg(
    jobs: int, concurrency: int, bare: float, submit_s: float, deliver_s: float, shares: list[int]
) -> int:
    a = jobs / bare
    c = jobs / deliver_s
    c_total = jobs / (submit_s + deliver_s)
    ratio = c / a
    verdict = "met" if ratio >= 0.5 else "MISSED"
    print(f"jobs={jobs} concurrency={concurrency} cpus={os.cpu_count()}")
    print(f"(a) bare httpx loop, no persistence : {a:8.0f} jobs/s  ({bare:.2f} s)")
    print(
        f"(c) outbox on PostgreSQL, {len(shares)} workers : {c:8.0f} jobs/s  "
        f"({deliver_s:.2f} s delivering, -c {'+'.join(map(str, shares))})"
    )
    print(
        f"    including submit                : {c_total:8.0f} jobs/s  (+{submit_s:.2f} s submit)"
    )
    print(f"ratio (c)/(a) = {ratio:.2f}   including submit = {c_total / a:.2f}   target >= 0.50")
    print(f"target (c) >= 0.5 x (a): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
