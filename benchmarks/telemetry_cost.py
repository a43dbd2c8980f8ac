"""What metrics cost: the middleware and the outbox worker with telemetry off and with
:class:`~retrysafe.observability.Prometheus` on (not a timed test; run it by hand).

In each of ``--rounds`` interleaved rounds:

(m) the middleware on a fresh SQLite key store, driven in-process through its ASGI interface
    (no sockets, no HTTP parsing: the worst case for a relative cost, since nothing else
    dilutes it): ``--requests`` first-time-key POSTs, one at a time, telemetry off, then on;
(w) the outbox worker on a fresh SQLite file delivering ``--jobs`` jobs to a local uvicorn
    endpoint at ``--concurrency``, telemetry off, then on.

Prints the median throughput of each and the cost (1 - median of the rounds' on/off ratios).
The middleware is measured per CPU second of its process (one CPU-bound thread: what other
processes on a shared machine distort least; the wall-clock ratio is printed beside it); the
worker, which waits on a separate endpoint process, in jobs per wall second. Target: <= 5 %
each.
Also times one scrape of the store collector over ``--jobs`` jobs (the statement's cost).

    python benchmarks/telemetry_cost.py --requests 5000 --jobs 2000 --concurrency 32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from retrysafe import IdempotencyMiddleware, Outbox, RetryPolicy, SQLiteStore
from retrysafe.observability import Prometheus, StoreCollector

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import endpoint


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b'{"ok":true}'})


async def _drive(app: Any, n: int, round_no: int) -> tuple[float, float]:
    """N first-time-key POSTs straight into the ASGI app; returns (requests per wall second,
    requests per CPU second of this process)."""
    body = b'{"amount":100}'

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    start, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        scope = {
            "type": "http", "method": "POST", "path": "/charge", "query_string": b"",
            "headers": [(b"content-type", b"application/json"),
                        (b"idempotency-key", f"r{round_no}-{i}".encode())],
        }  # fmt: skip
        await app(scope, receive, send)
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


def _middleware(n: int, round_no: int, telemetry: Any) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        store = SQLiteStore(Path(d) / "keys.db")
        app = IdempotencyMiddleware(_app, store, telemetry=telemetry)
        try:
            return asyncio.run(_drive(app, n, round_no))
        finally:
            store.close()


def _worker(url: str, jobs: int, concurrency: int, telemetry: Any) -> float:
    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    with (
        tempfile.TemporaryDirectory() as d,
        SQLiteStore(Path(d) / "o.db") as store,
        Outbox(store, policy=policy) as outbox,
    ):
        with store.transaction() as conn:
            for i in range(jobs):
                outbox.submit(url, json={"n": i}, connection=conn)
        start = time.perf_counter()
        stats = outbox.worker(
            concurrency=concurrency, poll_interval=0.05, telemetry=telemetry
        ).run_until_idle()
        took = time.perf_counter() - start
        if stats.succeeded != jobs:
            raise SystemExit(f"delivered {stats.succeeded} of {jobs}")
        return jobs / took


def _scrape(jobs: int) -> float:
    """Seconds one scrape of the store collector takes over ``jobs`` jobs (median of 5)."""
    with (
        tempfile.TemporaryDirectory() as d,
        SQLiteStore(Path(d) / "o.db") as store,
        Outbox(store) as outbox,
    ):
        with store.transaction() as conn:
            for i in range(jobs):
                outbox.submit("http://127.0.0.1:9/x", json={"n": i}, connection=conn)
        registry = CollectorRegistry()
        StoreCollector(store, registry=registry)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            generate_latest(registry)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=5000)
    parser.add_argument("--jobs", type=positive_int, default=2000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args(argv)
    m_off: list[float] = []  # requests per CPU second: the loop is one CPU-bound thread,
    m_on: list[float] = []  # so other processes on the shared machine distort it least
    m_wall: list[tuple[float, float]] = []
    w_off: list[float] = []
    w_on: list[float] = []
    metrics = Prometheus(CollectorRegistry())
    with endpoint() as url:
        _worker(url + "/warm", 200, args.concurrency, None)  # warm the endpoint and imports
        for r in range(args.rounds):
            # Alternate which goes first, so drift on the shared machine hits both alike.
            order = [(None, m_off, w_off), (metrics, m_on, w_on)]
            if r % 2:
                order.reverse()
            walls: dict[bool, float] = {}
            for telemetry, m, w in order:
                wall, cpu = _middleware(args.requests, r, telemetry)
                m.append(cpu)
                walls[telemetry is None] = wall
                w.append(_worker(url + "/job", args.jobs, args.concurrency, telemetry))
            m_wall.append((walls[True], walls[False]))
            print(f"round {r + 1}: middleware off {m_off[-1]:,.0f} on {m_on[-1]:,.0f} req/CPU-s; "
                  f"worker off {w_off[-1]:,.0f} on {w_on[-1]:,.0f} jobs/s", flush=True)  # fmt: skip
    med = statistics.median
    wall_ratio = med([b / a for a, b in m_wall])
    print(f"middleware wall clock: off {med([a for a, _ in m_wall]):,.0f} req/s, on "
          f"{med([b for _, b in m_wall]):,.0f} req/s; median on/off {wall_ratio:.3f}")  # fmt: skip
    for name, off, on, unit in (
        ("middleware (in-process ASGI, SQLite; per CPU second)", m_off, m_on, "req/s"),
        (f"outbox worker (SQLite, c={args.concurrency})", w_off, w_on, "jobs/s"),
    ):
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        cost = 1.0 - med(ratios)
        verdict = "met" if cost <= 0.05 else "MISSED"
        print(
            f"{name}: off {med(off):,.0f} {unit}, on {med(on):,.0f} {unit}; median on/off "
            f"{med(ratios):.3f} -> cost {cost:+.1%} (target <= 5 %: {verdict})"
        )
    print(f"store collector scrape over {args.jobs:,} jobs: {_scrape(args.jobs) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
