"""SPEC §3 when it is hard: a slow handler, a client that leaves, a store that cannot record.

Real sockets throughout: uvicorn for ASGI (Starlette), werkzeug's threaded server for WSGI
(Flask), a real clock, and real failures (a SIGKILLed server, a full tmpfs disk).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retrysafe._serving import free_port
from retrysafe.core import KeyState
from retrysafe.stores import SQLiteStore

from .harness import HOLD, Harness, Serve, assert_problem, is_replay, records, stream_body

BOTH = pytest.mark.parametrize("framework", ["starlette", "flask"])  # ASGI and WSGI


def _post(h: Harness, path: str, key: str, timeout: float) -> httpx.Response:
    headers = dict(HOLD) if path in ("/slow", "/late") else {}
    return h.client.post(
        path, json={}, headers={"Idempotency-Key": key, **headers}, timeout=timeout
    )


def _completed(h: Harness) -> bool:
    return any(r.state is KeyState.COMPLETED for r in records(h.store))


def _wait(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.02)


@BOTH
def test_handler_outliving_its_lease_runs_once(serve: Serve) -> None:
    """Lease 2 s, handler 5 s, client timeout 1 s, a retry every 0.5 s for 8 s: one effect;
    the retries get 409 while it runs (long past the lease), then the replay."""
    h = serve(clock=time.time, lease=2)
    opener = threading.Timer(5.0, h.effects.gate.set)
    start = time.monotonic()
    opener.start()
    try:
        with pytest.raises(httpx.TimeoutException):
            _post(h, "/slow", "slow-ai-call", timeout=1)
        seen: list[tuple[float, httpx.Response]] = []
        while time.monotonic() - start < 8:
            time.sleep(0.5)
            seen.append((time.monotonic() - start, _post(h, "/slow", "slow-ai-call", timeout=1)))
    finally:
        opener.cancel()
        h.effects.gate.set()
    assert h.effects.counts["slow"] == 1
    conflicts = [t for t, r in seen if r.status_code == 409]
    replays = [r for _, r in seen if r.status_code == 201]
    assert conflicts and max(conflicts) > 4.0  # still 409 twice the lease after the claim
    assert len(conflicts) + len(replays) == len(seen)
    assert replays and all(is_replay(r) and r.json() == {"n": 1} for r in replays)
    assert [r.status_code for _, r in seen] == sorted(
        (r.status_code for _, r in seen), reverse=True
    )  # every 409 came before every replay


@pytest.fixture
def killable(tmp_path: Path) -> Iterator[object]:
    """Start ``tests/server/killable_app.py`` processes on one SQLite file; kill them at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    db, ledger = tmp_path / "keys.db", tmp_path / "ledger.txt"
    script = Path(__file__).with_name("killable_app.py")

    def start(lease: float) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(script), str(db), str(ledger), str(port), str(lease)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        procs.append(proc)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return f"http://127.0.0.1:{port}"
            except OSError:
                assert proc.poll() is None, "the app process died at start"
                assert time.monotonic() < deadline, "the app never listened"
                time.sleep(0.05)

    start.ledger = ledger  # type: ignore[attr-defined]
    start.procs = procs  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_sigkilled_handler_is_taken_over_after_the_short_lease(killable: object) -> None:
    """A handler SIGKILLed mid-run stops renewing; after its (short) lease a retry on a new
    process takes the key over and the effect runs once."""
    lease = 1.5
    first = killable(lease)  # type: ignore[operator]
    ledger: Path = killable.ledger  # type: ignore[attr-defined]
    key = {"Idempotency-Key": "order-42"}

    def doomed() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
            httpx.post(f"{first}/work", json={}, headers={**key, "X-Sleep": "30"}, timeout=30)

    sender = threading.Thread(target=doomed)
    sender.start()
    _wait(lambda: ledger.exists() and "start" in ledger.read_text())
    time.sleep(lease)  # long enough that the dead process had renewed at least once
    killable.procs[0].send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    killed_at = time.monotonic()
    sender.join(10)
    second = killable(lease)  # type: ignore[operator]
    statuses: list[int] = []
    with httpx.Client(base_url=second, timeout=10) as client:
        while time.monotonic() - killed_at < 15:
            r = client.post("/work", json={}, headers={**key, "X-Sleep": "0"})
            statuses.append(r.status_code)
            if r.status_code == 201:
                break
            assert_problem(r, 409, "request-in-progress")
            time.sleep(0.1)
        took_over_after = time.monotonic() - killed_at
        replay = client.post("/work", json={}, headers={**key, "X-Sleep": "0"})
    assert statuses[-1] == 201
    assert took_over_after < lease + 3.0  # the lease, not a long default, bounded the wait
    assert is_replay(replay)
    assert ledger.read_text().split() == ["start", "start", "effect"]


@BOTH
def test_streamed_answer_whose_client_leaves_is_captured_and_replayed(serve: Serve) -> None:
    """A client that reads the first bytes of a streamed answer and leaves: one effect, the
    key completes with the whole answer, and the retry replays all of it."""
    h = serve(clock=time.time)
    with h.client.stream(
        "POST", "/stream", json={}, headers={"Idempotency-Key": "s1"}
    ) as response:
        assert response.status_code == 201
        first = next(response.iter_raw())
        assert first
    _wait(lambda: _completed(h))
    retry = _post(h, "/stream", "s1", timeout=5)
    assert is_replay(retry)
    assert retry.status_code == 201
    assert retry.content == stream_body(1)
    assert h.effects.counts["stream"] == 1


@BOTH
def test_answer_whose_client_timed_out_is_recorded_and_replayed(serve: Serve) -> None:
    """A client that timed out before a buffered answer was ready: the answer is still stored,
    and the retry replays it; one effect."""
    h = serve(clock=time.time)
    with pytest.raises(httpx.TimeoutException):
        _post(h, "/late", "l1", timeout=0.3)
    assert h.effects.counts["late"] == 1
    h.effects.gate.set()
    _wait(lambda: _completed(h))
    retry = _post(h, "/late", "l1", timeout=5)
    assert is_replay(retry)
    assert (retry.status_code, retry.json()) == (201, {"n": 1})
    assert h.effects.counts["late"] == 1


@BOTH
def test_client_leaving_before_its_body_arrived_runs_nothing(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that disconnects before sending its whole body: no handler run, no key held."""
    h = serve(clock=time.time)
    caplog.set_level(logging.INFO, logger="retrysafe.server")
    host, port = h.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /posts HTTP/1.1\r\nHost: t\r\nIdempotency-Key: b1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\": 1"
        )
    _wait(lambda: any(getattr(r, "decision", "") == "disconnect" for r in caplog.records))
    assert records(h.store) == []
    assert h.effects.counts["posts"] == 0
    whole = h.post("/posts", "b1", json={"a": 1})
    assert (whole.status_code, is_replay(whole)) == (201, False)


@BOTH
def test_wedged_handler_stops_renewing_after_max_run_time(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that never finishes holds its key only for max_run_time plus one lease; then
    renewal stops (logged) and a retry takes the key over."""
    h = serve(clock=time.time, lease=1, max_run_time=1.5, retention=3600)
    caplog.set_level(logging.INFO, logger="retrysafe.server")
    start = time.monotonic()
    wedged = threading.Thread(target=lambda: _post(h, "/slow", "w1", timeout=30))
    wedged.start()
    try:
        assert h.effects.entered.wait(5)
        while True:
            r = h.client.post("/slow", json={}, headers={"Idempotency-Key": "w1"}, timeout=5)
            if r.status_code != 409:
                break
            assert time.monotonic() - start < 6, "the wedged handler kept its key"
            time.sleep(0.1)
        elapsed = time.monotonic() - start
    finally:
        h.effects.gate.set()
        wedged.join(10)
    assert (r.status_code, is_replay(r)) == (201, False)
    assert elapsed >= 1.5  # renewed until max_run_time ...
    assert any(getattr(x, "decision", "") == "max-run-time" for x in caplog.records)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for this test (the machine's CI runs as root)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def _answer_while_the_disk_fills(h: Harness, disk: Path, key: str) -> tuple[httpx.Response, Path]:
    """Send ``/slow`` under ``key``, fill ``disk`` while the handler runs, then let it answer:
    the answer its client got, and the filler file (unlink it to free the disk)."""
    result: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: result.append(_post(h, "/slow", key, 15)))
    sender.start()
    assert h.effects.entered.wait(5)
    filler = _fill(disk)
    h.effects.gate.set()
    sender.join(15)
    return result[0], filler


@BOTH
def test_answer_that_cannot_be_recorded_is_503_then_replayed(
    serve: Serve, full_disk: Path
) -> None:
    """The disk fills up while the handler runs: its client gets 503 store-unavailable, not
    the unrecorded answer; once space is back the background record lands and a retry gets
    the replay; one effect."""
    store = SQLiteStore(full_disk / "keys.db")
    try:
        h = serve(store=store, clock=time.time)
        answer, filler = _answer_while_the_disk_fills(h, full_disk, "d1")
        assert_problem(answer, 503, "store-unavailable")
        assert "was handled" in answer.json()["detail"]  # not "nothing was run"
        assert h.effects.counts["slow"] == 1
        assert not _completed(h)
        filler.unlink()
        _wait(lambda: _completed(h))
        retry = _post(h, "/slow", "d1", timeout=5)
        assert is_replay(retry)
        assert (retry.status_code, retry.json()) == (201, {"n": 1})
        assert h.effects.counts["slow"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("framework", ["starlette", "fastapi", "flask"])
def test_streamed_answer_to_a_client_that_stays_is_whole_and_replayed(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A streamed answer (Starlette's StreamingResponse, Flask's generator) reaches a client
    that reads it all, whole; it is stored once, replayed whole, and no lease is lost."""
    h = serve(clock=time.time, lease=0.6)
    caplog.set_level(logging.INFO, logger="retrysafe.server")
    first = _post(h, "/stream", "whole-1", timeout=10)
    assert (first.status_code, first.content) == (201, stream_body(1))
    time.sleep(0.5)  # past a heartbeat: a renewal of the finished key would say lease-lost
    again = _post(h, "/stream", "whole-1", timeout=10)
    assert is_replay(again) and again.content == stream_body(1)
    decisions = [getattr(r, "decision", "") for r in caplog.records]
    assert "stored" in decisions and "lease-lost" not in decisions
    assert h.effects.counts["stream"] == 1


def test_file_response_behind_the_middleware_is_whole(tmp_path: Path) -> None:
    """Starlette's FileResponse passes through whole (201 and its bytes), and replays."""
    from starlette.applications import Starlette
    from starlette.responses import FileResponse
    from starlette.routing import Route

    from retrysafe._serving import ServerThread
    from retrysafe.server import IdempotencyMiddleware

    report = tmp_path / "report.csv"
    report.write_bytes(b"id,total\n" + b"".join(b"%d,%d\n" % (i, i * 7) for i in range(5000)))

    async def export(request: object) -> FileResponse:
        return FileResponse(report, status_code=201, media_type="text/csv")

    store = SQLiteStore(tmp_path / "keys.db")
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/export", export, methods=["POST"])]), store, lease=1
    )
    with ServerThread(app) as server:
        headers = {"Idempotency-Key": "file-1"}
        first = httpx.post(server.url + "/export", headers=headers, timeout=10)
        again = httpx.post(server.url + "/export", headers=headers, timeout=10)
    assert (first.status_code, first.content) == (201, report.read_bytes())
    assert is_replay(again) and again.content == report.read_bytes()
    store.close()


@BOTH
def test_store_down_longer_than_the_lease_never_lets_a_retry_take_over(
    serve: Serve, full_disk: Path
) -> None:
    """The disk stays full for three leases: retries meanwhile and right after it frees get
    503 from the process still holding the unrecorded answer, never a take-over; then the
    replay; one effect."""
    store = SQLiteStore(full_disk / "keys.db")
    try:
        h = serve(store=store, clock=time.time, lease=0.6)
        answer, filler = _answer_while_the_disk_fills(h, full_disk, "d2")
        assert_problem(answer, 503, "store-unavailable")
        time.sleep(1.8)  # three leases, no renewal can land
        assert_problem(_post(h, "/slow", "d2", timeout=5), 503, "store-unavailable")
        filler.unlink()
        answers = [_post(h, "/slow", "d2", timeout=5) for _ in range(3)]  # at once
        _wait(lambda: _completed(h))
        answers.append(_post(h, "/slow", "d2", timeout=5))
        assert all(r.status_code in (201, 503) for r in answers)
        assert is_replay(answers[-1]) and answers[-1].json() == {"n": 1}
        assert h.effects.counts["slow"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("framework", ["flask"])
def test_chunked_body_cut_off_runs_nothing(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunked request body that breaks off (werkzeug: "Invalid chunk header") is a client
    that left: no handler run, no key held, no 500 traceback."""
    h = serve(clock=time.time)
    caplog.set_level(logging.INFO, logger="retrysafe.server")
    host, port = h.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /posts HTTP/1.1\r\nHost: t\r\nIdempotency-Key: c1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\n{\"a\":\r\nzz"
        )
        sock.shutdown(socket.SHUT_WR)
        reply = sock.recv(4096)
    _wait(lambda: any(getattr(r, "decision", "") == "disconnect" for r in caplog.records))
    assert b" 500 " not in reply.split(b"\r\n", 1)[0]
    assert records(h.store) == []
    assert h.effects.counts["posts"] == 0


@BOTH
def test_renewal_that_finds_the_key_taken_over_says_so_and_writes_nothing(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A live handler whose key was taken over meanwhile (its process stalled past the lease):
    the next renewal logs lease-lost at ERROR, its late answer is neither written nor shown
    (its client gets 409), and the new owner's record stays untouched (SPEC §3)."""
    h = serve(clock=time.time, lease=0.6)
    caplog.set_level(logging.INFO, logger="retrysafe.server")
    result: list[httpx.Response] = []
    stale = threading.Thread(target=lambda: result.append(_post(h, "/slow", "t1", 15)))
    stale.start()
    try:
        assert h.effects.entered.wait(5)
        [record] = records(h.store)
        # What a stalled process sees: someone took its key over once its lease ran out.
        new = h.store.take_over(
            record.key_hash, record.fencing_token, now=time.time() + 5, lease=60
        )
        assert new is not None
        _wait(lambda: any(getattr(r, "decision", "") == "lease-lost" for r in caplog.records))
    finally:
        h.effects.gate.set()
        stale.join(15)
    assert_problem(result[0], 409, "request-in-progress")
    lost = [r for r in caplog.records if getattr(r, "decision", "") == "lease-lost"]
    assert lost[0].levelno == logging.ERROR
    [after] = records(h.store)
    assert (after.state, after.fencing_token) == (KeyState.RUNNING, new.fencing_token)
    assert "stored" not in [getattr(r, "decision", "") for r in caplog.records]
