"""Which HTTP engine goes under retrysafe's client side (not a timed test; run it by hand).

One local uvicorn endpoint that does nothing (its own process), N JSON POSTs at concurrency C
through each candidate, interleaved over ``--rounds`` rounds; prints the median requests/s and
the ratio to a bare aiohttp loop:

(a) aiohttp, a bare ``ClientSession`` loop -- the practical wire limit of a Python client;
(r) retrysafe's engine (:class:`retrysafe._wire.AiohttpEngine`: aiohttp plus the body cap,
    error translation and per-attempt timeout the worker uses);
(x) httpx over the ``httpx-aiohttp`` transport (``pip install httpx-aiohttp``; skipped when
    missing);
(h) httpx with its own connection pool (httpcore), the engine retrysafe used before;

and, each only where installed (``pip install pyreqwest rnet curl_cffi niquests``; none is a
dependency), the other asyncio HTTP clients on PyPI that could go underneath:

(q) pyreqwest (Rust's reqwest and hyper on a tokio runtime);
(t) rnet (Rust, another reqwest fork);
(u) curl_cffi (libcurl through cffi);
(n) niquests (urllib3-future, pure Python).

Besides requests/s, each line gives the process's CPU per request (every thread's, so a
Rust runtime's own threads count), which moves less with the host than the rate does.

    python benchmarks/http_engines.py --requests 3000 --concurrency 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import statistics
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

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


_BODY = json.dumps({"n": 0}).encode()
_JSON = {"content-type": "application/json"}


def _check(status: int) -> None:
    if not 200 <= status < 300:
        raise SystemExit(f"unexpected status {status}")


async def via_pyreqwest(url: str, n: int, concurrency: int) -> float:
    """(q): N POSTs through one pyreqwest client (the body read whole: its fastest form)."""
    from pyreqwest.client import ClientBuilder

    async with (
        ClientBuilder().max_connections(concurrency).timeout(_timedelta(10.0)).build() as client
    ):

        async def post(i: int) -> None:
            request = client.post(url).body_bytes(_BODY).headers(_JSON).build()
            answer = await request.send()
            await answer.bytes()
            _check(answer.status)

        return await _loop(n, concurrency, post)


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


async def via_rnet(url: str, n: int, concurrency: int) -> float:
    """(t): N POSTs through one rnet client."""
    import rnet

    client = rnet.Client(timeout=10)

    async def post(i: int) -> None:
        answer = await client.post(url, body=_BODY, headers=_JSON)
        await answer.bytes()
        status = answer.status
        _check(status if isinstance(status, int) else status.as_int())

    return await _loop(n, concurrency, post)


async def via_curl_cffi(url: str, n: int, concurrency: int) -> float:
    """(u): N POSTs through one curl_cffi ``AsyncSession``."""
    from curl_cffi.requests import AsyncSession

    async with AsyncSession(max_clients=concurrency, timeout=10.0) as session:

        async def post(i: int) -> None:
            answer = await session.post(url, data=_BODY, headers=_JSON)
            _check(answer.status_code)

        return await _loop(n, concurrency, post)


async def via_niquests(url: str, n: int, concurrency: int) -> float:
    """(n): N POSTs through one niquests ``AsyncSession``."""
    import niquests

    async with niquests.AsyncSession(pool_maxsize=concurrency) as session:

        async def post(i: int) -> None:
            answer = await session.post(url, data=_BODY, headers=_JSON, timeout=10.0)
            _check(answer.status_code or 0)

        return await _loop(n, concurrency, post)


def _cpu() -> float:
    """The process's CPU seconds so far, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=positive_int, default=3000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args(argv)
    n, c = args.requests, args.concurrency
    Run = Callable[[str, int, int], Coroutine[Any, Any, float]]
    candidates: dict[str, tuple[str, str | None, Run]] = {
        "a": ("aiohttp, bare loop", None, lambda u, n, c: bare_aiohttp([u], n, c)),
        "r": ("retrysafe engine (aiohttp)", None, retrysafe_engine),
        "x": ("httpx + httpx-aiohttp transport", "httpx_aiohttp", via_httpx_aiohttp),
        "q": ("pyreqwest (Rust reqwest)", "pyreqwest", via_pyreqwest),
        "t": ("rnet (Rust)", "rnet", via_rnet),
        "u": ("curl_cffi (libcurl)", "curl_cffi", via_curl_cffi),
        "n": ("niquests", "niquests", via_niquests),
        "h": ("httpx, own pool (httpcore)", None, lambda u, n, c: bare_httpx([u], n, c)),
    }
    for key, (_, module, _) in list(candidates.items()):
        if module is not None and importlib.util.find_spec(module) is None:
            print(f"{module} is not installed: ({key}) skipped")
            del candidates[key]
    rates: dict[str, list[float]] = {k: [] for k in candidates}
    cpus: dict[str, list[float]] = {k: [] for k in candidates}
    with endpoint() as base:
        url = f"{base}/bench"
        for _, _, run in candidates.values():  # warm-up: imports, first connections
            asyncio.run(run(url, min(300, n), c))
        for _ in range(args.rounds):
            for key, (_, _, run) in candidates.items():
                before = _cpu()
                rates[key].append(n / asyncio.run(run(url, n, c)))
                cpus[key].append((_cpu() - before) / n * 1e6)
    a = statistics.median(rates["a"])
    print(f"requests={n} concurrency={c} rounds={args.rounds} cpus={os.cpu_count()}")
    for key, (label, _, _) in candidates.items():
        m = statistics.median(rates[key])
        each = ", ".join(f"{v:.0f}" for v in rates[key])
        cpu = statistics.median(cpus[key])
        print(
            f"({key}) {label:<32}: {m:7.0f} req/s  {m / a:5.2f} x (a)  "
            f"{cpu:6.1f} CPU µs/req  ({each})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
