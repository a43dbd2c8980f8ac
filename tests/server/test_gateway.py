"""The gateway: the middleware in front of any HTTP upstream, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import retrysafe.cli._gateway as cli_gateway_module
import retrysafe.server._gateway as gateway_module
from _garbage import cycles_left
from retrysafe import ConfigurationError
from retrysafe._serving import ServerThread, free_port
from retrysafe.cli import cli
from retrysafe.server import IdempotencyMiddleware
from retrysafe.server._gateway import ReverseProxy
from retrysafe.stores import SQLiteStore

from .harness import keyed_post


def _upstream(effects: Counter[str]) -> Starlette:
    async def posts(request: Request) -> Response:
        body = await request.json()
        effects["posts"] += 1
        n = effects["posts"]
        return JSONResponse(
            {"id": n, "title": body.get("title")},
            status_code=201,
            headers={"Location": f"/posts/{n}", "X-Upstream": "yes"},
        )

    async def echo(request: Request) -> Response:
        body = await request.body()
        effects["echo"] += 1
        return Response(
            body,
            status_code=202,
            media_type=request.headers.get("content-type", "application/octet-stream"),
            headers={
                "X-Seen-Query": request.url.query,
                "X-Seen-Header": request.headers.get("x-custom", ""),
                "X-Seen-Host": request.headers.get("x-forwarded-host", ""),
            },
        )

    async def stream(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(200):
                yield (f"{i:05d}" * 200).encode()

        effects["stream"] += 1
        return StreamingResponse(chunks(), media_type="text/plain")

    async def slow(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(1.0)
        effects["slow"] += 1
        return JSONResponse({"done": True}, status_code=201)

    async def busy(request: Request) -> Response:
        effects["busy"] += 1
        return JSONResponse(
            {"type": "urn:retrysafe:problem:request-in-progress"},
            status_code=409,
            headers={"Retry-After": "1"},
        )

    async def boom(request: Request) -> Response:
        effects["boom"] += 1
        return JSONResponse({"error": "down"}, status_code=503)

    async def ai(request: Request) -> Response:  # a slow AI call: the effect, then 5 s
        effects["ai"] += 1
        await asyncio.sleep(5.0)
        return JSONResponse({"answer": effects["ai"]}, status_code=201)

    async def drip(request: Request) -> Response:  # a byte every 0.2 s: no read ever times out
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(50):
                await asyncio.sleep(0.2)
                yield b"."

        effects["drip"] += 1
        return StreamingResponse(chunks(), media_type="text/plain")

    async def big(request: Request) -> Response:  # 16 MiB at once
        effects["big"] += 1
        return Response(b"b" * (16 * 1024 * 1024), media_type="application/octet-stream")

    async def broken(request: Request) -> Response:  # the body breaks off half-way
        async def chunks() -> AsyncIterator[bytes]:
            yield b"half an answer"
            await asyncio.sleep(0.05)
            raise RuntimeError("upstream crashed mid-body")

        effects["broken"] += 1
        return StreamingResponse(chunks(), media_type="text/plain")

    return Starlette(
        routes=[
            Route("/posts", posts, methods=["POST"]),
            Route("/echo", echo, methods=["POST", "PUT", "GET"]),
            Route("/stream", stream, methods=["POST", "GET"]),
            Route("/boom", boom, methods=["POST"]),
            Route("/busy", busy, methods=["POST"]),
            Route("/slow", slow, methods=["POST"]),
            Route("/ai", ai, methods=["POST"]),
            Route("/drip", drip, methods=["POST"]),
            Route("/broken", broken, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/put", posts, methods=["PUT", "DELETE"]),
        ]
    )


@pytest.fixture
def effects() -> Counter[str]:
    return Counter()


@pytest.fixture
def upstream(effects: Counter[str]) -> Iterator[ServerThread]:
    with ServerThread(_upstream(effects)) as server:
        yield server


@pytest.fixture
def gateway(upstream: ServerThread, tmp_path: Path) -> Iterator[str]:
    store = SQLiteStore(tmp_path / "gateway.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=5), store=store)
    with ServerThread(app) as server:
        yield server.url
    store.close()


@contextlib.contextmanager
def _raw_upstream(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> Iterator[str]:
    """An upstream of raw bytes: ``handler`` answers each connection, on an event loop in a
    thread of its own; yields its base URL."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handler, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _first_and_retry(
    tmp_path: Path,
    raw: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    key: str,
) -> tuple[httpx.Response, httpx.Response]:
    """A gateway on SQLite before the raw upstream ``raw``: one POST with ``key`` and its
    retry, over real sockets."""
    store = SQLiteStore(tmp_path / "gateway.db")
    try:
        with _raw_upstream(raw) as url:
            app = IdempotencyMiddleware(ReverseProxy(url, timeout=5), store=store)
            with ServerThread(app) as gw:
                headers = {"Idempotency-Key": key}
                first = httpx.post(gw.url + "/x", json={}, headers=headers)
                retry = httpx.post(gw.url + "/x", json={}, headers=headers)
    finally:
        store.close()
    return first, retry


@pytest.mark.parametrize("status", [600, 999])
def test_an_upstream_status_outside_100_to_599_keeps_the_key_claimed(
    tmp_path: Path, status: int
) -> None:
    """An upstream answering a three-digit status that is no HTTP status (600-999) got the
    request, so it may have acted: 502 and the key stays claimed (the retry 409s), as for
    any malformed answer. (A fresh user's check: uvicorn could not send the status on, the
    key was released and every retry reached the upstream again.)"""
    reached: list[bytes] = []

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length:")),
            0,
        )  # fmt: skip
        await reader.readexactly(length)
        reached.append(head)
        writer.write(f"HTTP/1.1 {status} Odd\r\nContent-Length: 2\r\n\r\nok".encode())
        await writer.drain()
        writer.close()

    first, retry = _first_and_retry(tmp_path, raw, f"odd-{status}")
    assert first.status_code == 502, first.text
    assert "no complete answer" in first.json()["detail"]
    assert retry.status_code == 409, retry.text
    assert len(reached) == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",  # no hex size
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",  # then closed
    ],
    ids=["bad-chunk-size", "head-only"],
)
def test_an_answer_that_breaks_before_its_body_is_a_502_keeping_the_key(
    tmp_path: Path, answer: bytes
) -> None:
    """A fresh user's check: an upstream whose head came but whose body broke before any of
    it got the server's bare ``500 Internal Server Error`` (the head had gone to the
    middleware, which held it, and the gateway returned without an end). The head now
    leaves with the body's first bytes, so this is the documented 502, and the key stays
    claimed: the retry 409s and the upstream was reached once."""
    reached: list[bytes] = []

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(answer)
        await writer.drain()
        writer.close()

    first, retry = _first_and_retry(tmp_path, raw, "broke-early")
    assert first.status_code == 502, first.text
    assert first.json()["type"] == "urn:retrysafe:problem:bad-gateway"
    assert retry.status_code == 409, retry.text
    assert len(reached) == 1


def test_a_request_with_a_length_and_chunks_goes_on_chunked(tmp_path: Path) -> None:
    """A client request with both Content-Length and Transfer-Encoding: chunked (the server
    de-chunks it; RFC 9112 §6.3: the encoding wins) was forwarded with the client's length
    beside the longer body, which the HTTP client refused: a plain 500. The length is not
    sent on: the upstream gets the whole body, chunked."""
    bodies: list[bytes] = []

    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    store = SQLiteStore(tmp_path / "gateway.db")
    try:
        with ServerThread(upstream) as up, ServerThread(
            IdempotencyMiddleware(ReverseProxy(up.url, timeout=5), store=store)
        ) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(
                    b"POST /x HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: cl-te\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 4\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n7\r\n{\"x\":1}\r\n0\r\n\r\n"
                )
                answer = conn.recv(4096)
    finally:
        store.close()
    assert answer.startswith(b"HTTP/1.1 201"), answer
    assert bodies == [b'{"x":1}']


def test_an_upstream_answering_junk_leaves_no_cycle_holding_its_bytes(tmp_path: Path) -> None:
    """An upstream answering 64 KiB of non-HTTP bytes: 502, and the gateway keeps the error
    without its traceback (the frames it names held the upstream's bytes in a reference
    cycle until a full collection: 74-87 MB of resident memory against 54 MB for 256 such
    requests). Nothing of the request is left for the garbage collector."""
    async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"\x00" * 65536)
        await writer.drain()
        writer.close()

    async def three() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return [
                (await client.post("/x", json={}, headers={"Idempotency-Key": f"j{n}"}))
                .status_code
                for n in range(3)
            ]

    store = SQLiteStore(tmp_path / "gateway.db")
    with _raw_upstream(junk) as url:
        app = IdempotencyMiddleware(ReverseProxy(url, timeout=5), store=store)
        try:
            with cycles_left() as garbage:
                statuses = asyncio.run(three())
            left = [
                type(o).__name__
                for o in garbage
                if isinstance(o, BaseException) or type(o).__name__ in ("frame", "traceback")
            ]
        finally:
            store.close()
    assert statuses == [502, 502, 502]
    assert left == []


@contextlib.contextmanager
def _big_answer_gateway(
    upstream: ServerThread, tmp_path: Path, size: int
) -> Iterator[ServerThread]:
    """A gateway with a 1 s timeout before ``upstream``, storing answers up to ``size``
    bytes for replay, served on loopback."""
    store = SQLiteStore(tmp_path / "gateway.db")
    app = IdempotencyMiddleware(
        ReverseProxy(upstream.url, timeout=1.0), store=store, max_replay_size=size
    )
    try:
        with ServerThread(app) as gw:
            yield gw
    finally:
        store.close()


def _small_window_post(port: int, path: str, key: str) -> socket.socket:
    """A raw POST of ``path`` with ``key`` on a socket whose receive window is 16 KiB, so
    the server's writes wait for this test to read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: {key}\r\n"
        "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
    )
    return sock


def test_a_slow_client_is_not_the_upstreams_timeout(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """A fresh user's check: a client reading a 20 MiB answer at 1 MiB/s through a gateway
    with a 5 s timeout got 7-8 MB, the gateway logged the upstream as timed out, kept the key
    as outcome-unknown, and the retry after the lease ran the upstream again. The timeout is
    the upstream's: a client that takes seconds to read a 16 MiB answer under a 1 s timeout
    gets all of it, the answer is stored, and the retry replays it (one effect)."""
    size = 16 * 1024 * 1024
    with _big_answer_gateway(upstream, tmp_path, size) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        with _small_window_post(port, "/big", "slow-1") as sock:
            received = 0
            started = time.monotonic()
            while chunk := sock.recv(65536):
                received += len(chunk)
                time.sleep(len(chunk) / (4 * 1024 * 1024))  # ~4 MiB/s
            took = time.monotonic() - started
        retry = httpx.post(gw.url + "/big", headers={"Idempotency-Key": "slow-1"}, timeout=30)
    assert received > size, f"{received} bytes in {took:.1f} s"  # the whole body, its head
    assert took > 2.0, f"the client read in {took:.1f} s: not slower than the timeout"
    assert retry.status_code == 200 and len(retry.content) == size
    assert retry.headers.get("idempotent-replayed") == "true"
    assert effects["big"] == 1


def test_a_client_that_stops_reading_is_cut_off_and_its_retry_replays(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """A second fresh user's check: a client that read the head of a 20 MiB answer, then
    stopped reading for longer than the gateway's timeout, had the upstream counted as timed
    out (the client's write waited on the deadline): a cut answer, the key kept as
    outcome-unknown, and the retry after max-run-time ran the upstream again. A client that
    takes nothing for the timeout is now stalled: nothing more is sent to it, the whole
    answer is still read and recorded, and its retry gets the replay (one effect)."""
    size = 16 * 1024 * 1024
    with _big_answer_gateway(upstream, tmp_path, size) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        with _small_window_post(port, "/big", "stall-1") as sock:
            received = len(sock.recv(65536))
            time.sleep(3.0)  # takes nothing for three times the timeout
            sock.settimeout(30)
            while chunk := sock.recv(65536):
                received += len(chunk)
        retry = httpx.post(gw.url + "/big", headers={"Idempotency-Key": "stall-1"}, timeout=30)
    assert received < size, "the stalled client was sent the whole answer"
    assert retry.status_code == 200 and len(retry.content) == size, retry.status_code
    assert retry.headers.get("idempotent-replayed") == "true"
    assert effects["big"] == 1


def test_forwards_status_headers_query_and_binary_body(gateway: str) -> None:
    """Method, path, query, headers and a binary body reach the upstream; its answer returns."""
    blob = bytes(range(256)) * 10
    r = httpx.put(
        gateway + "/echo?b=2&a=1",
        content=blob,
        headers={"X-Custom": "kept", "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 202
    assert r.content == blob
    assert r.headers["x-seen-query"] == "b=2&a=1"
    assert r.headers["x-seen-header"] == "kept"
    assert r.headers["x-seen-host"].startswith("127.0.0.1:")


def test_repeated_key_runs_upstream_once_and_replays(gateway: str, effects: Counter[str]) -> None:
    """The same key twice: one upstream effect, the second answer is a marked replay."""
    headers = {"Idempotency-Key": "gw-1"}
    first = httpx.post(gateway + "/posts", json={"title": "a"}, headers=headers)
    second = httpx.post(gateway + "/posts", json={"title": "a"}, headers=headers)
    assert first.status_code == second.status_code == 201
    assert second.json() == first.json()
    assert second.headers["location"] == first.headers["location"]
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert effects["posts"] == 1


def test_replays_after_the_upstream_is_stopped(
    upstream: ServerThread, gateway: str, effects: Counter[str]
) -> None:
    """A completed key replays from the store even when the upstream is gone."""
    headers = {"Idempotency-Key": "gw-2"}
    first = httpx.post(gateway + "/posts", json={"title": "b"}, headers=headers)
    upstream.stop()
    replay = httpx.post(gateway + "/posts", json={"title": "b"}, headers=headers)
    assert replay.status_code == 201
    assert replay.json() == first.json()
    assert replay.headers["idempotent-replayed"] == "true"
    fresh = httpx.post(gateway + "/posts", json={"title": "c"}, headers={"Idempotency-Key": "x"})
    assert fresh.status_code == 502
    assert fresh.headers["content-type"] == "application/problem+json"
    assert effects["posts"] == 1


def test_missing_upstream_answers_502_and_releases_the_key(tmp_path: Path) -> None:
    """An unreachable upstream is a 502 problem; the key is released so a retry runs."""
    effects: Counter[str] = Counter()
    port = free_port()
    store = SQLiteStore(tmp_path / "g.db")
    app = IdempotencyMiddleware(ReverseProxy(f"http://127.0.0.1:{port}", timeout=2), store=store)
    headers = {"Idempotency-Key": "gw-3"}
    with ServerThread(app) as gw:
        down = httpx.post(gw.url + "/posts", json={"title": "d"}, headers=headers)
        assert down.status_code == 502
        assert down.json()["type"] == "urn:retrysafe:problem:bad-gateway"
        with ServerThread(_upstream(effects), port=port):
            up = httpx.post(gw.url + "/posts", json={"title": "d"}, headers=headers)
    assert up.status_code == 201
    assert "idempotent-replayed" not in up.headers
    assert effects["posts"] == 1


def test_upstream_timeout_keeps_the_key_claimed(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """A request sent but unanswered in time is "I don't know": 504, and the key is not
    released, so a retry gets 409 instead of running the effect a second time (SPEC §0)."""
    store = SQLiteStore(tmp_path / "t.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=0.3), store=store, lease=30)
    headers = {"Idempotency-Key": "slow-1"}
    with ServerThread(app) as gw:
        first = httpx.post(gw.url + "/slow", json={}, headers=headers)
        assert first.status_code == 504
        assert first.json()["type"] == "urn:retrysafe:problem:gateway-timeout"
        retry = httpx.post(gw.url + "/slow", json={}, headers=headers)
        assert retry.status_code == 409
        assert "retry-after" in retry.headers
    time.sleep(1.2)  # the upstream finishes the first request meanwhile
    assert effects["slow"] == 1
    store.close()


def test_upstream_409_in_progress_is_not_stored(gateway: str, effects: Counter[str]) -> None:
    """An upstream's 409 with Retry-After (its own key is busy) is about the attempt: the
    gateway forwards it and does not store it, so the retry reaches the upstream again."""
    headers = {"Idempotency-Key": "gw-busy"}
    for _ in range(2):
        r = httpx.post(gateway + "/busy", json={}, headers=headers)
        assert r.status_code == 409
        assert "idempotent-replayed" not in r.headers
    assert effects["busy"] == 2


def test_upstream_5xx_is_forwarded_and_not_stored(gateway: str, effects: Counter[str]) -> None:
    """A 5xx from the upstream reaches the client and the next attempt runs again (SPEC §4)."""
    headers = {"Idempotency-Key": "gw-4"}
    assert httpx.post(gateway + "/boom", json={}, headers=headers).status_code == 503
    assert httpx.post(gateway + "/boom", json={}, headers=headers).status_code == 503
    assert effects["boom"] == 2


def test_streamed_response_passes_through_and_replays(gateway: str, effects: Counter[str]) -> None:
    """A chunked 200 KB upstream answer arrives whole, and replays whole."""
    expected = b"".join((f"{i:05d}" * 200).encode() for i in range(200))
    headers = {"Idempotency-Key": "gw-5"}
    first = httpx.post(gateway + "/stream", json={}, headers=headers)
    second = httpx.post(gateway + "/stream", json={}, headers=headers)
    assert first.content == expected
    assert second.content == expected
    assert second.headers["idempotent-replayed"] == "true"
    assert effects["stream"] == 1


def test_unprotected_methods_pass_straight_through(gateway: str, effects: Counter[str]) -> None:
    """GET is not protected: each one reaches the upstream."""
    for _ in range(2):
        assert httpx.get(gateway + "/echo", headers={"Idempotency-Key": "g"}).status_code == 202
    assert effects["echo"] == 2


@pytest.mark.parametrize("url", ["ftp://host", "127.0.0.1:8000", "http://", "http://h/?q=1"])
def test_bad_upstream_urls_are_refused(url: str) -> None:
    """Only absolute http(s) URLs without query are accepted as upstream."""
    with pytest.raises(ConfigurationError):
        ReverseProxy(url)


# --------------------------------------------------------------------------- the CLI
def _wait_port(port: int, proc: subprocess.Popen[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited: {proc.communicate()[1]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("gateway did not start")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "retrysafe", *args]


def _gateway_refusing(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `retrysafe gateway ARGS` expecting it to refuse to start; its result."""
    return subprocess.run(_cli("gateway", *args), capture_output=True, text=True, timeout=30)


def test_cli_gateway_logs_one_json_line_per_decision(
    cli_gateway: Any, effects: Counter[str]
) -> None:
    """`retrysafe gateway` protects the upstream and logs each decision as a JSON line."""
    url = cli_gateway() + "/posts"
    for _ in range(2):
        r = httpx.post(url, json={"title": "cli"}, headers={"Idempotency-Key": "cli-1"})
        assert r.status_code == 201
    assert httpx.post(url, content=b"{}", headers={"Idempotency-Key": ""}).status_code == 400
    err = cli_gateway.stderr()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    decisions = [line["decision"] for line in lines if "decision" in line]
    assert len(decisions) == 3, err
    assert decisions[1] == "replay"
    assert all(line["logger"].startswith("retrysafe") for line in lines)
    assert effects["posts"] == 1


def test_cli_gateway_port_in_use_is_a_clear_error(upstream: ServerThread, tmp_path: Path) -> None:
    """A taken port gives one clear line and exit status 1, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            _cli(
                "gateway",
                "--upstream",
                upstream.url,
                "--listen",
                f"127.0.0.1:{port}",
                "--store",
                f"sqlite:///{tmp_path}/p.db",
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 1
    assert "already in use" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--upstream", "ftp://x"], "http"),
        # A fresh user's check: a traceback and exit 1, or taken and a 502 to every request.
        (["--upstream", "http://[::1"], "malformed"),
        (["--upstream", "http://127.0.0.1:abc/"], "malformed"),
        (["--upstream", "http://127.0.0.1:18001:99/"], "malformed"),
        (["--upstream", "http://127.0.0.1:99999"], "Port out of range"),
        (["--upstream", "http://127.0.0.1:0"], "port 0"),
        (["--upstream", "http://127.0.0.1:1", "--listen", "nonsense"], "HOST:PORT"),
        # A fresh user's check: bound as a host no interface has, exit 1 (not a usage error).
        (["--upstream", "http://127.0.0.1:1", "--listen", "[::1"], "HOST:PORT"),
        (["--upstream", "http://127.0.0.1:1", "--listen", "::1:8080"], "[::1]:8080 for IPv6"),
        (["--upstream", "http://127.0.0.1:1", "--store", "sqlite:////no/such/dir/x.db"], "exist"),
        (["--upstream", "http://127.0.0.1:1", "--lease", "-1"], "lease"),
        # --prefix and --schema (second fresh-user pass): an empty prefix fell back to the
        # default one, the service's own; PostgreSQL's own schemas were accepted.
        (["--upstream", "http://127.0.0.1:1", "--store", "redis://127.0.0.1:1/0",
          "--prefix", ""], "not a key prefix"),
        (["--upstream", "http://127.0.0.1:1", "--store", "postgresql://u@127.0.0.1:1/db",
          "--schema", "information_schema"], "catalogue views"),
        (["--upstream", "http://127.0.0.1:1", "--store", "postgresql://u@127.0.0.1:1/db",
          "--schema", "pg_mine"], "reserved"),
        (["--upstream", "http://127.0.0.1:1", "--store", "sqlite:///x.db", "--prefix", "a:"],
         "only a redis:// store has a key prefix"),
        (["--upstream", "http://127.0.0.1:1", "--store", "redis://127.0.0.1:1/0",
          "--schema", "app"], "only a postgresql:// store has a schema"),
    ],
)
def test_cli_gateway_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    """Bad upstream, listen address, store path or lease: a clear message, non-zero exit
    (2, a usage error, for a malformed --upstream or --listen)."""
    out = _gateway_refusing(*args)
    assert out.returncode != 0
    if message in {"HOST:PORT", "[::1]:8080 for IPv6", "malformed", "Port out of range", "port 0"}:
        assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def cli_gateway(upstream: ServerThread, tmp_path: Path) -> Iterator[Any]:
    """``start(*options) -> url``: a `retrysafe gateway` process; ``.stderr()`` stops it and
    returns what it wrote."""
    procs: list[subprocess.Popen[str]] = []

    def start(*options: str) -> str:
        port = free_port()
        proc = subprocess.Popen(
            _cli(
                "gateway",
                "--upstream",
                upstream.url,
                "--listen",
                f"127.0.0.1:{port}",
                "--store",
                f"sqlite:///{tmp_path}/gw{len(procs)}.db",
                *options,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        _wait_port(port, proc)
        return f"http://127.0.0.1:{port}"

    def stderr() -> str:
        procs[-1].terminate()
        return procs[-1].communicate(timeout=10)[1]

    start.stderr = stderr  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_cli_gateway_keeps_its_keys_under_its_own_redis_prefix_and_pg_schema(
    cli_gateway: Any,
    effects: Counter[str],
    redis_url: str,
    redis_prefix: str,
    pg_url: str,
    pg_schema: str,
) -> None:
    """``--prefix`` (Redis) and ``--schema`` (PostgreSQL): a gateway and the service behind
    it can share one Redis or one database without sharing keys (docs/stores.md). The
    gateway had neither option, and ``?prefix=`` in the URL is refused."""
    import psycopg
    import redis

    for options in (("--store", redis_url, "--prefix", redis_prefix),
                    ("--store", pg_url, "--schema", pg_schema)):  # fmt: skip
        url = cli_gateway(*options)
        key, before = f"scoped-{uuid.uuid4()}", effects["posts"]
        with httpx.Client(timeout=10) as client:
            sent = [
                client.post(url + "/posts", json={"title": "t"}, headers={"Idempotency-Key": key})
                for _ in range(2)
            ]
        assert [r.status_code for r in sent] == [201, 201]
        assert sent[1].headers["idempotent-replayed"] == "true"
        assert effects["posts"] == before + 1
    r = redis.Redis.from_url(redis_url)
    try:
        assert list(r.scan_iter(match=redis_prefix + "k:*"))
    finally:
        r.close()
    with psycopg.connect(pg_url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {pg_schema}.idempotency_keys".encode())
        assert row.fetchone() == (1,)


def test_cli_gateway_holds_a_slow_upstream_past_its_lease(
    cli_gateway: Any, effects: Counter[str]
) -> None:
    """`--lease 2`, an upstream taking 5 s, client timeout 1 s, a retry every 0.5 s for 8 s:
    the upstream runs once; retries get 409 while it runs, then the replay."""
    url = cli_gateway("--lease", "2") + "/ai"
    headers = {"Idempotency-Key": "ai-1"}
    start = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json={}, headers=headers, timeout=1)
    statuses: list[int] = []
    last_409 = 0.0
    while time.monotonic() - start < 8:
        time.sleep(0.5)
        r = httpx.post(url, json={}, headers=headers, timeout=1)
        statuses.append(r.status_code)
        if r.status_code == 409:
            last_409 = time.monotonic() - start
        if r.status_code == 201:
            assert r.headers["idempotent-replayed"] == "true"
            assert r.json() == {"answer": 1}
    assert effects["ai"] == 1
    assert 409 in statuses and statuses[-1] == 201
    assert statuses == sorted(statuses, reverse=True)  # every 409 before every replay
    # 409 still answered > 3 s in: long past the 2 s lease (timed, not counted: a loaded
    # machine makes fewer retries in the same seconds)
    assert last_409 > 3.0, statuses


def test_slow_drip_upstream_is_cut_at_the_total_deadline(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """An upstream that drips a byte every 0.2 s is cut off at the total deadline (1 s), not
    per read; the key stays claimed as outcome-unknown, so the retry gets 409."""
    store = SQLiteStore(tmp_path / "drip.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=1), store=store)
    headers = {"Idempotency-Key": "drip-1"}
    with ServerThread(app) as gw:
        start = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # a cut connection, never a complete answer
            httpx.post(gw.url + "/drip", json={}, headers=headers, timeout=20)
        assert time.monotonic() - start < 3.0
        retry = httpx.post(gw.url + "/drip", json={}, headers=headers)
        assert retry.status_code == 409
    assert effects["drip"] == 1
    store.close()


def test_upstream_answering_after_the_deadline_gets_504_and_keeps_the_key(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """No answer within the total deadline: 504 gateway-timeout, the key kept."""
    store = SQLiteStore(tmp_path / "late.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=0.5), store=store)
    headers = {"Idempotency-Key": "late-1"}
    with ServerThread(app) as gw:
        first = httpx.post(gw.url + "/ai", json={}, headers=headers)
        assert first.status_code == 504
        assert first.json()["type"] == "urn:retrysafe:problem:gateway-timeout"
        assert httpx.post(gw.url + "/ai", json={}, headers=headers).status_code == 409
    assert effects["ai"] == 1
    store.close()


def test_cli_gateway_methods_option_protects_put_and_delete(
    cli_gateway: Any, effects: Counter[str]
) -> None:
    """`--methods POST,PATCH,PUT,DELETE`: a repeated PUT runs upstream once and replays."""
    url = cli_gateway("--methods", "POST,PATCH,PUT,DELETE") + "/put"
    headers = {"Idempotency-Key": "put-1"}
    first = httpx.put(url, json={"title": "p"}, headers=headers)
    again = httpx.put(url, json={"title": "p"}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert effects["posts"] == 1


def test_cli_gateway_logs_json_only_when_the_upstream_body_breaks(
    cli_gateway: Any, effects: Counter[str]
) -> None:
    """An upstream body that breaks off: the client sees a broken answer, stderr stays one
    JSON line per event (no traceback), and the retry gets 409 (outcome unknown)."""
    url = cli_gateway() + "/broken"
    headers = {"Idempotency-Key": "broken-1"}
    with pytest.raises(httpx.HTTPError):
        httpx.post(url, json={}, headers=headers, timeout=5)
    assert httpx.post(url, json={}, headers=headers, timeout=5).status_code == 409
    err = cli_gateway.stderr()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines and all(line.startswith("{") for line in lines), err
    decisions = [json.loads(line).get("decision") for line in lines]
    assert "outcome-unknown" in decisions
    assert effects["broken"] == 1


@pytest.mark.parametrize("store", ["memory://", "MEMORY://"])
def test_cli_gateway_refuses_a_memory_store_unless_told(store: str) -> None:
    """`--store memory://` would forget every key on restart: refused (exit 2) unless
    `--allow-memory-store` says this is a test."""
    out = _gateway_refusing("--upstream", "http://127.0.0.1:1", "--store", store)
    assert out.returncode == 2
    assert "--allow-memory-store" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--lease", "0"],
        ["--lease", "nan"],
        ["--lease", "1e12"],
        ["--heartbeat", "5", "--lease", "2"],
        ["--max-run-time", "-1"],
        ["--timeout", "inf"],
        ["--timeout", "5", "--max-run-time", "2"],
        ["--methods", "PO ST"],
        ["--methods", ","],
    ],
)
def test_cli_gateway_bad_lease_timing_and_methods_exit_2(args: list[str]) -> None:
    """A lease, heartbeat, run time, timeout or method list that cannot work: exit 2, one line."""
    out = _gateway_refusing("--upstream", "http://127.0.0.1:1", *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(("retrysafe: error:", "Usage:")), out.stderr
    assert "Traceback" not in out.stderr
    assert f"{args[0]}:" in out.stderr  # names the flag the user typed


def test_unknown_outcome_stays_claimed_past_the_lease(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """An upstream that outlives the total deadline (outcome unknown) keeps its key claimed
    and renewed, not just for one lease: retries long after the 1 s lease still get 409 and
    the upstream runs once."""
    store = SQLiteStore(tmp_path / "unknown.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=0.5), store=store, lease=1)
    headers = {"Idempotency-Key": "unknown-1"}
    with ServerThread(app) as gw:
        assert httpx.post(gw.url + "/ai", json={}, headers=headers).status_code == 504
        statuses = []
        for _ in range(10):  # 3 s: three leases
            time.sleep(0.3)
            statuses.append(httpx.post(gw.url + "/ai", json={}, headers=headers).status_code)
    assert statuses == [409] * 10
    assert effects["ai"] == 1
    store.close()


def _until_not_409(url: str, headers: dict[str, str], within: float = 15.0) -> httpx.Response:
    """POST ``url`` every 0.1 s until the answer is no 409 (or ``within`` seconds pass)."""
    end = time.monotonic() + within
    while True:
        answer = httpx.post(url, json={}, headers=headers)
        if answer.status_code != 409 or time.monotonic() > end:
            return answer
        time.sleep(0.1)


def test_a_late_upstream_answer_is_recorded_for_the_retry(
    upstream: ServerThread,
    effects: Counter[str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client gets its 504 at the timeout, but the gateway still waits for the upstream
    (its key renewed) and records the answer that comes late: the retry replays that 201
    instead of meeting 409 until the lease ends and then running the effect again."""
    store = SQLiteStore(tmp_path / "late.db")
    proxy = ReverseProxy(upstream.url, timeout=0.3)
    app = IdempotencyMiddleware(proxy, store=store, lease=30)
    headers = {"Idempotency-Key": "late-answer-1"}
    caplog.set_level("WARNING", logger="retrysafe")
    with ServerThread(app) as gw:
        start = time.monotonic()
        first = httpx.post(gw.url + "/slow", json={}, headers=headers)
        assert time.monotonic() - start < 0.9  # the 504 came at the timeout, not with the 201
        assert first.status_code == 504
        problem = first.json()
        assert problem["type"] == "urn:retrysafe:problem:gateway-timeout"
        assert "records it" in problem["detail"]
        assert httpx.post(gw.url + "/slow", json={}, headers=headers).status_code == 409
        replay = _until_not_409(gw.url + "/slow", headers)
    assert replay.status_code == 201, replay.text
    assert replay.json() == {"done": True}
    assert replay.headers["idempotent-replayed"] == "true"
    assert effects["slow"] == 1
    early = [r for r in caplog.records if getattr(r, "decision", None) == "answered-early"]
    assert len(early) == 1 and early[0].levelname == "WARNING"
    store.close()


def test_a_late_answer_past_max_run_time_leaves_the_key_to_its_lease(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """An upstream slower than the key's renewal (max_run_time 1.5 s, the upstream 5 s): the
    gateway stops waiting when renewal stops, the key stays claimed until its lease runs
    out (409 meanwhile), and only then may a retry send the request again."""
    store = SQLiteStore(tmp_path / "past.db")
    proxy = ReverseProxy(upstream.url, timeout=0.3)
    app = IdempotencyMiddleware(proxy, store=store, lease=1, max_run_time=1.5)
    headers = {"Idempotency-Key": "past-max-1"}
    with ServerThread(app) as gw:
        assert httpx.post(gw.url + "/ai", json={}, headers=headers).status_code == 504
        assert httpx.post(gw.url + "/ai", json={}, headers=headers).status_code == 409
        again = _until_not_409(gw.url + "/ai", headers)
    assert again.status_code == 504  # the retry reached the upstream again: a new attempt
    assert effects["ai"] == 2
    store.close()


def test_the_upstream_pool_holds_the_connections_it_is_given() -> None:
    """The gateway's upstream pool holds 256 connections (httpx had left it at its default
    100 once), as many as its gate lets requests through."""

    async def main() -> tuple[int, float | None]:
        proxy = ReverseProxy("http://127.0.0.1:1")
        session, _ = proxy._open()
        try:
            connector = session.connector
            assert connector is not None
            keepalive: float | None = connector._keepalive_timeout
            return connector.limit, keepalive
        finally:
            await proxy.aclose()

    limit, keepalive = asyncio.run(main())
    assert limit == gateway_module._CONNECTIONS == 256
    # An idle connection is dropped before common servers close theirs (gunicorn after 2 s):
    # one the upstream closes as a request goes out fails that request as possibly sent.
    assert keepalive == gateway_module._KEEPALIVE < 2


def _slow_connects(monkeypatch: pytest.MonkeyPatch, wait: float = 2.0) -> None:
    """Make the first upstream connection of each new gateway session wait ``wait`` seconds
    before it is handed to its request (a slow connect; nothing of the request is sent)."""
    make = gateway_module._session

    def session(timeout: float) -> Any:
        made = make(timeout)
        connector = made.connector
        assert connector is not None
        connect = connector.connect
        waits = [1]

        async def slow(*args: Any, **kwargs: Any) -> Any:
            if waits[0]:
                waits[0] -= 1
                await asyncio.sleep(wait)
            return await connect(*args, **kwargs)

        connector.connect = slow  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(gateway_module, "_session", session)


def test_a_request_still_waiting_for_a_connection_is_released_not_held(
    upstream: ServerThread,
    effects: Counter[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that has not gone out by the timeout (it waits for a connection) gets no
    early 504 saying the upstream may have acted: it is given up as never sent, 502, its
    key released, and its retry runs."""
    _slow_connects(monkeypatch)
    store = SQLiteStore(tmp_path / "pool.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=0.3), store=store, lease=30)
    headers = {"Idempotency-Key": "waits-for-a-connection"}
    with ServerThread(app) as gw:
        first = httpx.post(gw.url + "/posts", json={"title": "p"}, headers=headers)
        assert first.status_code == 502, first.text
        assert first.json()["type"] == "urn:retrysafe:problem:bad-gateway"
        time.sleep(2.0)  # had it been sent late, the upstream would have run it by now
        assert effects["posts"] == 0
        again = httpx.post(gw.url + "/posts", json={"title": "p"}, headers=headers, timeout=10)
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert effects["posts"] == 1
    store.close()


def test_past_the_pool_a_request_waits_at_the_gate_and_is_released_not_sent(
    upstream: ServerThread,
    effects: Counter[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every upstream connection held (one here: a slow request awaited after its 504),
    a new request waits at the gateway's own gate, not in httpx's queue (whose passes cost
    queued requests x connections), and after the timeout gets 502, never sent, its key
    released; its retry runs once the connection frees."""
    monkeypatch.setattr(gateway_module, "_CONNECTIONS", 1)
    store = SQLiteStore(tmp_path / "gate.db")
    proxy = ReverseProxy(upstream.url, timeout=0.3)
    app = IdempotencyMiddleware(proxy, store=store, lease=30)
    answers: list[httpx.Response] = []
    with ServerThread(app) as gw:
        slow = httpx.post(gw.url + "/slow", json={}, headers={"Idempotency-Key": "holds-it"})
        assert slow.status_code == 504  # answered early; its request still holds the slot
        start = time.monotonic()
        post = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    gw.url + "/posts", json={"title": "g"},
                    headers={"Idempotency-Key": "at-the-gate"},
                )
            )
        )  # fmt: skip
        post.start()
        time.sleep(0.15)
        connector = proxy._session.connector  # type: ignore[union-attr]
        assert len(connector._acquired) == 1  # type: ignore[union-attr]  # the slow one only
        post.join()
        (waiting,) = answers
        assert waiting.status_code == 502, waiting.text
        assert time.monotonic() - start < 0.9  # the timeout, not twice it
        assert effects["posts"] == 0
        late = _until_not_409(gw.url + "/slow", {"Idempotency-Key": "holds-it"})
        again = _until_not_409(gw.url + "/posts", {"Idempotency-Key": "at-the-gate"})
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert late.status_code == 201 and late.headers["idempotent-replayed"] == "true"
    assert effects["posts"] == 1 and effects["slow"] == 1
    store.close()


def _leave(url: str, request: bytes, after: float = 0.1) -> None:
    """Send ``request`` raw to the server at ``url``, then close the connection after
    ``after`` seconds without reading an answer (a client that leaves)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        time.sleep(after)


def test_a_client_that_leaves_mid_upload_never_completes_its_request_upstream(
    upstream: ServerThread, effects: Counter[str]
) -> None:
    """A chunked upload cut off by its client (no last chunk) is cut off upstream too: the
    upstream never gets a shorter body as the whole one (helper-55: `{"qty": 100000` reached
    it, properly ended)."""
    with ServerThread(ReverseProxy(upstream.url, timeout=5)) as gw:
        _leave(
            gw.url,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n9\r\n{\"qty\": 1\r\n5\r\n00000\r\n",
        )
        time.sleep(0.5)
        assert httpx.get(gw.url + "/echo").status_code == 202  # the gateway still serves
    assert effects["echo"] == 1  # the GET only


def test_a_client_that_leaves_while_waiting_at_the_gate_sends_nothing(
    upstream: ServerThread,
    effects: Counter[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the one connection held, a request whose client leaves while it waits at the
    gate is never sent, not sent later with an empty body (helper-55)."""
    monkeypatch.setattr(gateway_module, "_CONNECTIONS", 1)
    store = SQLiteStore(tmp_path / "left.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=2), store=store, lease=30)
    with ServerThread(app) as gw:
        holder = threading.Thread(
            target=httpx.post,
            args=(gw.url + "/slow",),
            kwargs={"json": {}, "headers": {"Idempotency-Key": "hold"}, "timeout": 10},
        )
        holder.start()
        time.sleep(0.2)  # the slow request has the connection
        _leave(
            gw.url,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nc\r\n{\"order\": 1}\r\n0\r\n\r\n",
            after=0.2,
        )
        holder.join()
        time.sleep(0.5)  # the connection is free: had it been queued, it went out by now
    assert effects["slow"] == 1
    assert effects["echo"] == 0
    store.close()


def test_a_request_that_goes_out_late_is_awaited_not_released(
    upstream: ServerThread,
    effects: Counter[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that waited for a connection past the timeout but went out before it was
    given up is sent: never answered 502 (its key released while the upstream has it), but
    504, its late answer recorded and replayed once (helper-53: 53 of 53 ran twice)."""
    _slow_connects(monkeypatch, wait=0.45)  # out between 0.3 and 0.6 s
    store = SQLiteStore(tmp_path / "late-out.db")
    app = IdempotencyMiddleware(ReverseProxy(upstream.url, timeout=0.3), store=store, lease=30)
    headers = {"Idempotency-Key": "goes-out-late"}
    with ServerThread(app) as gw:
        first = httpx.post(gw.url + "/slow", json={}, headers=headers)
        assert first.status_code == 504, first.text
        replay = _until_not_409(gw.url + "/slow", headers)
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert effects["slow"] == 1
    store.close()


def test_no_middleware_no_early_answer(upstream: ServerThread, effects: Counter[str]) -> None:
    """The bare gateway (no key to record into) answers 504 at its timeout and stops
    waiting: nothing would record the late answer."""
    with ServerThread(ReverseProxy(upstream.url, timeout=0.3)) as gw:
        start = time.monotonic()
        answer = httpx.post(gw.url + "/slow", json={})
        assert time.monotonic() - start < 0.9
    assert answer.status_code == 504
    assert "records it" not in answer.json()["detail"]


# --------------------------------------------------------------------------- signals
def _gateway_process(
    upstream: ServerThread | _RawUpstream, store: Path, port: int
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        _cli(
            "gateway", "--upstream", upstream.url, "--listen", f"127.0.0.1:{port}",
            "--store", f"sqlite:///{store}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    _wait_port(port, proc)
    return proc


def _stop_mid_request(
    proc: subprocess.Popen[str],
    port: int,
    path: str,
    effects: Counter[str],
    sig: signal.Signals,
    exit_within: float = 5.0,
    again_after: float | None = None,
) -> str:
    """POST ``path`` (key ``k``) through the gateway ``proc`` in a thread, send ``sig`` once
    the upstream has counted its effect (and again ``again_after`` seconds later, when
    given); the gateway exits within ``exit_within`` seconds of the last signal. Returns its
    stderr."""
    answers: list[object] = []

    def client() -> None:
        try:
            answers.append(
                httpx.post(
                    f"http://127.0.0.1:{port}{path}", headers={"Idempotency-Key": "k"}, timeout=30
                ).status_code
            )
        except httpx.HTTPError as exc:
            answers.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not effects[path.strip("/")]:
            assert time.monotonic() < deadline, "the request never reached the upstream"
            time.sleep(0.02)
        proc.send_signal(sig)
        if again_after is not None:
            time.sleep(again_after)
            proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=exit_within)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        thread.join(timeout=30)
    assert answers and answers[0] != 201  # cut short, never a complete answer
    return stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_cli_gateway_signal_mid_request_exits_within_5_s_and_closes_its_store(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """SIGTERM (SIGINT) while a request streams from the upstream for 10 s: the gateway exits
    143 (130) within 5 s, without a traceback, and closes its store (no -wal/-shm left)."""
    port = free_port()
    proc = _gateway_process(upstream, tmp_path / "gw.db", port)
    stderr = _stop_mid_request(proc, port, "/drip", effects, sig)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gw.db"]


def _retry_through_a_new_gateway(upstream: ServerThread, db: Path, port: int) -> httpx.Response:
    """POST ``/ai`` with key ``k`` through a new gateway on the stopped one's store and port
    (then stopped too); its answer."""
    again = _gateway_process(upstream, db, port)
    try:
        return httpx.post(
            f"http://127.0.0.1:{port}/ai", headers={"Idempotency-Key": "k"}, timeout=30
        )
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=10)


def test_cli_gateway_stopped_before_the_upstream_answered_keeps_the_key_claimed(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """A fresh user's check: the gateway stopped (SIGINT) while the upstream had made its
    effect but not yet answered released the key when uvicorn cancelled the request at the
    end of its grace, and the retry with the same key ran the effect again (7 of 7 runs).
    The key stays claimed, as after a crash: the retry through a new gateway gets 409."""
    port = free_port()
    proc = _gateway_process(upstream, tmp_path / "gw.db", port)
    stderr = _stop_mid_request(proc, port, "/ai", effects, signal.SIGINT)
    assert proc.returncode == 130, stderr
    _cancel_logged_as_a_warning(stderr)
    retry = _retry_through_a_new_gateway(upstream, tmp_path / "gw.db", port)
    assert retry.status_code == 409, retry.text
    assert effects["ai"] == 1


def _cancel_logged_as_a_warning(stderr: str) -> None:
    """The request the shutdown cancelled is one warning line from uvicorn and the
    middleware's ``outcome-unknown`` decision; no line at ERROR (uvicorn logged "Exception in
    ASGI application" and, after a second signal, "Exception in 'lifespan' protocol", both
    ERROR with the CancelledError it had caused)."""
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert [d for d in lines if d["level"] == "error"] == [], stderr
    cancelled = [d for d in lines if d["msg"] == "request cancelled by the server's shutdown"]
    assert len(cancelled) == 1 and cancelled[0]["level"] == "warning", stderr
    assert cancelled[0]["error"].startswith("CancelledError"), stderr
    decisions = [d.get("decision") for d in lines if d["logger"] == "retrysafe.server"]
    assert decisions == ["outcome-unknown"], stderr


def test_cli_gateway_second_signal_stops_it_at_once_keeping_the_key_claimed(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """A second SIGINT during the 3 s grace stops the gateway at once; the request cut short
    keeps its key claimed, as after the grace. (On Python 3.12 and later uvicorn went on
    waiting for the request's connection until the grace ended: 2.9 s after the second
    signal; on 3.11 ``Server.wait_closed`` does not wait for connections.)"""
    port = free_port()
    proc = _gateway_process(upstream, tmp_path / "gw.db", port)
    stderr = _stop_mid_request(
        proc, port, "/ai", effects, signal.SIGINT, exit_within=2.0, again_after=0.3
    )
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    _cancel_logged_as_a_warning(stderr)
    retry = _retry_through_a_new_gateway(upstream, tmp_path / "gw.db", port)
    assert retry.status_code == 409, retry.text
    assert effects["ai"] == 1


@pytest.mark.parametrize(
    ("upstream", "listen"),
    [
        ("http://127.0.0.1:{port}", "127.0.0.1:{port}"),
        ("http://localhost:{port}/api", "127.0.0.1:{port}"),
        ("http://127.0.0.1:{port}", "localhost:{port}"),
    ],
)
def test_cli_gateway_refuses_its_own_listen_address_as_upstream(
    gateway_never_starts: Path, upstream: str, listen: str
) -> None:
    """An upstream that is the gateway's own address would forward every request to itself:
    exit 2, one line naming --upstream, no store created."""
    port = free_port()
    result = CliRunner().invoke(
        cli,
        ["gateway", "--upstream", upstream.format(port=port), "--listen", listen.format(port=port),
         "--store", f"sqlite:///{gateway_never_starts}/gw.db"],
    )  # fmt: skip
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert result.stderr.startswith("retrysafe: error: --upstream:")
    assert "own --listen address" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert list(gateway_never_starts.iterdir()) == []


@pytest.fixture
def gateway_never_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A `retrysafe gateway` that gets past its checks fails the test instead of serving;
    returns an empty directory for its store."""

    def started(config: object) -> object:
        raise AssertionError("the gateway started")

    monkeypatch.setattr(cli_gateway_module, "quiet_server", started)
    directory = tmp_path / "store"
    directory.mkdir()
    return directory


BIG_DIGITS = "9" * (10 * 1024 * 1024)
BIG_TEXT = "x" * (10 * 1024 * 1024)
BAD = {"empty": "", "nan": "nan", "inf": "inf", "negative": "-1", "10MB-digits": BIG_DIGITS,
       "10MB-text": BIG_TEXT}  # fmt: skip
OPTIONS = ["--upstream", "--listen", "--store", "--lease", "--heartbeat", "--max-run-time",
           "--methods", "--retention", "--timeout", "--max-body-size", "--max-replay-size",
           "--replay-header", "--in-progress-wait", "--log-level"]  # fmt: skip
# Values that are fine: NAN and INF are valid (extension) method names, these header names.
VALID = {("--methods", "nan"), ("--methods", "inf"), ("--replay-header", "nan"),
         ("--replay-header", "inf"), ("--replay-header", "-1")}  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value"),
    [
        pytest.param(option, value, id=f"{option}-{name}")
        for option in OPTIONS
        for name, value in BAD.items()
        if (option, value) not in VALID
    ],
)
def test_cli_gateway_bad_value_exits_2_with_one_line_naming_the_option(
    gateway_never_starts: Path, option: str, value: str
) -> None:
    """Empty, NaN, infinite, negative and 10 MB values: exit 2, one line of at most 1000
    characters naming the option; no store is created, the gateway never starts."""
    args = {
        "--upstream": "http://127.0.0.1:9",
        "--listen": f"127.0.0.1:{free_port()}",
        "--store": f"sqlite:///{gateway_never_starts}/gw.db",
    }
    args[option] = value
    result = CliRunner().invoke(cli, ["gateway", *[x for kv in args.items() for x in kv]])
    assert result.exit_code == 2, (result.exception, result.stderr[-300:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[:2000]
    assert lines[0].startswith(f"retrysafe: error: {option}")
    assert len(lines[0]) <= 1000
    assert list(gateway_never_starts.iterdir()) == []


@pytest.mark.parametrize("kind", ["unknown-scheme", "directory", "missing-directory", "not-a-db"])
def test_cli_gateway_bad_store_exits_2_naming_store_and_creates_nothing(
    gateway_never_starts: Path, kind: str
) -> None:
    """--store with an unknown scheme, a directory, a path in a missing directory or a file
    that is not a database: exit 2, one line naming --store, nothing created or changed."""
    not_db = gateway_never_starts / "notes.db"
    not_db.write_bytes(b"just some notes\n")
    url = {
        "unknown-scheme": "mysql://localhost/keys",
        "directory": f"sqlite:///{gateway_never_starts}",
        "missing-directory": f"sqlite:///{gateway_never_starts}/no/such/keys.db",
        "not-a-db": f"sqlite:///{not_db}",
    }[kind]
    result = CliRunner().invoke(
        cli, ["gateway", "--upstream", "http://127.0.0.1:9", "--store", url]
    )
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert result.stderr.startswith("retrysafe: error: --store:")
    assert len(result.stderr.splitlines()) == 1
    assert [p.name for p in gateway_never_starts.iterdir()] == ["notes.db"]
    assert not_db.read_bytes() == b"just some notes\n"


class _RawUpstream:
    """An upstream on a raw socket that keeps each request's bytes as they arrived (head and
    body, de-chunked) and answers ``200 ok``, closing the connection; it never sends
    ``100 Continue``."""

    def __init__(self) -> None:
        self.answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                fields = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
                }
                if b"content-length" in fields:
                    while len(rest) < int(fields[b"content-length"]):
                        rest += conn.recv(65536)
                    body = rest
                elif fields.get(b"transfer-encoding") == b"chunked":
                    while not rest.endswith(b"0\r\n\r\n"):
                        rest += conn.recv(65536)
                    body, tail = b"", rest
                    while True:
                        size, _, tail = tail.partition(b"\r\n")
                        if int(size, 16) == 0:
                            break
                        body, tail = body + tail[: int(size, 16)], tail[int(size, 16) + 2 :]
                else:
                    body = b""
                self.heads.append(head)
                self.bodies.append(body)
                conn.sendall(self.answer)

    def fields(self, n: int) -> dict[bytes, bytes]:
        """Request ``n``'s header fields, lower-cased names."""
        lines = self.heads[n].split(b"\r\n")[1:]
        return {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines)}

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def raw_upstream() -> Iterator[_RawUpstream]:
    server = _RawUpstream()
    yield server
    server.close()


def _raw(url: str, request: bytes) -> bytes:
    """Send ``request`` raw to the server at ``url``; its whole answer (read to the close)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\n" in answer and answer.endswith((b"ok", b"}")):
                break
        return answer


def test_the_gateway_adds_no_header_field_of_its_own(raw_upstream: _RawUpstream) -> None:
    """A request goes upstream with the client's fields only (plus Host and X-Forwarded-*):
    no User-Agent, Accept or Accept-Encoding of the upstream client library's (httpx added
    ``Accept-Encoding: gzip, deflate``, and a client that never asked got gzip)."""
    with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
        answer = _raw(gw.url, b"GET /plain HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer
    fields = raw_upstream.fields(0)
    assert set(fields) == {
        b"host", b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"
    }


def test_a_request_body_goes_on_framed_as_it_came(raw_upstream: _RawUpstream) -> None:
    """A body with a Content-Length goes on with it (not chunked: a cut-off upload reads as
    short, never as complete); a chunked one goes on chunked; a GET without a body goes on
    with neither (it went chunked)."""
    with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
        _raw(gw.url, b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 11\r\n\r\n{\"qty\": 10}")
        _raw(
            gw.url,
            b"POST /b HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n",
        )
        _raw(gw.url, b"GET /c HTTP/1.1\r\nHost: t\r\n\r\n")
    with_length, chunked, get = (raw_upstream.fields(n) for n in range(3))
    assert with_length[b"content-length"] == b"11" and b"transfer-encoding" not in with_length
    assert chunked[b"transfer-encoding"] == b"chunked" and b"content-length" not in chunked
    assert b"transfer-encoding" not in get and b"content-length" not in get
    assert raw_upstream.bodies == [b'{"qty": 10}', b'{"a":1}', b""]


def test_expect_100_continue_is_answered_here_not_passed_on(raw_upstream: _RawUpstream) -> None:
    """``Expect: 100-continue`` is not passed on: the body goes up at once, whether or not the
    upstream would send an interim 100 (this one never does; aiohttp would have held the
    body back for it until the timeout)."""
    with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
        start = time.monotonic()
        answer = _raw(
            gw.url,
            b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n"
            b"\r\n{}",
        )
        assert time.monotonic() - start < 4
    assert answer.split(b"\r\n")[0] in (b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"), answer
    assert b"200 OK" in answer
    assert b"expect" not in raw_upstream.fields(0)
    assert raw_upstream.bodies == [b"{}"]


def test_a_header_field_that_is_not_utf8_is_not_sent_and_its_key_released(
    raw_upstream: _RawUpstream, tmp_path: Path
) -> None:
    """A field value of bytes that are neither ASCII nor UTF-8 (obs-text) would change on the
    way (the upstream side writes UTF-8): the request is not sent, 502 says why, and its key
    is released, so the retry with a clean field runs."""
    store = SQLiteStore(tmp_path / "obs.db")
    app = IdempotencyMiddleware(ReverseProxy(raw_upstream.url, timeout=5), store=store)
    request = (
        b"POST /o HTTP/1.1\r\nHost: t\r\nIdempotency-Key: obs-1\r\nX-Name: %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    with ServerThread(app) as gw:
        refused = _raw(gw.url, request % b"caf\xe9")
        again = _raw(gw.url, request % "café".encode())
    assert refused.startswith(b"HTTP/1.1 502"), refused
    assert b"x-name" in refused and b"not sent upstream" in refused
    assert again.startswith(b"HTTP/1.1 200"), again
    assert len(raw_upstream.heads) == 1
    assert raw_upstream.fields(0)[b"x-name"] == "café".encode()
    store.close()


def test_a_target_that_is_no_path_is_not_forwarded_anywhere(raw_upstream: _RawUpstream) -> None:
    """A request target that is no path would name another server once joined to the
    upstream's URL (helper-56: ``GET @127.0.0.1:P/secret`` went to port P, the client's
    X-Api-Key with it): 400 not-forwarded, nothing sent anywhere. An absolute-form target
    goes on by its path."""
    elsewhere = _RawUpstream()
    port = elsewhere.url.rsplit(":", 1)[1]
    try:
        with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
            answers = [
                _raw(gw.url, b"GET @127.0.0.1:%s/secret HTTP/1.1\r\nHost: t\r\n"
                     b"X-Api-Key: k\r\nConnection: close\r\n\r\n" % port.encode()),
                _raw(gw.url, b"OPTIONS * HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"),
                _raw(gw.url, b"GET 127.0.0.1:%s HTTP/1.1\r\nHost: t\r\nConnection: close"
                     b"\r\n\r\n" % port.encode()),
                # aiohttp sends CONNECT to the authority it names (helper-57: /m went up as
                # the upstream's host:port, and the server broke on the switched protocol).
                _raw(gw.url, b"CONNECT /m HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                     b"Connection: close\r\n\r\nz"),
            ]  # fmt: skip
            absolute = _raw(
                gw.url,
                b"GET http://elsewhere.example/abs/x?q=1 HTTP/1.1\r\nHost: t\r\n"
                b"Connection: close\r\n\r\n",
            )
    finally:
        elsewhere.close()
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert b"urn:retrysafe:problem:not-forwarded" in answer
    assert absolute.startswith(b"HTTP/1.1 200"), absolute
    assert elsewhere.heads == []
    assert [h.split(b"\r\n")[0] for h in raw_upstream.heads] == [b"GET /abs/x?q=1 HTTP/1.1"]


def test_a_path_reaches_the_upstream_as_sent(raw_upstream: _RawUpstream) -> None:
    """Dot segments, doubled slashes and percent-encodings reach the upstream byte for byte
    (helper-56: ``/ok/a/../b`` arrived as ``/ok/b``): the upstream resolves its own paths."""
    targets = [b"/ok/a/../b", b"/ok/a/..", b"/../ok/x", b"/ok/%2e%2e/x", b"/a//b?x=%2F", b"/a/./b"]
    with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
        for target in targets:
            _raw(gw.url, b"GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" % target)
    sent = [h.split(b"\r\n")[0].split(b" ")[1] for h in raw_upstream.heads]
    assert sent == targets


def test_a_method_that_is_not_upper_case_is_not_forwarded(
    raw_upstream: _RawUpstream, tmp_path: Path
) -> None:
    """``post`` is not ``POST`` (RFC 9110 §9.1): it escaped the middleware's POST and went
    upstream upper-cased, an effect per retry (helper-56). Now 400 not-forwarded, nothing
    sent; an upper-case method of any name goes on as it is."""
    store = SQLiteStore(tmp_path / "case.db")
    app = IdempotencyMiddleware(ReverseProxy(raw_upstream.url, timeout=5), store=store)
    with ServerThread(app) as gw:
        lower = [
            _raw(gw.url, b"post /charge HTTP/1.1\r\nHost: t\r\nIdempotency-Key: low-1\r\n"
                 b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            for _ in range(2)
        ]  # fmt: skip
        purge = _raw(gw.url, b"PURGE /cache HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    for answer in lower:
        assert answer.startswith(b"HTTP/1.1 400") and b"not-forwarded" in answer, answer
    assert purge.startswith(b"HTTP/1.1 200"), purge
    assert [h.split(b"\r\n")[0] for h in raw_upstream.heads] == [b"PURGE /cache HTTP/1.1"]
    store.close()


def test_fields_a_connection_field_names_are_not_passed_on(raw_upstream: _RawUpstream) -> None:
    """A field named by a Connection field belongs to that connection (RFC 9110 §7.6.1),
    both ways: the request's X-Hop does not reach the upstream, the answer's X-Secret does
    not reach the client (helper-56: x-hop went on)."""
    raw_upstream.answer = (
        b"HTTP/1.1 200 OK\r\nConnection: close, X-Secret\r\nX-Secret: s\r\nX-Kept: k\r\n"
        b"Content-Length: 2\r\n\r\nok"
    )
    with ServerThread(ReverseProxy(raw_upstream.url, timeout=5)) as gw:
        answer = _raw(
            gw.url,
            b"GET /h HTTP/1.1\r\nHost: t\r\nConnection: close, X-Hop\r\nX-Hop: secret\r\n"
            b"X-Other: o\r\n\r\n",
        )
        _raw(
            gw.url,
            b"POST /n HTTP/1.1\r\nHost: t\r\nConnection: close, Content-Length, Host\r\n"
            b"Content-Length: 2\r\n\r\n{}",
        )
    fields = raw_upstream.fields(0)
    assert b"x-hop" not in fields and fields[b"x-other"] == b"o"
    # Framing and route are no connection options (helper-57: the body went chunked).
    named = raw_upstream.fields(1)
    assert named[b"content-length"] == b"2" and b"transfer-encoding" not in named
    assert raw_upstream.bodies[1] == b"{}"
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert b"x-secret" not in head and b"x-kept: k" in head


def test_x_forwarded_for_keeps_the_chain_and_adds_the_peer(
    raw_upstream: _RawUpstream, tmp_path: Path
) -> None:
    """``retrysafe gateway`` adds the peer it saw to the client's X-Forwarded-For, in one
    field, and writes X-Forwarded-Proto and -Host itself: a local client's forwarding fields
    were taken at face value and the real peer lost (helper-56: two fields of 1.2.3.4), and
    a client's Forwarded went on as the client wrote it (helper-57): this hop is added."""
    port = free_port()
    proc = _gateway_process(raw_upstream, tmp_path / "xff.db", port)
    try:
        _raw(
            f"http://127.0.0.1:{port}",
            b"GET /f HTTP/1.1\r\nHost: t\r\nX-Forwarded-For: 1.2.3.4\r\n"
            b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: evil\r\nForwarded: for=1.1.1.1\r\n"
            b"Connection: close\r\n\r\n",
        )
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    lines = raw_upstream.heads[0].lower().split(b"\r\n")
    assert [x for x in lines if x.startswith(b"x-forwarded-for:")] == [
        b"x-forwarded-for: 1.2.3.4, 127.0.0.1"
    ]
    assert [x for x in lines if x.startswith(b"x-forwarded-proto:")] == [b"x-forwarded-proto: http"]
    assert [x for x in lines if x.startswith(b"x-forwarded-host:")] == [b"x-forwarded-host: t"]
    assert [x for x in lines if x.startswith(b"forwarded:")] == [
        b"forwarded: for=1.1.1.1, for=127.0.0.1;proto=http;host=t"
    ]


def test_a_client_reading_a_long_answer_slowly_keeps_its_key(
    upstream: ServerThread, effects: Counter[str], tmp_path: Path
) -> None:
    """An answer that keeps moving to a slow client is no wedged request: renewal goes on
    past max_run_time (1 s here, from the claim) while its body moves, so a retry meanwhile
    gets 409 and one after it no second effect (helper-56: a 20 MB answer read at 1.3 MB/s,
    the lease ran out mid-read and the retry ran the effect again)."""
    store = SQLiteStore(tmp_path / "slow-read.db")
    app = IdempotencyMiddleware(
        ReverseProxy(upstream.url, timeout=1.0),
        store=store, lease=0.6, heartbeat=0.2, max_run_time=1.0,
        max_replay_size=32 * 1024 * 1024,
    )  # fmt: skip
    headers = {"Idempotency-Key": "slow-reader"}
    with ServerThread(app) as gw:
        sock = keyed_post(gw.url, b"slow-reader", path=b"/big", rcvbuf=16 * 1024)
        start, got, during = time.monotonic(), 0, None
        with sock:
            while chunk := sock.recv(32 * 1024):
                got += len(chunk)
                time.sleep(0.004)  # a few MB/s: some 5 s for 16 MiB
                if during is None and time.monotonic() - start > 2.5:  # past run time + lease
                    retry = httpx.post(gw.url + "/big", content=b"{}", headers=headers)
                    during = retry.status_code
        took = time.monotonic() - start
        after = httpx.post(gw.url + "/big", content=b"{}", headers=headers)
    assert took > 2.5 and during == 409, (took, during)
    assert got > 16 * 1024 * 1024
    assert after.status_code == 200 and after.headers["idempotent-replayed"] == "true"
    assert effects["big"] == 1
    store.close()


def test_an_endless_answer_is_still_bounded_by_max_run_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Time waiting for the client is not counted, but the app's own is: an answer that
    streams without end to a client that takes it at once stops being renewed at
    max_run_time (helper-57: a first form counted from each chunk, and a 1-byte-a-second
    stream held its key for ever)."""

    async def drip(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(60):  # 6 s, a byte every 0.1 s
            await asyncio.sleep(0.1)
            await send({"type": "http.response.body", "body": b".", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    store = SQLiteStore(tmp_path / "drip.db")
    app = IdempotencyMiddleware(drip, store=store, lease=0.6, heartbeat=0.2, max_run_time=1.0)
    caplog.set_level("WARNING", logger="retrysafe")
    with ServerThread(app) as server, httpx.stream(
        "POST", server.url + "/drip", content=b"{}", headers={"Idempotency-Key": "drip"}
    ) as answer:
        start = time.monotonic()
        for _ in answer.iter_bytes():
            if time.monotonic() - start > 2.0:
                break
    assert [r for r in caplog.records if getattr(r, "decision", None) == "max-run-time"]
    store.close()


