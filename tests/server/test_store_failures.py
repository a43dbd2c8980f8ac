"""SPEC §3 last row: a store that cannot serve answers 503 (fail closed) or, by option, runs
the handler unprotected (fail open). Nothing is ever corrupted."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from _readonly import ReadOnly
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import MemoryStore, SQLiteStore

from .harness import HOLD, Harness, Serve, assert_problem, is_replay, records


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[SQLiteStore, ReadOnly]]:
    """A SQLite store first used while its file is read-only (made after the schema), and the
    :class:`ReadOnly` holding it so: ``restore()`` makes the file writable again. The directory
    stays writable (SQLite then opens the file read-only: reads work, writes are refused)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "keys.db"
    SQLiteStore(path).close()
    with ReadOnly(path) as ro:
        store = SQLiteStore(path)
        try:
            yield store, ro
        finally:
            store.close()


@pytest.fixture
def read_only_store(read_only: tuple[SQLiteStore, ReadOnly]) -> SQLiteStore:
    return read_only[0]


@pytest.fixture
def locked_store(tmp_path: Path) -> Iterator[tuple[SQLiteStore, sqlite3.Connection]]:
    """A store (busy timeout 50 ms) while another connection holds ``BEGIN EXCLUSIVE``."""
    path = tmp_path / "locked.db"
    store = SQLiteStore(path, busy_timeout=0.05)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    yield store, holder
    holder.close()
    store.close()


def test_read_only_store_answers_503(serve: Serve, read_only_store: SQLiteStore) -> None:
    """A read-only store: 503 store-unavailable with Retry-After; the handler does not run."""
    h = serve(store=read_only_store, store_retry_after=2)
    r = h.post("/posts", key="k1", json={})
    assert_problem(r, 503, "store-unavailable")
    assert r.headers["retry-after"] == "2"
    assert h.effects.counts["posts"] == 0


def test_a_store_read_only_when_first_used_serves_once_writable_without_a_restart(
    serve: Serve, read_only: tuple[SQLiteStore, ReadOnly]
) -> None:
    """Read-only when first used: 503; once the file is writable the next request runs the
    handler and its repeat replays, on the same app and store."""
    store, ro = read_only
    h = serve(store=store)
    assert_problem(h.post("/posts", key="k1", json={}), 503, "store-unavailable")
    assert_problem(h.post("/posts", key="k1", json={}), 503, "store-unavailable")
    ro.restore()
    assert h.post("/posts", key="k1", json={}).status_code == 201
    assert is_replay(h.post("/posts", key="k1", json={}))
    assert h.effects.counts["posts"] == 1


def test_a_completed_key_is_replayed_while_the_store_is_read_only(
    serve: Serve, tmp_path: Path
) -> None:
    """A store that can be read but not written still replays a completed key (and refuses
    its reuse with another body); a new key gets 503, and nothing runs twice."""
    path = tmp_path / "keys.db"
    writable = SQLiteStore(path)
    first = serve(store=writable).post("/posts", key="k1", json={"a": 1})
    assert first.status_code == 201
    writable.close()
    with ReadOnly(path):
        store = SQLiteStore(path)
        try:
            h = serve(store=store)
            replay = h.post("/posts", key="k1", json={"a": 1})
            assert is_replay(replay)
            assert (replay.status_code, replay.content) == (201, first.content)
            assert_problem(h.post("/posts", key="k1", json={"a": 2}), 422, "key-reused")
            assert_problem(h.post("/posts", key="k2", json={}), 503, "store-unavailable")
            assert h.effects.counts["posts"] == 0
        finally:
            store.close()


def test_read_only_store_fail_open_runs_unprotected(
    serve: Serve, read_only_store: SQLiteStore
) -> None:
    """With ``fail_open=True`` the handler runs unprotected when the store fails."""
    h = serve(store=read_only_store, fail_open=True)
    assert h.post("/posts", key="k1", json={"a": 1}).json()["body_len"] == 7
    second = h.post("/posts", key="k1", json={"a": 1})
    assert not is_replay(second)
    assert h.effects.counts["posts"] == 2


def test_locked_store_answers_503_and_nothing_is_corrupted(
    serve: Serve, locked_store: tuple[SQLiteStore, sqlite3.Connection]
) -> None:
    """A store locked by another writer: 503; once unlocked it works and stays intact."""
    store, holder = locked_store
    h = serve(store=store)
    assert_problem(h.post("/posts", key="k1", json={}), 503, "store-unavailable")
    assert h.effects.counts["posts"] == 0
    holder.execute("COMMIT")
    assert records(store) == []
    assert h.post("/posts", key="k1", json={}).status_code == 201
    assert is_replay(h.post("/posts", key="k1", json={}))
    assert store.run(lambda c: c.execute("PRAGMA integrity_check").fetchone()) == ("ok",)


@contextmanager
def _write_lock(path: Path) -> Iterator[None]:
    """Another process's SQLite write lock on ``path`` for the block (a connection of its
    own in ``BEGIN IMMEDIATE``)."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


class _Held:
    """A ``POST /slow`` with ``key``, held at the effects' gate, sent from a thread of its
    own; :meth:`finish` opens the gate and returns its response."""

    def __init__(self, h: Harness, key: str) -> None:
        self.h = h
        self.responses: list[httpx.Response] = []
        self.thread = threading.Thread(
            target=lambda: self.responses.append(h.post("/slow", key=key, json={}, headers=HOLD))
        )
        self.thread.start()

    def finish(self) -> httpx.Response:
        self.h.effects.gate.set()
        self.thread.join(10)
        return self.responses[0]


def _ran_once(h: Harness, first: _Held, other: httpx.Response) -> None:
    """The held request, let go, ran and answered 201; ``other``, sent for its key while it
    ran, got 409 in progress: the handler ran once."""
    assert first.finish().status_code == 201
    assert_problem(other, 409, "request-in-progress")
    assert h.effects.counts["slow"] == 1


@pytest.mark.parametrize("framework", ["starlette", "fastapi"])
def test_an_asgi_replay_is_answered_while_another_process_holds_the_write_lock(
    serve: Serve, tmp_path: Path
) -> None:
    """ASGI: a completed key is replayed, and its reuse with another body refused, at once
    while another process holds the SQLite write lock (a transactional handler holds it for
    its whole run): the claim reads the record instead of waiting. It used to wait out the
    whole busy_timeout, 30 s here, longer than the client's timeout. (WSGI: the claim waits
    busy_timeout, then the record is read, as for a read-only store.)"""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=30)
    try:
        h = serve(store=store)
        first = h.post("/posts", key="k1", json={"a": 1})
        assert first.status_code == 201
        with _write_lock(path):
            replay = h.post("/posts", key="k1", json={"a": 1}, timeout=10)
            reused = h.post("/posts", key="k1", json={"a": 2}, timeout=10)
        assert is_replay(replay)
        assert (replay.status_code, replay.content) == (201, first.content)
        assert_problem(reused, 422, "key-reused")
        assert h.effects.counts["posts"] == 1
    finally:
        store.close()


def test_a_renewal_that_waited_for_the_lock_past_the_lease_is_not_taken_over(
    serve: Serve, tmp_path: Path
) -> None:
    """A fresh user's check: another process held the SQLite write lock past the lease while
    a handler ran; its heartbeat's renewal waited and landed with the lease end computed
    before it waited — already past — and a retry took the key over and ran the handler a
    second time. A renewal that waited is now followed at once by another, which lands with
    a fresh end: the retry gets 409 and the handler runs once."""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=30)
    h = serve(store=store, lease=1.2)  # a renewal every 0.4 s
    try:
        first = _Held(h, "k-lock")
        assert h.effects.entered.wait(10)
        with _write_lock(path):
            time.sleep(1.0)  # a renewal or two meet the lock and wait
            h.clock.advance(5)  # meanwhile the lease (1.2 s) ran out, on the store's clock
        time.sleep(0.3)  # the waiting renewal lands, and the one after it
        retry = h.post("/slow", key="k-lock", json={})
        _ran_once(h, first, retry)
    finally:
        h.effects.gate.set()
        store.close()


def test_a_claim_that_waited_for_the_lock_past_the_lease_is_renewed_before_it_runs(
    serve: Serve, tmp_path: Path
) -> None:
    """A fresh user's check: a new key's claim waited for another process's SQLite write
    lock longer than the lease and landed with its lease already over; a retry took the key
    over and the handler ran twice. A claim that took over a quarter of the lease is now
    renewed before the handler starts: the retry gets 409 and the handler runs once."""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=30)
    h = serve(store=store, lease=1.2)
    try:
        with _write_lock(path):
            first = _Held(h, "k-late")
            time.sleep(0.5)  # the claim meets the lock and waits
            h.clock.advance(5)  # meanwhile its lease (1.2 s) would have run out
        assert h.effects.entered.wait(10)
        retry = h.post("/slow", key="k-late", json={})
        _ran_once(h, first, retry)
    finally:
        h.effects.gate.set()
        store.close()


def test_a_request_in_progress_gets_409_while_another_process_holds_the_write_lock(
    serve: Serve, tmp_path: Path
) -> None:
    """A repeat of a request still running, while another process holds the SQLite write
    lock: 409, as without the lock (ASGI at once, from a read; WSGI once its claim waited
    busy_timeout). WSGI answered 503 (a fresh user's check)."""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=0.2)
    h = serve(store=store)
    try:
        first = _Held(h, "k-run")
        assert h.effects.entered.wait(10)
        with _write_lock(path):
            repeat = h.post("/slow", key="k-run", json={})
        _ran_once(h, first, repeat)
    finally:
        h.effects.gate.set()
        store.close()


def test_a_store_outage_while_the_handler_runs_does_not_lose_its_record(
    serve: Serve, tmp_path: Path
) -> None:
    """A store locked when the handler finishes: the completion is retried within the lease,
    the client gets its answer once it is stored, and a repeat replays it (no second run)."""
    path = tmp_path / "outage.db"
    store = SQLiteStore(path, busy_timeout=0.05)
    h = serve(store=store)
    result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: result.append(h.post("/slow", key="k-out", json={}, headers=HOLD))
    )
    worker.start()
    assert h.effects.entered.wait(10)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        h.effects.gate.set()
        # The handler has finished; its completion waits for the lock. Held 0.3 s of the
        # engine's RECORD_WAIT (1 s): the retries come 0.05, 0.15, 0.35 and 0.75 s after the
        # first try, so a commit of the lock delayed by a loaded machine still leaves one.
        time.sleep(0.3)
        assert result == []
    finally:
        holder.execute("COMMIT")
        holder.close()
    worker.join(10)
    assert result[0].status_code == 201
    assert is_replay(h.post("/slow", key="k-out", json={}))
    assert h.effects.counts["slow"] == 1


# ------------------------------------------- a record that landed while it seemed to fail


def _settled(outcomes: list[object], record: object) -> tuple[bool, list[str]]:
    """Drive :func:`settle` of a completion: each try of the op gets the next of
    ``outcomes`` (an exception is raised into it), a ``get`` gets ``record``. Returns what it
    decided and the ops it asked for."""
    from retrysafe.server._engine import settle

    args: tuple[object, ...] = ("h" * 64, 7, object())
    op: tuple[str, tuple[object, ...], dict[str, object]] = ("complete", args, {})
    gen = settle(op, wait=None)
    asked: list[str] = []
    sent: object = None
    tries = iter(outcomes)
    try:
        request = next(gen)
        while True:
            asked.append(request[0])
            if request[0] == "complete":
                outcome = next(tries)
                if isinstance(outcome, BaseException):
                    request = gen.throw(outcome)
                    continue
                sent = outcome
            elif request[0] == "get":
                sent = record
            else:
                sent = None
            request = gen.send(sent)
    except StopIteration as stop:
        return bool(stop.value), asked


def test_a_completion_that_landed_while_the_store_seemed_down_counts_as_written() -> None:
    """A Redis that stalled ran the timed-out completion after all: the retry finds the key
    completed under this request's own token. That is its record (replayed as such), not a
    take-over, and is no longer logged and counted as "fenced"."""
    from retrysafe import StoreUnavailableError
    from retrysafe.core import KeyRecord, KeyState

    def record(token: int, state: KeyState) -> KeyRecord:
        return KeyRecord("h" * 64, "fp", state, token, 0.0, 0.0)

    down = StoreUnavailableError("stalled")
    ours = record(7, KeyState.COMPLETED)
    assert _settled([down, False], ours) == (True, ["complete", "sleep", "complete", "get"])
    # Someone else's token, or still running: a real take-over.
    assert _settled([down, False], record(8, KeyState.COMPLETED))[0] is False
    assert _settled([down, False], record(7, KeyState.RUNNING))[0] is False
    assert _settled([down, False], None)[0] is False
    # No failed try before: a False is a take-over, with no extra read.
    assert _settled([False], ours) == (False, ["complete"])


def test_a_renewal_beside_a_pending_record_says_no_lease_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renewal that went out beside the background record finds the key completed once the
    record landed: no ``lease-lost`` ERROR then (the record says ``stored-late`` a moment
    later; helper-54 saw both lines for one key). Without a pending record it is said."""
    from retrysafe.server._engine import RequestState

    engine = IdempotencyMiddleware(_noop_app, store=MemoryStore())._engine
    caplog.set_level(logging.WARNING, logger="retrysafe.server")
    req = RequestState("POST", "/x", "k" * 64, "f" * 64, time.perf_counter())
    req.pending = ("complete", (req.key_hash, 1, None), {})
    engine.lease_lost(req)
    assert not _lost(req)
    assert [r for r in caplog.records if getattr(r, "decision", "") == "lease-lost"] == []
    req.pending = None
    engine.lease_lost(req)
    assert _lost(req)
    assert [getattr(r, "decision", "") for r in caplog.records] == ["lease-lost"]


def test_a_renewal_beside_the_record_says_no_lease_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once the response ended, its record tells what happened to the key: a renewal that
    went out just before it and found the key completed by it logs no ``lease-lost`` ERROR
    (helper-58: both lines for one stored key, PostgreSQL under load)."""
    from retrysafe.server._engine import Claimant, RequestState

    engine = IdempotencyMiddleware(_noop_app, store=MemoryStore())._engine
    caplog.set_level(logging.WARNING, logger="retrysafe.server")
    req = RequestState("POST", "/x", "k" * 64, "f" * 64, time.perf_counter())
    claimant = Claimant(engine, MemoryStore(), req, None)
    claimant.end()
    claimant.lease_lost()
    assert [r for r in caplog.records if getattr(r, "decision", "") == "lease-lost"] == []
    claimant.finalized = False  # still running: a real take-over, said loudly
    claimant.lease_lost()
    assert [getattr(r, "decision", "") for r in caplog.records] == ["lease-lost"]


async def _noop_app(scope: Any, receive: Any, send: Any) -> None:
    return None


def _lost(req: Any) -> bool:
    return bool(req.lost)  # read afresh (a narrowed attribute would stay narrowed for mypy)
