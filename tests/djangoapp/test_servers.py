"""A real Django project served by real servers (uvicorn: ASGI, gunicorn: WSGI), on SQLite and
PostgreSQL, through the chaos proxy: one effect per key, a burst of identical requests runs
the view once, and in transactional mode a crash between effect and completion leaves
neither."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from retrysafe.chaos import ChaosProxy, Fault, FaultRates

from .conftest import Server


def _charges(server: Server, key: str) -> int:
    got: int = httpx.get(f"{server.url}/charges", params={"key": key}, timeout=10).json()["charges"]
    return got


def _key_states(db: dict[str, str]) -> dict[str, str]:
    """Key hash → state, read from the project's database with retrysafe's own store."""
    from retrysafe.stores import open_store

    if "RS_PG_SCHEMA" in db:
        store = open_store(db["RETRYSAFE_TEST_POSTGRES"], schema=db["RS_PG_SCHEMA"], create=False)
    else:
        store = open_store(f"sqlite:///{db['RS_SQLITE']}", create=False)
    try:
        return {e.key_hash: e.state for e in store.list_keys(now=time.time(), limit=1000)}
    finally:
        store.close()


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_answers_lost_after_commit_make_no_second_effect(
    database: dict[str, str], serve: Callable[..., Server], server: str
) -> None:
    """30 % of answers lost after the view committed, 20 operations retried with their key
    until answered: every key has exactly one Charge row (and answers were really lost)."""
    app = serve(database, server)
    keys = [f"op-{i}-{uuid.uuid4().hex[:8]}" for i in range(20)]
    with ChaosProxy(app.url, rates=FaultRates(lose_after_commit=0.3), seed=7) as proxy:
        with httpx.Client(base_url=proxy.url, timeout=5) as client:
            for key in keys:
                for _attempt in range(30):
                    try:
                        r = client.post(
                            "/charge", json={"amount": 1}, headers={"Idempotency-Key": key}
                        )
                    except httpx.TransportError:
                        continue  # "I don't know": retry with the same key
                    if r.status_code == 409:
                        time.sleep(0.05)
                        continue
                    assert r.status_code == 201, r.text
                    break
                else:
                    pytest.fail(f"{key} never answered")
        lost = proxy.stats().by_fault.get(Fault.LOSE_AFTER_COMMIT, 0)
    assert lost >= 3  # the faults happened, so a duplicate was possible
    assert {key: _charges(app, key) for key in keys} == dict.fromkeys(keys, 1)


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_fifty_concurrent_identical_requests_run_the_view_once(
    database: dict[str, str], serve: Callable[..., Server], server: str
) -> None:
    """50 identical requests at once (the view takes 3 s): one runs, the others get 409
    request-in-progress, and a later repeat gets the replay; one Charge row."""
    app = serve(database, server)
    key = f"burst-{uuid.uuid4().hex[:8]}"
    # 3 s: httpx sends 50 requests in well under a second here, but seconds on a slow host
    headers = {"Idempotency-Key": key, "X-Sleep": "3"}

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=app.url, timeout=30, limits=limits) as client:
            return await asyncio.gather(
                *(client.post("/charge", json={"amount": 9}, headers=headers) for _ in range(50))
            )

    answers = asyncio.run(burst())
    # One ran; the others overlapped it (409) or, on a loaded machine, arrived once it had
    # finished and got its replay: never a second run.
    ran = [r for r in answers if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    rest = sorted(
        "replay" if r.headers.get("idempotent-replayed") == "true" else str(r.status_code)
        for r in answers
        if r not in ran
    )
    assert len(ran) == 1 and set(rest) <= {"409", "replay"}, rest
    assert rest.count("409") >= 25, rest  # the burst did overlap the running view
    replay = httpx.post(f"{app.url}/charge", json={"amount": 9}, headers=headers, timeout=30)
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert _charges(app, key) == 1


@pytest.mark.parametrize("server", ["gunicorn", "uvicorn"])
def test_transactional_crash_between_effect_and_completion_leaves_neither(
    database: dict[str, str], serve: Callable[..., Server], server: str, tmp_path: Path
) -> None:
    """TRANSACTIONAL, lease 1 s: the server is SIGKILLed after the view wrote its row but
    before the key completed. Neither landed: no row, the key still running (not
    completed). After a restart the retry takes the key over and the effect happens once."""
    app = serve(database, server, TRANSACTIONAL=True, LEASE=1.0)
    key = f"crash-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "crashed"
    headers = {"Idempotency-Key": key, "X-Crash-Once": str(marker)}
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{app.url}/charge", json={"amount": 3}, headers=headers, timeout=10)
    assert marker.exists()  # the view ran and wrote its row, then died
    with contextlib.suppress(ProcessLookupError):
        app.proc.send_signal(signal.SIGKILL)  # gunicorn: its master, not only the worker
    app.proc.wait(10)
    assert list(_key_states(database).values()) == ["running"]
    again: Any = serve.restart(app.env)  # type: ignore[attr-defined]
    assert _charges(again, key) == 0  # the row rolled back with the process
    deadline = time.monotonic() + 15
    while True:
        r = httpx.post(f"{again.url}/charge", json={"amount": 3}, headers=headers, timeout=10)
        if r.status_code != 409:
            break
        assert time.monotonic() < deadline, "the dead claim was never taken over"
        time.sleep(0.2)
    assert r.status_code == 201, r.text
    assert _charges(again, key) == 1
    assert list(_key_states(database).values()) == ["completed"]


def _leave_early(
    url: str, path: str, key: str, *, after: float, until: bytes = b"", headers: dict[str, str]
) -> bytes:
    """POST with ``key`` over a raw socket, read the answer until ``until`` arrived (or
    ``after`` seconds passed), then close the connection: a client that goes away."""
    host, port = url.removeprefix("http://").split(":")
    body = b"{}"
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        f"Idempotency-Key: {key}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    with socket.create_connection((host, int(port)), timeout=after) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        got = b""
        deadline = time.monotonic() + after
        with contextlib.suppress(OSError):
            while until and until not in got and time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
            if not until:
                time.sleep(after)
    return got


def _replayed(app: Server, path: str, key: str, **headers: str) -> httpx.Response:
    """Retry with the same key until the answer is no longer 409 (the first still runs)."""
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(
            f"{app.url}{path}", json={}, headers={"Idempotency-Key": key, **headers}, timeout=20
        )
        if r.status_code != 409:
            return r
        assert time.monotonic() < deadline, "still 409"
        time.sleep(0.2)


def test_asgi_client_leaving_while_the_view_runs_gets_the_replay(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """Under uvicorn Django cancels the request when its client leaves; the view (1 s)
    still runs to its end and its answer is recorded: the retry gets the replay, one effect."""
    app = serve({"RS_SQLITE": str(tmp_path / "db.sqlite3")}, "uvicorn")
    key = f"gone-{uuid.uuid4().hex[:8]}"
    _leave_early(app.url, "/charge", key, after=0.3, headers={"X-Sleep": "1"})
    r = _replayed(app, "/charge", key, **{"X-Sleep": "1"})
    assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true", r.text
    assert _charges(app, key) == 1


def test_asgi_client_leaving_mid_async_stream_gets_the_whole_answer_replayed(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """An async streaming answer (1 s between chunks): the client reads the first chunk
    and leaves. The rest is still read and recorded: the retry gets all of it, one effect."""
    app = serve({"RS_SQLITE": str(tmp_path / "db.sqlite3")}, "uvicorn")
    key = f"stream-{uuid.uuid4().hex[:8]}"
    pause = {"X-Chunk-Sleep": "1"}
    first = _leave_early(app.url, "/astream", key, after=5, until=b"async part 0", headers=pause)
    assert b"async part 0" in first and b"async part 1" not in first
    r = _replayed(app, "/astream", key, **pause)
    assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true", r.text
    assert r.text.count("async part") == 3
    assert _charges(app, key) == 1


def test_sqlite_transactional_view_longer_than_its_lease_is_not_taken_over(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """SQLite, TRANSACTIONAL, lease 1 s, a 3 s view: its transaction holds the write lock
    from its start, so no one takes the key over; a repeat waits for the lock and then gets
    the replay. One effect."""
    app = serve({"RS_SQLITE": str(tmp_path / "db.sqlite3")}, "gunicorn", TRANSACTIONAL=True,
                LEASE=1.0)  # fmt: skip
    key = f"long-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "view-started"
    headers = {"Idempotency-Key": key, "X-Sleep": "3", "X-Started": str(marker)}
    results: list[httpx.Response] = []

    def first() -> None:
        results.append(httpx.post(f"{app.url}/charge", json={}, headers=headers, timeout=30))

    sender = threading.Thread(target=first)
    sender.start()
    # Timed from the view's start, not the send: on a loaded host the request can take
    # longer than the lease to reach the view.
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the view never started"
        time.sleep(0.01)
    time.sleep(1.5)  # past the lease
    repeat = httpx.post(f"{app.url}/charge", json={}, headers=headers, timeout=30)
    sender.join(30)
    assert results[0].status_code == 201
    assert repeat.status_code == 201 and repeat.headers["idempotent-replayed"] == "true"
    assert _charges(app, key) == 1


def test_a_dropped_persistent_connection_costs_one_request_not_all(
    serve: Callable[..., Server], pg_url: str, pg_schema: str
) -> None:
    """PostgreSQL with CONN_MAX_AGE=60 under gunicorn (one thread): the server drops the
    thread's connection. At most the next protected request fails (503); the connection is
    then closed and reopened, and every request after it runs."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {pg_schema}".encode())
    app_name = f"rs-{uuid.uuid4().hex[:8]}"
    db = {
        "RS_PG_SCHEMA": pg_schema, "RETRYSAFE_TEST_POSTGRES": pg_url, "RS_PG_APP": app_name,
        "RS_CONN_MAX_AGE": "60", "RS_THREADS": "1",
    }  # fmt: skip
    app = serve(db, "gunicorn")
    with httpx.Client(base_url=app.url, timeout=10) as client:
        for i in range(2):
            r = client.post("/charge", json={}, headers={"Idempotency-Key": f"warm-{i}"})
            assert r.status_code == 201
        with psycopg.connect(pg_url, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s",
                (app_name,),
            ).fetchone()
        assert killed is not None and killed[0] >= 1
        statuses = [
            client.post("/charge", json={}, headers={"Idempotency-Key": f"after-{i}"}).status_code
            for i in range(5)
        ]
    assert statuses.count(503) <= 1 and statuses[1:] == [201] * 4, statuses
