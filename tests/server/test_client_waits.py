"""max_run_time counts the handler's own time: a paused client's waits are left out, on
every way an answer leaves (ASGI sends, WSGI iterables, WSGI's legacy ``write()``); and
``write()``'s bytes wait for the record like any others."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from retrysafe import StoreUnavailableError
from retrysafe._serving import ServerThread
from retrysafe.server import IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import SQLiteStore

from .harness import WSGIServerThread, keyed_post

_CHUNKS, _SIZE = 40, 200_000  # 8 MB, more than the sockets' buffers hold


def _paused_read(url: str, key: bytes, pause: float, during: Callable[[], int]) -> tuple[int, int]:
    """POST with ``key`` on a socket with a small receive buffer, read 100 kB, pause
    ``pause`` seconds (connection open), call ``during``, read the rest; returns the bytes
    read and what ``during`` returned."""
    with keyed_post(url, key, rcvbuf=4096) as sock:
        got = 0
        while got < 100_000:
            got += len(sock.recv(65536))
        time.sleep(pause)
        status = during()
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    return got, status


def test_an_asgi_send_waiting_for_a_paused_client_is_not_the_handlers_time(
    tmp_path: Path,
) -> None:
    """One send of the answer that waits longer than max_run_time for a client that paused
    (connection open) is the client's time, not the handler's: the key keeps being renewed,
    a retry meanwhile gets 409 and the handler runs once (helper-58: the wait in progress
    was counted, and the retry ran the handler again, under ASGI and WSGI alike)."""
    effects: Counter[str] = Counter()

    async def big(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        effects["x"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(256):  # 16 MiB, more than the sockets' buffers hold
            await send({"type": "http.response.body", "body": b"b" * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    store = SQLiteStore(tmp_path / "pause.db")
    app = IdempotencyMiddleware(
        big, store=store, lease=0.6, heartbeat=0.2, max_run_time=1.0,
        max_replay_size=32 * 1024 * 1024,
    )  # fmt: skip
    headers = {"Idempotency-Key": "pauses"}
    with ServerThread(app) as server:

        def retry() -> int:
            return httpx.post(server.url + "/x", content=b"{}", headers=headers).status_code

        got, during = _paused_read(server.url, b"pauses", 2.5, retry)
        after = httpx.post(server.url + "/x", content=b"{}", headers=headers)
    assert during == 409, during
    assert got > 16 * 1024 * 1024
    assert after.status_code == 200 and after.headers["idempotent-replayed"] == "true"
    assert effects["x"] == 1
    store.close()


def test_a_wsgi_write_waiting_for_a_paused_client_is_not_the_handlers_time(
    tmp_path: Path,
) -> None:
    """An app that answers through the legacy ``write()`` callable, its own time 0.4 s, to a
    client that pauses 2.5 s (past max_run_time 1 s and the lease after it): the key keeps
    being renewed, a retry meanwhile gets 409, the app runs once (helper-59: write()'s waits
    were counted, the retry ran the app again and the first answer was fenced)."""
    effects: Counter[str] = Counter()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        effects["x"] += 1
        write = start_response("200 OK", [("Content-Type", "application/octet-stream")])
        for _ in range(_CHUNKS):
            time.sleep(0.01)
            write(b"w" * _SIZE)
        return []

    store = SQLiteStore(tmp_path / "write.db")
    wrapped = WSGIIdempotencyMiddleware(
        app, store=store, lease=0.6, heartbeat=0.2, max_run_time=1.0,
        max_replay_size=16 * 1024 * 1024,
    )  # fmt: skip
    headers = {"Idempotency-Key": "writes"}
    with WSGIServerThread(wrapped) as server:

        def retry() -> int:
            return httpx.post(server.url + "/x", content=b"{}", headers=headers).status_code

        got, during = _paused_read(server.url, b"writes", 2.5, retry)
        after = httpx.post(server.url + "/x", content=b"{}", headers=headers)
    assert during == 409, during
    assert got > _CHUNKS * _SIZE
    assert after.status_code == 200 and after.headers["idempotent-replayed"] == "true"
    assert effects["x"] == 1
    store.close()


def test_write_bytes_completing_a_content_length_wait_for_the_record(tmp_path: Path) -> None:
    """An app that declares a Content-Length and writes its body with ``write()``: the bytes
    that complete it wait for the record, so when the record cannot land the client gets a
    cut answer, never the whole one (they all went out at once; helper-59 saw a fenced
    answer arrive complete)."""
    effects: Counter[str] = Counter()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        effects["x"] += 1
        write = start_response("200 OK", [("Content-Length", "200000")])
        write(b"a" * 100_000)
        write(b"b" * 100_000)
        return []

    store = SQLiteStore(tmp_path / "cl.db")
    wrapped = WSGIIdempotencyMiddleware(app, store=store)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("the store is down", store="test")

    store.complete = down  # type: ignore[method-assign]
    with WSGIServerThread(wrapped) as server, keyed_post(server.url, b"cl") as sock:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert len(body) < 200_000 and b"b" not in body
    assert effects["x"] == 1
    store.close()
