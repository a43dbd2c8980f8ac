"""SQLite-specific behaviour: processes sharing a file, bad files, schema versions, recovering
from a file that was read-only."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from _readonly import ReadOnly
from retrysafe import (
    ConfigurationError,
    JobState,
    Outbox,
    RetrysafeError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.client import outbox_store
from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores import AsyncKeyStore, SQLiteStore, open_store
from retrysafe.stores._sqlite import AsyncSQLiteConnector, SQLiteConnector

H = "b" * 64


def _claim_in_process(path: str, barrier: object, out: object) -> None:
    store = SQLiteStore(path, busy_timeout=30)
    barrier.wait()  # type: ignore[attr-defined]
    claimed, _ = store.claim(H, "fp", now=1.0, lease=10, retention=100)
    out.put(claimed)  # type: ignore[attr-defined]
    store.close()


def test_processes_sharing_a_file_have_one_winner(tmp_path: Path) -> None:
    """Eight processes claiming one key in one SQLite file: exactly one wins."""
    path = str(tmp_path / "shared.db")
    SQLiteStore(path).close()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(8)
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(path, barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results.count(True) == 1


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A path in a directory that does not exist fails at startup, naming the directory."""
    with pytest.raises(ConfigurationError, match="does not exist"):
        SQLiteStore(tmp_path / "nope" / "keys.db")


def test_read_only_connection_is_unavailable(tmp_path: Path) -> None:
    """A database that refuses writes surfaces as StoreUnavailableError (→ 503)."""
    path = tmp_path / "ro.db"
    SQLiteStore(path).close()
    store = SQLiteStore(path)
    store.run(lambda c: c.execute("PRAGMA query_only=ON"))
    with pytest.raises(StoreUnavailableError):
        store.claim(H, "fp", now=1.0, lease=1, retention=1)
    store.run(lambda c: c.execute("PRAGMA query_only=OFF"))
    assert store.claim(H, "fp", now=1.0, lease=1, retention=1)[0]


def test_locked_file_is_unavailable(tmp_path: Path) -> None:
    """Another connection holding the write lock makes a write fail fast as unavailable."""
    path = tmp_path / "locked.db"
    store = SQLiteStore(path, busy_timeout=0.05)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailableError):
            store.claim(H, "fp", now=1.0, lease=1, retention=1)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.claim(H, "fp", now=1.0, lease=1, retention=1)[0]


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file written by a newer retrysafe is refused with a SchemaError."""
    path = tmp_path / "new.db"
    SQLiteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE retrysafe_meta SET value='999' WHERE name='schema_version'")
    with pytest.raises(SchemaError, match="999"):
        SQLiteStore(path)


def test_missing_schema_without_create_is_refused(tmp_path: Path) -> None:
    """create=False on an empty file names the migrate command."""
    with pytest.raises(SchemaError, match="migrate"):
        SQLiteStore(tmp_path / "empty.db", create=False)


def test_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    """A file that is not SQLite fails at startup with a retrysafe error, not a traceback."""
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(RetrysafeError, match="not a database"):
        SQLiteStore(path)


@pytest.mark.parametrize(
    "url", ["keys.db", "sqlite://keys.db", "sqlite:///", "mysql://x/y", 42]
)
def test_bad_store_urls_are_clear_errors(url: object) -> None:
    """Malformed or unsupported URLs raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        open_store(url)  # type: ignore[arg-type]


def test_sqlite_url_opens_a_file(tmp_path: Path) -> None:
    """sqlite:////abs/path.db opens that file."""
    store = open_store(f"sqlite:///{tmp_path}/via-url.db")
    assert isinstance(store, SQLiteStore)
    assert (tmp_path / "via-url.db").exists()
    store.close()


def _pragmas(conn: sqlite3.Connection) -> tuple[int, ...]:
    return tuple(
        conn.execute(f"PRAGMA {name}").fetchone()[0]
        for name in ("temp_store", "journal_size_limit", "wal_autocheckpoint")
    )


@pytest.mark.anyio
async def test_writing_connections_keep_journals_in_memory_and_trim_the_wal(
    tmp_path: Path,
) -> None:
    """Statement journals in memory (temp_store=2) and the WAL trimmed to 64 MiB after a
    checkpoint, on the sync face's connections and the async face's inline one; both keep
    SQLite's checkpoint at 1,000 pages (a larger one filled small volumes)."""
    from retrysafe.stores._sqlite import WAL_SIZE_LIMIT

    assert WAL_SIZE_LIMIT == 64 * 1024 * 1024
    store = SQLiteStore(tmp_path / "pragmas.db")
    try:
        assert store.run(_pragmas) == (2, WAL_SIZE_LIMIT, 1000)
        keys = store.asyncio_key_store()
        await keys.claim("c" * 64, "fp", now=1.0, lease=10, retention=100)
        assert _pragmas(_inline(keys)) == (2, WAL_SIZE_LIMIT, 1000)
    finally:
        store.close()


# ---------------------------------------------------------------------- group commit
def _traced(store: SQLiteStore) -> tuple[AsyncKeyStore, list[str]]:
    """The async face, and the list of statements its inline connection runs."""
    seen: list[str] = []
    keys = store.asyncio_key_store()
    _inline(keys).set_trace_callback(seen.append)
    return keys, seen


@pytest.mark.anyio
async def test_operations_issued_together_commit_together(tmp_path: Path) -> None:
    """Operations issued in one event-loop iteration run in one transaction, and each gets
    its own result only once that transaction committed."""
    store = SQLiteStore(tmp_path / "gc.db")
    keys, seen = _traced(store)
    results = await asyncio.gather(
        *(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100) for i in range(8))
    )
    assert all(claimed for claimed, _ in results)
    assert [s for s in seen if s in ("BEGIN IMMEDIATE", "COMMIT")] == ["BEGIN IMMEDIATE", "COMMIT"]
    with sqlite3.connect(tmp_path / "gc.db") as other:  # durable: another connection sees them
        assert other.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone() == (8,)
    store.close()


@pytest.mark.anyio
async def test_a_failing_statement_fails_only_its_own_operation(tmp_path: Path) -> None:
    """A statement error inside a batch (a NOT NULL violation) fails that operation alone;
    the others of the batch commit."""
    store = SQLiteStore(tmp_path / "gc.db")
    keys, seen = _traced(store)
    results = await asyncio.gather(
        keys.claim("1" * 64, "fp", now=1.0, lease=10, retention=100),
        keys.claim("2" * 64, None, now=1.0, lease=10, retention=100),  # type: ignore[arg-type]
        keys.claim("3" * 64, "fp", now=1.0, lease=10, retention=100),
        return_exceptions=True,
    )
    assert isinstance(results[1], StoreError)
    assert not isinstance(results[1], StoreUnavailableError)
    assert isinstance(results[1].__cause__, sqlite3.IntegrityError)
    assert results[0][0] and results[2][0]  # type: ignore[index]
    assert seen.count("BEGIN IMMEDIATE") == 1 and seen.count("COMMIT") == 1
    assert store.get("1" * 64) is not None and store.get("3" * 64) is not None
    assert store.get("2" * 64) is None
    store.close()


@pytest.mark.anyio
async def test_an_operation_raising_a_python_error_fails_alone(tmp_path: Path) -> None:
    """An operation that raises a non-SQLite error rolls its batch back; the batch's other
    operations then run one by one and succeed, and no transaction is left open."""
    store = SQLiteStore(tmp_path / "gc.db")
    keys = store.asyncio_key_store()
    _, a = await keys.claim("1" * 64, "fp", now=1.0, lease=10, retention=100)
    _, b = await keys.claim("2" * 64, "fp", now=1.0, lease=10, retention=100)
    bad = StoredResponse(201, (("x-odd", object()),), b"")  # type: ignore[arg-type]
    good = StoredResponse(201, (), b"ok")
    results = await asyncio.gather(
        keys.complete("1" * 64, a.fencing_token, bad, now=1.0, retention=100),
        keys.complete("2" * 64, b.fencing_token, good, now=1.0, retention=100),
        keys.claim("3" * 64, "fp", now=1.0, lease=10, retention=100),
        return_exceptions=True,
    )
    assert isinstance(results[0], TypeError)
    assert results[1] is True and results[2][0]
    first, second = store.get("1" * 64), store.get("2" * 64)
    assert first is not None and first.state is KeyState.RUNNING
    assert second is not None and second.response == good
    assert not _inline(keys).in_transaction
    store.close()


@pytest.mark.anyio
async def test_batch_waits_without_blocking_the_loop_while_another_process_writes(
    tmp_path: Path,
) -> None:
    """While another connection holds ``BEGIN EXCLUSIVE`` the batch waits (the event loop
    keeps running) and commits once the lock is free."""
    path = tmp_path / "gc.db"
    store = SQLiteStore(path, busy_timeout=5)
    keys = store.asyncio_key_store()
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    claims = asyncio.gather(
        *(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100) for i in range(4))
    )
    await asyncio.sleep(0.2)
    assert not claims.done() and ticks >= 5
    holder.execute("COMMIT")
    results = await claims
    ticker.cancel()
    assert all(claimed for claimed, _ in results)
    assert not _inline(keys).in_transaction
    holder.close()
    store.close()


@pytest.mark.anyio
async def test_batch_fails_as_unavailable_when_the_lock_stays(tmp_path: Path) -> None:
    """A write lock held past busy_timeout fails every operation of the batch with
    StoreUnavailableError; nothing is left open and the store works once it is free."""
    path = tmp_path / "gc.db"
    store = SQLiteStore(path, busy_timeout=0.05)
    keys = store.asyncio_key_store()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    results = await asyncio.gather(
        *(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100) for i in range(3)),
        return_exceptions=True,
    )
    assert all(isinstance(r, StoreUnavailableError) for r in results)
    holder.execute("ROLLBACK")
    holder.close()
    assert (await keys.claim("0" * 64, "fp", now=1.0, lease=10, retention=100))[0]
    store.close()


@pytest.mark.anyio
@pytest.mark.parametrize("freed", [True, False])
async def test_operations_that_meet_the_lock_wait_behind_one_batch(
    tmp_path: Path, freed: bool
) -> None:
    """A fresh user's check: 20 requests to a SQLite store locked by another process got
    their 503s at 6, 11, 16 and 21 s — each batch waited out the whole busy_timeout on its
    own, in a default thread pool of six. Now one batch waits; the 19 that meet
    the lock meanwhile (each in a loop iteration of its own) wait with it: they all run
    once the lock is free, or all fail with it when it outlasts the timeout — one
    wait either way."""
    path = tmp_path / "gc.db"
    store = SQLiteStore(path, busy_timeout=0.5 if freed else 0.3)
    keys = store.asyncio_key_store()
    waits = _lock_waits(keys)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    claims = []
    for i in range(20):
        claims.append(
            asyncio.ensure_future(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100))
        )
        await asyncio.sleep(0.002)  # a batch each
    if freed:
        await asyncio.sleep(0.05)
        holder.execute("COMMIT")
    results = await asyncio.gather(*claims, return_exceptions=True)
    if not freed:
        holder.execute("ROLLBACK")
    holder.close()
    if freed:
        assert all(not isinstance(r, BaseException) and r[0] for r in results), results
    else:
        assert all(isinstance(r, StoreUnavailableError) for r in results), results
    assert len(waits) == 1
    store.close()


@pytest.mark.anyio
async def test_a_read_is_not_held_up_by_another_process_writing(tmp_path: Path) -> None:
    """A look-up (a replay's) batched with a claim while another process holds the write
    lock answers at once (WAL readers never wait for the writer); it waited out the whole
    busy_timeout with the claim, as writes must."""
    path = tmp_path / "gc.db"
    store = SQLiteStore(path, busy_timeout=30)
    keys = store.asyncio_key_store()
    await keys.claim("a" * 64, "fp", now=1.0, lease=10, retention=100)
    waits = _lock_waits(keys)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        # One batch: the look-up and a claim, which must wait for the lock.
        look = asyncio.ensure_future(keys.get("a" * 64))
        claim = asyncio.ensure_future(
            keys.claim("b" * 64, "fp", now=1.0, lease=10, retention=100)
        )
        await asyncio.wait({look}, timeout=5)
        assert look.done() and not claim.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    record = look.result()
    assert record is not None and record.fingerprint == "fp"
    assert (await claim)[0]
    assert len(waits) == 1  # the claim's
    store.close()


@pytest.mark.anyio
async def test_a_claim_a_read_can_answer_is_not_held_up_by_another_process_writing(
    tmp_path: Path,
) -> None:
    """A claim of a key that is there and unexpired — completed (a replay), running with its
    lease (in progress), or running with its lease over (to take over) — returns the record
    at once while another process holds the write lock: it is read, and only a claim that
    must write waits (it waited out the whole busy_timeout behind a transactional handler's
    lock, then the middleware read the record anyway). A key that is absent or expired waits
    for the lock and is claimed once it is free."""
    path = tmp_path / "gc.db"
    store = SQLiteStore(path, busy_timeout=30)
    keys = store.asyncio_key_store()
    _, done = await keys.claim("a" * 64, "fp", now=1.0, lease=10, retention=100)
    answer = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')
    assert await keys.complete("a" * 64, done.fencing_token, answer, now=1.0, retention=100)
    await keys.claim("b" * 64, "fp", now=1.0, lease=1000, retention=2000)  # running
    await keys.claim("c" * 64, "fp", now=1.0, lease=2, retention=2000)  # lease over at 50
    await keys.claim("d" * 64, "fp", now=1.0, lease=2, retention=10)  # expired at 50
    waits = _lock_waits(keys)
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        claims = {
            name: asyncio.ensure_future(
                keys.claim(name * 64, "fp", now=50.0, lease=10, retention=100)
            )
            for name in "abcde"
        }
        await asyncio.wait({claims[n] for n in "abc"}, timeout=10)
        assert [n for n in "abcde" if claims[n].done()] == ["a", "b", "c"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    replay = claims["a"].result()
    assert replay[0] is False and replay[1].response == answer
    assert claims["b"].result()[0] is False
    assert claims["b"].result()[1].state is KeyState.RUNNING
    taken = claims["c"].result()
    assert taken[0] is False and taken[1].lease_expires_at == 3.0  # the caller takes it over
    assert (await claims["d"])[0] and (await claims["e"])[0]  # claimed once the lock freed
    assert len(waits) == 1  # the two claims that had to write, waiting together
    store.close()


@pytest.mark.anyio
async def test_a_cancelled_claim_is_not_run_but_a_cancelled_completion_is(
    tmp_path: Path,
) -> None:
    """A claim whose caller was cancelled before the batch ran claims nothing; a completion
    whose caller was cancelled is still written (the handler's effect happened)."""
    store = SQLiteStore(tmp_path / "gc.db")
    keys = store.asyncio_key_store()
    _, rec = await keys.claim("1" * 64, "fp", now=1.0, lease=10, retention=100)
    resp = StoredResponse(201, (), b"done")
    claim = asyncio.ensure_future(keys.claim("2" * 64, "fp", now=1.0, lease=10, retention=100))
    done = asyncio.ensure_future(
        keys.complete("1" * 64, rec.fencing_token, resp, now=1.0, retention=100)
    )
    await asyncio.sleep(0)  # both submitted, the batch not yet run
    claim.cancel()
    done.cancel()
    await asyncio.sleep(0.01)
    assert store.get("2" * 64) is None
    completed = store.get("1" * 64)
    assert completed is not None and completed.response == resp
    store.close()


def _lock_waits(keys: Any) -> list[int]:
    """A list that gets an item each time the async face starts waiting for another
    process's write lock with a batch (the operations that meet the lock meanwhile wait
    with it)."""
    connector = keys.connector
    assert isinstance(connector, AsyncSQLiteConnector)
    waits: list[int] = []
    real = connector._batch_waiting

    def counted(batch: Any) -> Any:
        waits.append(1)
        return real(batch)

    connector._batch_waiting = counted  # type: ignore[method-assign]
    return waits


def _inline(keys: Any) -> sqlite3.Connection:
    """The async face's loop-thread connection (the group-commit batches run on it)."""
    connector = keys.connector
    assert isinstance(connector, AsyncSQLiteConnector)
    return connector._inline_conn().conn


# ---------------------------------------------------------------------- recovering by itself
# A store that was unusable is used again by its next operation once it is usable: no
# connection opened or failed while the file could not be written is kept (issue 11).
DONE = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}', True)
H_DONE = "d" * 64


@pytest.fixture
def ro_path(tmp_path: Path) -> Path:
    """A store file (in a directory of its own) holding the completed key ``H_DONE``, closed."""
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "keys.db"
    with SQLiteStore(path) as store:
        _, record = store.claim(H_DONE, "fp", now=1.0, lease=10, retention=1e9)
        assert store.complete(H_DONE, record.fencing_token, DONE, now=1.0, retention=1e9)
    return path


def _claim(store: SQLiteStore) -> bool:
    return store.claim(H, "fp", now=1.0, lease=10, retention=100)[0]


def test_a_store_read_only_when_first_used_writes_once_the_file_is_writable(
    ro_path: Path,
) -> None:
    """Opened while its file is read-only: writes are unavailable, reads are served, and the
    first write after the file became writable succeeds on the same store object."""
    with ReadOnly(ro_path) as ro:
        store = SQLiteStore(ro_path)
        with pytest.raises(StoreUnavailableError, match="readonly"):
            _claim(store)
        done = store.get(H_DONE)
        assert done is not None and done.response == DONE
        ro.restore()
        assert _claim(store)
    store.close()


def test_a_thread_that_connected_while_the_store_was_read_only_writes_again(
    ro_path: Path,
) -> None:
    """A store in use whose file and directory become read-only: a thread that opens its
    connection then fails to write, and its next write once they are writable succeeds."""
    store = SQLiteStore(ro_path)
    assert store.get(H_DONE) is not None  # this thread's connection holds the WAL open
    with ThreadPoolExecutor(max_workers=1) as thread, ReadOnly(ro_path, ro_path.parent) as ro:
        with pytest.raises(StoreUnavailableError, match="readonly"):
            thread.submit(_claim, store).result()
        assert thread.submit(store.get, H_DONE).result() is not None
        ro.restore()
        assert thread.submit(_claim, store).result()
    store.close()


def test_a_read_only_connection_not_seen_at_opening_is_replaced_after_a_failed_write(
    ro_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection SQLite opened read-only although the file looked writable (it changed in
    between) is closed by its first failed write: the write after that opens a new one."""
    monkeypatch.setattr(SQLiteConnector, "_file_writable", lambda self: True)
    with ReadOnly(ro_path) as ro:
        store = SQLiteStore(ro_path)
        with pytest.raises(StoreUnavailableError, match="readonly"):
            _claim(store)
        ro.restore()
        assert _claim(store)
    store.close()


@pytest.mark.anyio
async def test_the_async_key_face_read_only_when_first_used_recovers(ro_path: Path) -> None:
    """The middleware's async face on a store read-only when first used: claims (alone and
    batched) are unavailable, reads are served, and the next claims once the file is writable
    succeed on the same face."""
    with ReadOnly(ro_path) as ro:
        store = SQLiteStore(ro_path)
        keys = store.asyncio_key_store()
        with pytest.raises(StoreUnavailableError, match="readonly"):
            await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
        batch = await asyncio.gather(
            *(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100) for i in range(4)),
            return_exceptions=True,
        )
        assert all(isinstance(r, StoreUnavailableError) for r in batch)
        done = await keys.get(H_DONE)
        assert done is not None and done.response == DONE
        ro.restore()
        claimed, _ = await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
        assert claimed
        batch = await asyncio.gather(
            *(keys.claim(f"{i:064x}", "fp", now=1.0, lease=10, retention=100) for i in range(4))
        )
        assert all(claimed for claimed, _ in batch)
    await keys.aclose()
    store.close()


@pytest.mark.anyio
async def test_the_async_face_replaces_a_read_only_connection_after_a_failed_write(
    ro_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async face's own connection, opened read-only unnoticed, is closed by its first
    failed write; the next claim opens a new one."""
    monkeypatch.setattr(SQLiteConnector, "_file_writable", lambda self: True)
    with ReadOnly(ro_path) as ro:
        store = SQLiteStore(ro_path)
        keys = store.asyncio_key_store()
        with pytest.raises(StoreUnavailableError, match="readonly"):
            await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
        ro.restore()
        claimed, _ = await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
        assert claimed
    await keys.aclose()
    store.close()


@pytest.mark.anyio
async def test_the_async_outbox_face_read_only_when_first_used_recovers(ro_path: Path) -> None:
    """The worker's async outbox face on a store read-only when first used: claiming jobs is
    unavailable, counting them is served, and the next claim once the file is writable gets
    the job."""
    with SQLiteStore(ro_path) as setup:
        job = Outbox(setup).submit("http://127.0.0.1:9/x", json={})
    with ReadOnly(ro_path) as ro:
        store = SQLiteStore(ro_path)
        jobs = outbox_store(store).asyncio_outbox_store()

        async def claim() -> list[Any]:
            return list(
                await jobs.claim_jobs(
                    queue="default", token="t", now=time.time(), lease=10, limit=1
                )
            )

        with pytest.raises(StoreUnavailableError, match="readonly"):
            await claim()
        assert (await jobs.count_jobs(queue="default"))[JobState.PENDING] == 1
        ro.restore()
        assert [j.id for j in await claim()] == [job.id]
    await jobs.aclose()
    store.close()


def test_a_read_only_store_read_as_immutable_sees_writes_once_its_directory_is_writable(
    ro_path: Path,
) -> None:
    """readonly=True in a read-only directory reads the file as immutable; once the directory
    is writable, it sees what another process writes (it does not keep the immutable view)."""
    with ReadOnly(ro_path, ro_path.parent) as ro:
        reader = SQLiteStore(ro_path, readonly=True)
        assert reader.get(H) is None
        ro.restore()
    with SQLiteStore(ro_path) as writer:
        assert _claim(writer)
        record = reader.get(H)
    assert record is not None and record.state is KeyState.RUNNING
    reader.close()


@pytest.fixture
def check_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare a connection's file with the store's path on every use (not once a second)."""
    import retrysafe.stores._sqlite as sqlite_mod

    monkeypatch.setattr(sqlite_mod, "_REPLACED_EVERY", 0.0)


def _remove_store_files(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)


@pytest.mark.usefixtures("check_every_time")
def test_a_deleted_file_is_unavailable_not_written_unseen(tmp_path: Path) -> None:
    """An open connection keeps the unlinked file: without the check, a long-running process
    (the console, a worker) went on recording into a file no other process can see. Now the
    next operation opens the path anew: unavailable, and nothing is re-created."""
    path = tmp_path / "store.db"
    store = SQLiteStore(path)
    jobs = outbox_store(store)
    assert sum(jobs.count_jobs(queue="default").values()) == 0  # this thread's connection is open
    _remove_store_files(path)
    with pytest.raises(StoreUnavailableError, match="unable to open"):
        jobs.count_jobs(queue="default")
    assert not path.exists()
    store.close()


@pytest.mark.anyio
@pytest.mark.usefixtures("check_every_time")
async def test_the_async_face_notices_a_deleted_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = SQLiteStore(path)
    jobs = outbox_store(store).asyncio_outbox_store()
    assert sum((await jobs.count_jobs(queue="default")).values()) == 0
    _remove_store_files(path)
    with pytest.raises(StoreUnavailableError):
        await jobs.count_jobs(queue="default")
    assert not path.exists()
    await jobs.aclose()
    store.close()


@pytest.mark.usefixtures("check_every_time")
def test_a_file_replaced_under_a_running_process_is_read_anew(tmp_path: Path) -> None:
    """A backup restored over the path (``mv``): the next operation reads the new file."""
    path, other = tmp_path / "store.db", tmp_path / "restored.db"
    with SQLiteStore(other) as restored:
        Outbox(restored).submit("http://127.0.0.1:9/x", json={})
    store = SQLiteStore(path)
    jobs = outbox_store(store)
    assert sum(jobs.count_jobs(queue="default").values()) == 0
    _remove_store_files(path)
    other.rename(path)
    assert sum(jobs.count_jobs(queue="default").values()) == 1
    store.close()


def test_the_file_is_compared_at_most_once_a_second(tmp_path: Path) -> None:
    """The check is a stat per connection per second, not per operation (the hot path)."""
    path = tmp_path / "store.db"
    store = SQLiteStore(path)
    jobs = outbox_store(store)
    assert sum(jobs.count_jobs(queue="default").values()) == 0
    _remove_store_files(path)
    # Within the second: the open connection, on the unlinked file.
    assert sum(jobs.count_jobs(queue="default").values()) == 0
    time.sleep(1.05)
    with pytest.raises(StoreUnavailableError):
        jobs.count_jobs(queue="default")
    store.close()


@pytest.mark.parametrize("kind", ["empty", "other-app"])
def test_a_refused_file_is_left_exactly_as_it_was(tmp_path: Path, kind: str) -> None:
    """``retrysafe jobs list --store sqlite:///wrong.db`` on an empty file or another
    application's database: refused, and the file keeps its bytes and journal mode (the
    first writable connection used to switch it to WAL before the schema check)."""
    path = tmp_path / "wrong.db"
    if kind == "empty":
        path.touch()
    else:
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    before = path.read_bytes()
    with pytest.raises(SchemaError, match="no retrysafe schema"):
        SQLiteStore(path, create=False)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrong.db"]  # no -wal, no -shm


def test_one_index_finds_due_jobs_and_expired_leases(tmp_path: Path) -> None:
    """A new store has no index on lease_expires_at (a leased job's due_at is its lease's
    end), and every branch of the claim (due, expired lease, a due time that is no number)
    walks outbox_jobs_due: a claim or a finish moves one index entry per job, and no claim
    scans the table."""
    from retrysafe.client._store import _SQL

    with SQLiteStore(tmp_path / "s.db") as store:
        Outbox(store).submit("http://example.test/x", json={})
    conn = sqlite3.connect(tmp_path / "s.db")
    try:
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert "outbox_jobs_due" in indexes and "outbox_jobs_lease" not in indexes
        [claim] = _SQL["claim_jobs"].parts["sqlite"]
        plans = []
        for skip in (None, '["http://a.test:80"]'):  # a destination at its limit or none
            params = {"queue": "default", "token": "t", "now": 1.0, "lease": 1.0, "limit": 8}
            params["skip"], params["only"] = skip, None
            plans.append([r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + claim, params)])
    finally:
        conn.close()
    for plan in plans:
        assert sum("USING INDEX outbox_jobs_due" in step for step in plan) == 3, plan
        assert not any(step.startswith("SCAN outbox_jobs") for step in plan), plan


_CLOSE_DURING_USE = r"""
import sys, threading, time
from retrysafe import StoreError
from retrysafe.stores import SQLiteStore

out = []
for round in range(20):
    store = SQLiteStore(f"{sys.argv[1]}/c{round}.db")
    inside = threading.Event()

    def statements(conn):
        inside.set()
        conn.execute("CREATE TABLE t (x)")
        for i in range(3000):
            conn.execute("INSERT INTO t VALUES (?)", (i,))
            conn.execute("SELECT count(*) FROM t").fetchone()
        return conn.execute("SELECT count(*) FROM t").fetchone()[0]

    def user():
        out.append(store.run(statements))

    t = threading.Thread(target=user)
    t.start()
    inside.wait(10)
    time.sleep(0.002)  # mid-way through the statements
    store.close()
    t.join(60)
    try:
        store.run(lambda conn: conn.execute("SELECT 1").fetchone())
    except StoreError as exc:
        out.append(type(exc).__name__)
print(sorted(set(out), key=str), len(out))
"""


def test_closing_the_store_while_a_thread_uses_it_waits_for_that_use(tmp_path: Path) -> None:
    """close() never closes a connection another thread is running statements on (sqlite3
    frees its statements: the process would crash, as a heartbeat renewal still in flight at
    close did); that use finishes, and its connection closes as it ends."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_DURING_USE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[3000, 'StoreError'] 40"
