"""Webhook delivery throughput against the bare outbox (not a timed test; run it by hand).

Starts one local uvicorn receiver in a child process and registers 10 endpoints on it (10
paths). Endpoint ``i`` subscribes to event type ``bench.i``; event ``n`` has type
``bench.{n % 10}``, so N events make N deliveries, spread evenly over the 10 endpoints.
Then, with the same concurrency:

(a) the bare outbox on a fresh SQLite file: submit N jobs to the same 10 URLs (one
    transaction), then a Worker delivers them;
(b) webhooks on a fresh SQLite file: ``send`` N events (one transaction each: event, job and
    delivery row), then the webhook worker delivers them — each attempt signed afresh
    (HMAC-SHA256), its endpoint looked up, the address checked by the SSRF guard, the
    attempt logged and the failure run kept.

Prints deliveries/s for each, with and without the submit/send phase, and the ratio (b)/(a).

    python benchmarks/webhooks_bench.py --events 10000 --concurrency 32
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from retrysafe import Outbox, RetryPolicy
from retrysafe._serving import free_port
from retrysafe.webhooks import Schedule, WebhookPolicy, Webhooks

ENDPOINTS = 10


def _pool(concurrency: int) -> httpx.AsyncHTTPTransport:
    """The connection pool the bare Worker builds for itself; (b) gets an identical one
    (wrapped by the SSRF guard), so the comparison measures the webhook layer alone."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncHTTPTransport(retries=0, limits=limits)


_SERVER = """
import uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
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
    raise SystemExit("the benchmark receiver did not start")


def _bare(base: str, events: int, concurrency: int, db: Path) -> tuple[float, float]:
    """(a): submit N jobs, deliver them; returns (submit seconds, deliver seconds)."""
    policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
    with Outbox(f"sqlite:///{db}", policy=policy) as outbox:
        start = time.perf_counter()
        with outbox.store.transaction() as conn:  # type: ignore[attr-defined]
            for n in range(events):
                outbox.submit(f"{base}/ep{n % ENDPOINTS}", json={"n": n}, connection=conn)
        submitted = time.perf_counter()
        stats = outbox.worker(concurrency=concurrency, poll_interval=0.05).run_until_idle()
        delivered = time.perf_counter()
        if stats.succeeded != events:
            raise SystemExit(f"outbox delivered {stats.succeeded} of {events}")
        return submitted - start, delivered - submitted


def _webhooks(base: str, events: int, concurrency: int, db: Path) -> tuple[float, float]:
    """(b): send N events, deliver them; returns (send seconds, deliver seconds)."""
    schedule = Schedule(name="default", attempts=6, base=0.05, cap=1.0, jitter=0.01)
    policy = WebhookPolicy(schedules=(schedule,), timeout=10.0)
    with Webhooks(f"sqlite:///{db}", allow_private=True, policy=policy) as hooks:
        for i in range(ENDPOINTS):
            hooks.add_endpoint(f"{base}/ep{i}", event_types=[f"bench.{i}"])
        start = time.perf_counter()
        for n in range(events):
            hooks.send(f"bench.{n % ENDPOINTS}", {"n": n})
        sent = time.perf_counter()
        worker = hooks.worker(
            concurrency=concurrency, poll_interval=0.05, transport=_pool(concurrency)
        )
        stats = worker.run_until_idle()
        delivered = time.perf_counter()
        if stats.succeeded != events:
            raise SystemExit(f"webhooks delivered {stats.succeeded} of {events}")
        return sent - start, delivered - sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    port = free_port()
    proc = _start_server(port)
    base = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _bare(base, min(200, args.events), args.concurrency, Path(tmp) / "warm.db")
            a_submit, a_deliver = _bare(base, args.events, args.concurrency, Path(tmp) / "a.db")
            b_send, b_deliver = _webhooks(base, args.events, args.concurrency, Path(tmp) / "b.db")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    n = args.events
    a, b = n / a_deliver, n / b_deliver
    a_total, b_total = n / (a_submit + a_deliver), n / (b_send + b_deliver)
    print(f"events={n} endpoints={ENDPOINTS} concurrency={args.concurrency} cpus={os.cpu_count()}")
    print(f"(a) bare outbox : {a:7.0f} deliveries/s ({a_deliver:.2f} s, +{a_submit:.2f} s submit)")
    print(f"(b) webhooks    : {b:7.0f} deliveries/s ({b_deliver:.2f} s, +{b_send:.2f} s send)")
    print(f"    including send: (a) {a_total:8.0f}/s   (b) {b_total:8.0f}/s")
    print(f"ratio (b)/(a) = {b / a:.2f} delivering, {b_total / a_total:.2f} including send")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
