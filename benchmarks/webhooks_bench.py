"""Webhook delivery throughput against the wire limit and the bare outbox (not a timed test;
run it by hand).

Starts one local uvicorn receiver in a child process and registers 10 endpoints on it (10
paths). Endpoint ``i`` subscribes to event type ``bench.i``; event ``n`` has type
``bench.{n % 10}``, so N events make N deliveries, spread evenly over the 10 endpoints.
Then, with the same concurrency, in each of ``--rounds`` interleaved rounds:

(w) a bare aiohttp loop posting N times to the same 10 URLs: no persistence, no signature,
    no retries -- the practical wire limit of a Python client here;
(a) the bare outbox on a fresh SQLite file: submit N jobs to the same 10 URLs (one
    transaction), then a Worker delivers them;
(b) webhooks on a fresh SQLite file: ``send`` N events (one transaction each: event, job and
    delivery row), then the webhook worker delivers them — each attempt signed afresh
    (HMAC-SHA256), its endpoint looked up, the address checked by the SSRF guard, the
    attempt logged and the failure run kept.

Every variant sends through retrysafe's default HTTP engine (aiohttp) or aiohttp itself.
Prints the median deliveries/s of each, with and without the submit/send phase, and the ratios
(b)/(w) (target >= 0.45) and (b)/(a).

    python benchmarks/webhooks_bench.py --events 10000 --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from retrysafe import Outbox, RetryPolicy
from retrysafe.webhooks import Schedule, WebhookPolicy, Webhooks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import bare_aiohttp, endpoint

ENDPOINTS = 10


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
        worker = hooks.worker(concurrency=concurrency, poll_interval=0.05)
        stats = worker.run_until_idle()
        delivered = time.perf_counter()
        if stats.succeeded != events:
            raise SystemExit(f"webhooks delivered {stats.succeeded} of {events}")
        return sent - start, delivered - sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--events", type=positive_int, default=10_000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)"
    )
    args = parser.parse_args(argv)
    n, c = args.events, args.concurrency
    rates: dict[str, list[float]] = {k: [] for k in ("w", "a", "b", "a+", "b+")}
    with endpoint(200) as base, tempfile.TemporaryDirectory() as tmp:
        urls = [f"{base}/ep{i}" for i in range(ENDPOINTS)]
        _bare(base, min(200, n), c, Path(tmp) / "warm.db")
        for r in range(args.rounds):
            rates["w"].append(n / asyncio.run(bare_aiohttp(urls, n, c)))
            a_submit, a_deliver = _bare(base, n, c, Path(tmp) / f"a{r}.db")
            b_send, b_deliver = _webhooks(base, n, c, Path(tmp) / f"b{r}.db")
            rates["a"].append(n / a_deliver)
            rates["b"].append(n / b_deliver)
            rates["a+"].append(n / (a_submit + a_deliver))
            rates["b+"].append(n / (b_send + b_deliver))
    w, a, b, at, bt = (statistics.median(rates[k]) for k in ("w", "a", "b", "a+", "b+"))

    def each(k: str) -> str:
        return ", ".join(f"{v:.0f}" for v in rates[k])

    print(
        f"events={n} endpoints={ENDPOINTS} concurrency={c} rounds={args.rounds} "
        f"cpus={os.cpu_count()} (median; rounds)"
    )
    print(f"(w) bare aiohttp loop : {w:7.0f} deliveries/s ({each('w')})")
    print(f"(a) bare outbox       : {a:7.0f} deliveries/s ({each('a')})")
    print(f"(b) webhooks          : {b:7.0f} deliveries/s ({each('b')})")
    print(f"    including submit/send: (a) {at:7.0f}/s ({each('a+')})")
    print(f"                           (b) {bt:7.0f}/s ({each('b+')})")
    verdict = "met" if b / w >= 0.45 else "MISSED"
    print(f"ratio (b)/(w) = {b / w:.3f}   (b)/(a) = {b / a:.2f}")
    print(f"including send: (b)/(a) = {bt / at:.2f}")
    print(f"target (b) >= 0.45 x (w): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
