"""Which HTTP engine goes under retrysafe's client side (not a timed test; run it by hand).

One local uvicorn endpoint that does nothing (its own process), N JSON POSTs at concurrency C
through each candidate, interleaved over ``--rounds`` rounds; prints the median requests/s and
the ratio to a bare aiohttp loop:

(a) aiohttp, a bare ``ClientSession`` loop -- the practical wire limit of a Python client;
(r) retrysafe's engine (:class:`retrysafe._wire.AiohttpEngine`: aiohttp plus the body cap,
    error translation and per-attempt timeout the worker uses);
(x) httpx over the ``httpx-aiohttp`` transport (``pip install httpx-aiohttp``; skipped when
    missing);
(h) httpx with its own connection pool (httpcore), the engine retrysafe used before.

    python benchmarks/http_engines.py --requests 3000 --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import httpx

from retrysafe._wire import AiohttpEngine, total_timeout

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import _loop, bare_aiohttp, bare_httpx, endpoint


async def retrysafe_engine(url: str, n: int, concurrency: int) -> float:
    """(r): N POSTs through retrysafe's default engine, as the worker sends them."""
    engine = AiohttpEngine(
        connect_timeout=5.0,
        read_timeout=10.0,
        max_connections=concurrency,
        attempt_timeout=10.0,  # as the worker's engine: every send below is under it
    )
    body = json.dumps({"n": 0}).encode()
    headers = [("content-type", "application/json"), ("Idempotency-Key", "k")]

    async def post(i: int) -> None:
        async with total_timeout(10.0):
            answer = await engine.send("POST", url, headers=headers, body=body, keep=65536)
        if not 200 <= answer.status < 300:
            raise SystemExit(f"unexpected status {answer.status}")

    try:
        return await _loop(n, concurrency, post)
    finally:
        await engine.aclose()


async def via_httpx_aiohttp(url: str, n: int, concurrency: int) -> float:
    """(x): N POSTs through httpx over the httpx-aiohttp transport."""
    from httpx_aiohttp import AiohttpTransport

    transport = AiohttpTransport(limits=httpx.Limits(max_connections=concurrency))
    body = json.dumps({"n": 0}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(transport=transport, timeout=10.0) as client:

        async def post(i: int) -> None:
            r = await client.post(url, content=body, headers=headers)
            if not r.is_success:
                raise SystemExit(f"unexpected status {r.status_code}")

        return await _loop(n, concurrency, post)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=positive_int, default=3000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args(argv)
    n, c = args.requests, args.concurrency
    have_x = importlib.util.find_spec("httpx_aiohttp") is not None
    if not have_x:
        print("httpx-aiohttp is not installed: (x) skipped (pip install httpx-aiohttp)")
    rates: dict[str, list[float]] = {"a": [], "r": [], "x": [], "h": []}
    with endpoint() as base:
        url = f"{base}/bench"
        asyncio.run(bare_aiohttp([url], min(300, n), c))  # warm-up
        for _ in range(args.rounds):
            rates["a"].append(n / asyncio.run(bare_aiohttp([url], n, c)))
            rates["r"].append(n / asyncio.run(retrysafe_engine(url, n, c)))
            if have_x:
                rates["x"].append(n / asyncio.run(via_httpx_aiohttp(url, n, c)))
            rates["h"].append(n / asyncio.run(bare_httpx([url], n, c)))
    labels = {
        "a": "aiohttp, bare loop",
        "r": "retrysafe engine (aiohttp)",
        "x": "httpx + httpx-aiohttp transport",
        "h": "httpx, own pool (httpcore)",
    }
    a = statistics.median(rates["a"])
    print(f"requests={n} concurrency={c} rounds={args.rounds} cpus={os.cpu_count()}")
    for k, label in labels.items():
        if not rates[k]:
            continue
        m = statistics.median(rates[k])
        each = ", ".join(f"{v:.0f}" for v in rates[k])
        print(f"({k}) {label:<32}: {m:7.0f} req/s  {m / a:5.2f} x (a)  ({each})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
