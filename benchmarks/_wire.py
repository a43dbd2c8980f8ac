"""What the client-side benchmarks share: a local endpoint that does nothing, and the bare
loops that measure the wire limit (no persistence, no key, no retries).

The endpoint is a raw ASGI app under one uvicorn process (its own core, on asyncio's own
event loop as in every earlier run: uvicorn would take uvloop where it is installed, and the
test extras install it); the loops send N
JSON POSTs with ``concurrency`` tasks sharing one connection pool, spread over ``urls`` in
turn.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

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
    await send({"type": "http.response.start", "status": {status},
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})

uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False,
            lifespan="off", loop="asyncio")
"""


@contextmanager
def endpoint(status: int = 201) -> Iterator[str]:
    """A local uvicorn endpoint answering every request ``status`` with a tiny JSON body,
    in a child process; yields its base URL ``http://127.0.0.1:PORT``."""
    port = free_port()
    code = _SERVER.replace("{port}", str(port)).replace("{status}", str(status))
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_listening(port, proc, "the benchmark endpoint", within=15)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_listening(
    port: int, proc: subprocess.Popen[bytes], what: str, *, within: float = 30
) -> None:
    """Wait until ``proc`` listens on 127.0.0.1:``port``.

    Raises:
        SystemExit: ``proc`` exited, or did not listen within ``within`` seconds.
    """
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.05)


async def _loop(n: int, concurrency: int, post: object) -> float:
    remaining = [n]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await post(remaining[0])  # type: ignore[operator]

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


def json_body(size: int | None) -> bytes:
    """A JSON object of ``size`` bytes (at least 8), or ``{"n": 0}`` when None."""
    if size is None:
        return json.dumps({"n": 0}).encode()
    return b'{"p":"' + b"x" * max(0, size - 8) + b'"}'


async def bare_aiohttp(
    urls: Sequence[str], n: int, concurrency: int, body_bytes: int | None = None
) -> float:
    """N POSTs through one ``aiohttp.ClientSession``; returns seconds. The practical wire
    limit of a Python client on this machine."""
    import aiohttp

    body = json_body(body_bytes)
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(i: int) -> None:
            async with session.post(urls[i % len(urls)], data=body, headers=headers) as r:
                await r.read()
                if not 200 <= r.status < 300:
                    raise SystemExit(f"unexpected status {r.status}")

        return await _loop(n, concurrency, post)


async def bare_httpx(
    urls: Sequence[str], n: int, concurrency: int, body_bytes: int | None = None
) -> float:
    """N POSTs through one ``httpx.AsyncClient`` (httpx's own pool); returns seconds."""
    body = json_body(body_bytes)
    headers = {"content-type": "application/json"}
    transport = httpx.AsyncHTTPTransport(
        retries=0, limits=httpx.Limits(max_connections=concurrency)
    )
    async with httpx.AsyncClient(transport=transport, timeout=10.0) as client:

        async def post(i: int) -> None:
            r = await client.post(urls[i % len(urls)], content=body, headers=headers)
            if not r.is_success:
                raise SystemExit(f"unexpected status {r.status_code}")

        return await _loop(n, concurrency, post)
