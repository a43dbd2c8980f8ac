"""The embedded default store: one SQLite file in WAL mode (SPEC §9).

Safe for many threads and many processes on one host: every claim is a single
``INSERT … ON CONFLICT … RETURNING`` statement and every fenced write a single ``UPDATE``
guarded by the fencing token (``release`` too: it leaves a tombstone, see
:class:`~retrysafe.stores.KeyStore`), so SQLite's write lock makes each of them atomic.
Each thread gets its own connection. All SQL lives in ``sql/sqlite.sql``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from retrysafe._exceptions import (
    ConfigurationError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._sql import queries
from retrysafe.stores._sqlite_agents import SQLiteAgentsMixin
from retrysafe.stores._sqlite_outbox import SQLiteOutboxMixin
from retrysafe.stores._sqlite_webhooks import SQLiteWebhooksMixin

__all__ = ["SCHEMA_VERSION", "SQLiteEffect", "SQLiteStore"]

#: The schema version this release writes and understands.
SCHEMA_VERSION = 1

_T = TypeVar("_T")
_Q = queries("sqlite")

# Messages of sqlite3.OperationalError that mean "cannot serve now" rather than "a bug".
_UNAVAILABLE = (
    "locked",
    "busy",
    "readonly",
    "read-only",
    "unable to open",
    "disk i/o",
    "disk is full",
    "database or disk is full",
)


def _translate(exc: sqlite3.Error, store: str) -> StoreError:
    msg = str(exc)
    low = msg.lower()
    if isinstance(exc, sqlite3.OperationalError) and any(s in low for s in _UNAVAILABLE):
        return StoreUnavailableError(f"SQLite store {store} unavailable: {msg}", store=store)
    if isinstance(exc, sqlite3.OperationalError) and "no such table" in low:
        return SchemaError(
            f"SQLite store {store} has no retrysafe schema: {msg} "
            "(run `retrysafe migrate --store URL`)",
            store=store,
        )
    return StoreError(f"SQLite store {store} failed: {msg}", store=store)


_RUNNING = KeyState.RUNNING
_STATES = {state.value: state for state in KeyState}


def _row_to_record(row: tuple[Any, ...]) -> KeyRecord:
    (key_hash, fp, state, token, lease_exp, exp, status, headers, body, replayable) = row
    response = None
    if state == KeyState.COMPLETED.value and status is not None:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(headers or "[]"))
        response = StoredResponse(int(status), pairs, bytes(body or b""), bool(replayable))
    return KeyRecord(
        key_hash=key_hash,
        fingerprint=fp,
        state=_STATES[state],
        fencing_token=int(token),
        lease_expires_at=float(lease_exp),
        expires_at=float(exp),
        response=response,
    )


class SQLiteStore(SQLiteOutboxMixin, SQLiteWebhooksMixin, SQLiteAgentsMixin):
    """SQLite-backed :class:`~retrysafe.stores.KeyStore` (and the outbox's store).

    Args:
        path: the database file. Its directory must exist; the file is created with the schema
            on first use. ``":memory:"`` gives a private per-connection database (tests only).
        busy_timeout: seconds a write waits for another process's write lock before failing
            with :class:`~retrysafe.StoreUnavailableError` (default 5 s).
        create: create the schema if missing (default True); with False a missing schema raises
            :class:`~retrysafe.SchemaError`.
        readonly: open the existing file read-only (``mode=ro``): never creates or writes it,
            and works on a file or directory the process may not write (a read-only
            directory without a WAL file is read as immutable). Writes raise
            :class:`~retrysafe.StoreUnavailableError` ("readonly").

    Raises:
        ConfigurationError: the directory does not exist, ``busy_timeout`` < 0, or
            ``readonly`` and the file does not exist.
        SchemaError: the file holds a schema from a newer retrysafe.
        StoreUnavailableError: the file cannot be opened (permissions, locked).
    """

    dialect = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        create: bool = True,
        readonly: bool = False,
    ) -> None:
        if busy_timeout < 0:
            raise ConfigurationError("busy_timeout must be >= 0 seconds", option="busy_timeout")
        self.path = str(path)
        if self.path != ":memory:":
            parent = Path(self.path).expanduser().resolve().parent
            if not parent.is_dir():
                raise ConfigurationError(
                    f"cannot open SQLite store {self.path!r}: directory {str(parent)!r} "
                    "does not exist",
                    option="store",
                )
            if readonly and not Path(self.path).expanduser().exists():
                raise ConfigurationError(f"no SQLite store at {self.path!r}", option="store")
        self.busy_timeout = busy_timeout
        self.readonly = readonly
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._closed = False
        self._ensure_schema(create and not readonly)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    # ------------------------------------------------------------------ connections
    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        try:
            if self.readonly:
                return self._connect_readonly(busy_timeout)
            conn = sqlite3.connect(
                self.path,
                timeout=busy_timeout,
                isolation_level=None,  # autocommit: each statement is its own transaction
                check_same_thread=False,
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            raise _translate(exc, self.url) from exc
        return conn

    def _connect_readonly(self, busy_timeout: float) -> sqlite3.Connection:
        file = str(Path(self.path).expanduser().resolve())
        uri = "file:" + quote(file) + "?mode=ro"

        def connect(uri: str) -> sqlite3.Connection:
            return sqlite3.connect(
                uri, uri=True, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )

        conn = connect(uri)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError as exc:
            # A read-only directory (or file system) cannot hold the WAL index. With no WAL
            # file there is nothing to miss: read the database file as immutable.
            low = str(exc).lower()
            conn.close()
            if os.path.exists(file + "-wal") or not ("open" in low or "readonly" in low):
                raise
            conn = connect(uri + "&immutable=1")
        return conn

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        holder: _Conn | None = getattr(self._local, "conn", None)
        if holder is None:
            holder = _Conn(self._connect(self.busy_timeout))
            self._local.conn = holder
            with self._lock:
                self._connections.add(holder)
        return holder.conn

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise _translate(exc, self.url) from exc

    def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(connection)`` on this thread's connection, translating driver errors."""
        with self._errors():
            return fn(self._conn())

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` on this thread's connection (rollback on error).

        Applications use it to commit their own rows and a retrysafe write together
        (transactional outbox, SPEC §4 transactional mode).
        """
        conn = self._conn()
        with self._errors():
            conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            with self._errors():
                conn.execute("ROLLBACK")
            raise
        with self._errors():
            conn.execute("COMMIT")

    def _ensure_schema(self, create: bool) -> None:
        def check(conn: sqlite3.Connection) -> None:
            try:
                row = conn.execute(_Q["get_schema_version"]).fetchone()
            except sqlite3.OperationalError as exc:
                if "no such table" not in str(exc):
                    raise
                row = None
            if row is not None:
                version = int(row[0])
                if version > SCHEMA_VERSION:
                    raise SchemaError(
                        f"SQLite store {self.url} has schema version {version}; this retrysafe "
                        f"understands up to {SCHEMA_VERSION}. Upgrade retrysafe.",
                        store=self.url,
                    )
                if version == SCHEMA_VERSION:
                    return
            if not create:
                raise SchemaError(
                    f"SQLite store {self.url} has no retrysafe schema "
                    "(run `retrysafe migrate --store URL`)",
                    store=self.url,
                )
            conn.execute("BEGIN IMMEDIATE")
            try:
                for stmt in _split(_Q["schema"]):
                    conn.execute(stmt)
                conn.execute(_Q["set_schema_version"], {"version": str(SCHEMA_VERSION)})
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        self.run(check)

    def close(self) -> None:
        """Close every connection this store opened. Idempotent."""
        with self._lock:
            self._closed = True
            for holder in list(self._connections):
                holder.close()
            self._connections.clear()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ KeyStore
    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        return self.run(lambda c: _claim(c, key_hash, fingerprint, now, lease, retention))

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        return self.run(lambda c: _take_over(c, key_hash, fencing_token, now, lease))

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        return self.run(lambda c: _complete(c, key_hash, fencing_token, response, now, retention))

    def release(self, key_hash: str, fencing_token: int) -> bool:
        return self.run(lambda c: _release(c, key_hash, fencing_token))

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        return self.run(lambda c: _extend(c, key_hash, fencing_token, now, lease))

    def get(self, key_hash: str) -> KeyRecord | None:
        return self.run(lambda c: _get(c, key_hash))

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        total = 0
        while True:
            n = self.run(
                lambda c: c.execute(_Q["purge_keys"], {"now": now, "batch": batch}).rowcount
            )
            total += n
            if n < batch:
                return total

    def asyncio_key_store(self) -> _AsyncSQLiteKeys:
        """The :class:`~retrysafe.stores.AsyncKeyStore` face used by the ASGI middleware."""
        return _AsyncSQLiteKeys(self)

    def begin_effect(self) -> SQLiteEffect:
        """Open a transaction for a handler's own writes (SPEC §4 transactional mode).

        A dedicated connection (usable from any thread, access serialised) runs
        ``BEGIN IMMEDIATE``: it holds the database's write lock until :meth:`SQLiteEffect.commit`
        or :meth:`SQLiteEffect.rollback`, so other writers wait up to ``busy_timeout``.

        Raises:
            StoreUnavailableError: the write lock stayed taken for ``busy_timeout``.
            StoreError: the store is closed or the connection failed.
        """
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        conn = self._connect(self.busy_timeout)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            conn.close()
            raise _translate(exc, self.url) from exc
        return SQLiteEffect(conn, self.url)


class SQLiteEffect:
    """One open transaction holding a handler's effect and, at the end, the key's completion.

    Attributes:
        connection: the ``sqlite3`` connection (``isolation_level=None``, inside
            ``BEGIN IMMEDIATE``) the handler writes with. Never commit it yourself.
    """

    __slots__ = ("_done", "_lock", "_url", "connection")

    #: The open transaction holds the database's write lock: no other writer (a take-over
    #: included) can touch the key until it ends, so the middleware need not renew the lease.
    holds_write_lock = True

    def __init__(self, conn: sqlite3.Connection, url: str) -> None:
        self.connection = conn
        self._url = url
        self._lock = threading.Lock()
        self._done = False

    def complete_in(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        """Complete the key inside this transaction, fenced by the token (not yet committed).

        Returns:
            Whether the key was still ours (False: the lease was taken over).
        """
        with self._lock, _errors_for(self._url):
            return _complete(self.connection, key_hash, fencing_token, response, now, retention)

    def commit(self) -> None:
        """COMMIT the effect (and the completion) and close the connection."""
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                with _errors_for(self._url):
                    self.connection.execute("COMMIT")
            finally:
                self._close()

    def rollback(self) -> None:
        """ROLLBACK the effect and close the connection. Idempotent; never raises."""
        with self._lock:
            if self._done:
                return
            self._done = True
            with suppress(sqlite3.Error):
                if self.connection.in_transaction:
                    self.connection.execute("ROLLBACK")
            self._close()

    def _close(self) -> None:
        with suppress(sqlite3.Error):
            self.connection.close()


@contextmanager
def _errors_for(url: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise _translate(exc, url) from exc


class _Conn:
    """Holder so a WeakSet can track per-thread connections for close()."""

    __slots__ = ("__weakref__", "conn")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def close(self) -> None:
        with suppress(sqlite3.Error):
            self.conn.close()


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


# ---------------------------------------------------------------------- statements
# The key statements take numbered parameters, in the order sql/sqlite.sql lists above each.
def _claim(
    c: sqlite3.Connection,
    key_hash: str,
    fingerprint: str,
    now: float,
    lease: float,
    retention: float,
) -> tuple[bool, KeyRecord]:
    lease_expires_at = now + lease
    expires_at = now + max(retention, lease)
    params = (key_hash, fingerprint, lease_expires_at, expires_at, now)
    while True:
        row = c.execute(_Q["claim_key"], params).fetchone()
        if row is not None:
            # The row as claimed: exactly the values just written, and the new token.
            record = KeyRecord(
                key_hash, fingerprint, _RUNNING, int(row[0]), lease_expires_at, expires_at
            )
            return True, record
        existing = c.execute(_Q["get_key"], (key_hash,)).fetchone()
        if existing is not None:
            return False, _row_to_record(existing)
        # Purged between the two statements: claim again.


def _take_over(
    c: sqlite3.Connection, key_hash: str, token: int, now: float, lease: float
) -> KeyRecord | None:
    row = c.execute(_Q["take_over_key"], (key_hash, token, now + lease, now)).fetchone()
    return None if row is None else _row_to_record(row)


def _complete(
    c: sqlite3.Connection,
    key_hash: str,
    token: int,
    response: StoredResponse,
    now: float,
    retention: float,
) -> bool:
    cur = c.execute(
        _Q["complete_key"],
        (
            key_hash,
            token,
            response.status,
            json.dumps([list(p) for p in response.headers]),
            response.body,
            1 if response.replayable else 0,
            now + retention,
        ),
    )
    return cur.rowcount == 1


def _release(c: sqlite3.Connection, key_hash: str, token: int) -> bool:
    return c.execute(_Q["release_key"], (key_hash, token)).rowcount == 1


def _extend(c: sqlite3.Connection, key_hash: str, token: int, now: float, lease: float) -> bool:
    return c.execute(_Q["extend_key_lease"], (key_hash, token, now + lease)).rowcount == 1


def _get(c: sqlite3.Connection, key_hash: str) -> KeyRecord | None:
    row = c.execute(_Q["get_key"], (key_hash,)).fetchone()
    return None if row is None else _row_to_record(row)


_Op = Callable[[sqlite3.Connection], Any]
# One queued operation: the statement function, the future its caller awaits, and whether it
# may be skipped once that caller has gone (claims, take-overs and reads: nobody would use
# the result; skipping a claim avoids leaving a key running for nobody). Writes that finish
# or give up a claim always run.
_Queued = tuple[_Op, "asyncio.Future[Any]", bool]


def _is_busy(exc: sqlite3.Error) -> bool:
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    low = str(exc).lower()
    return "locked" in low or "busy" in low


def _run_batch(conn: sqlite3.Connection, fns: list[_Op]) -> list[tuple[bool, Any]]:
    """Run ``fns`` in order in one ``BEGIN IMMEDIATE`` … ``COMMIT`` (group commit).

    Returns one ``(ok, result or sqlite3.Error)`` per function. A statement error fails only
    its own operation: each operation writes with at most one statement, and SQLite undoes a
    failed statement while keeping the transaction. Nothing is returned before ``COMMIT``.

    Raises:
        Exception: ``BEGIN`` or ``COMMIT`` failed, SQLite rolled the whole transaction back,
            or an operation raised a non-SQLite error. The transaction is then rolled back:
            no operation of the batch took effect, and none is left open.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        outcomes: list[tuple[bool, Any]] = []
        for fn in fns:
            try:
                outcomes.append((True, fn(conn)))
            except sqlite3.Error as exc:
                if not conn.in_transaction:
                    raise  # SQLite rolled the transaction back: earlier results are void
                outcomes.append((False, exc))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    return outcomes


class _AsyncSQLiteKeys:
    """Async face of :class:`SQLiteStore` for the event loop, with group commit.

    Operations issued during one event-loop iteration are queued and run together, on the loop
    thread, in one ``BEGIN IMMEDIATE`` … ``COMMIT`` on a connection that never waits for a lock
    (``busy_timeout=0``): an uncontended SQLite write takes tens of microseconds, less than a
    hop to a worker thread, and one commit for many operations writes each page to the WAL
    once. Every operation gets its own result or error, and only after the ``COMMIT``, so a
    claim is never reported before it is durable. When another process holds the write lock
    the batch runs in a worker thread with the store's normal ``busy_timeout``, so the loop
    never blocks on it; when the batch cannot run as one transaction at all, its operations
    run one by one as separate statements. One event loop at a time uses an instance.
    """

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._inline: _Conn | None = None
        self._queue: list[_Queued] = []
        self._queue_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _inline_conn(self) -> sqlite3.Connection:
        if self._inline is None:
            self._inline = _Conn(self._store._connect(0.0))
            with self._store._lock:
                self._store._connections.add(self._inline)
        return self._inline.conn

    def _submit(self, fn: _Op, skippable: bool) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        if loop is not self._queue_loop:
            # A loop that stopped before flushing left its queue behind: nobody awaits it.
            self._queue = []
            self._queue_loop = loop
        fut = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((fn, fut, skippable))
        return fut

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        batch = [q for q in queue if not (q[2] and q[1].cancelled())]
        if not batch:
            return
        url = self._store.url
        try:
            conn = self._inline_conn()
        except StoreError as exc:
            for _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        if len(batch) == 1:
            fn, fut, _ = batch[0]
            try:
                result = fn(conn)
            except sqlite3.Error as exc:
                if _is_busy(exc):
                    self._spawn(self._one_by_one(batch, in_thread=True))
                else:
                    _deliver(fut, False, exc, url)
            except Exception as exc:  # a bug in the operation: its caller sees it
                _deliver(fut, False, exc, url)
            else:
                _deliver(fut, True, result, url)
            return
        try:
            outcomes = _run_batch(conn, [q[0] for q in batch])
        except sqlite3.Error as exc:
            if _is_busy(exc):
                self._spawn(self._batch_in_thread(batch))
            else:
                self._spawn(self._one_by_one(batch, in_thread=False))
            return
        except Exception:
            self._spawn(self._one_by_one(batch, in_thread=False))
            return
        for (_, fut, _), (ok, value) in zip(batch, outcomes, strict=True):
            _deliver(fut, ok, value, url)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _batch_in_thread(self, batch: list[_Queued]) -> None:
        fns = [q[0] for q in batch]
        try:
            outcomes = await asyncio.to_thread(self._store.run, lambda c: _run_batch(c, fns))
        except StoreUnavailableError as exc:
            # The write lock stayed taken for the whole busy_timeout: every operation would
            # wait as long again, so all of them fail now (callers answer 503).
            for _, fut, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        except Exception:
            await self._one_by_one(batch, in_thread=True)
            return
        url = self._store.url
        for (_, fut, _), (ok, value) in zip(batch, outcomes, strict=True):
            _deliver(fut, ok, value, url)

    async def _one_by_one(self, batch: list[_Queued], *, in_thread: bool) -> None:
        """Each operation as its own statement: inline first, in a thread when locked."""
        url = self._store.url
        for fn, fut, skippable in batch:
            if skippable and fut.cancelled():
                continue
            if not in_thread:
                try:
                    result = fn(self._inline_conn())
                except sqlite3.Error as exc:
                    if not _is_busy(exc):
                        _deliver(fut, False, exc, url)
                        continue
                except Exception as exc:
                    _deliver(fut, False, exc, url)
                    continue
                else:
                    _deliver(fut, True, result, url)
                    continue
            try:
                result = await asyncio.to_thread(self._store.run, fn)
            except Exception as exc:
                _deliver(fut, False, exc, url)
            else:
                _deliver(fut, True, result, url)

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        result: tuple[bool, KeyRecord] = await self._submit(
            lambda c: _claim(c, key_hash, fingerprint, now, lease, retention), True
        )
        return result

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        result: KeyRecord | None = await self._submit(
            lambda c: _take_over(c, key_hash, fencing_token, now, lease), True
        )
        return result

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        result: bool = await self._submit(
            lambda c: _complete(c, key_hash, fencing_token, response, now, retention), False
        )
        return result

    async def release(self, key_hash: str, fencing_token: int) -> bool:
        result: bool = await self._submit(lambda c: _release(c, key_hash, fencing_token), False)
        return result

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool:
        result: bool = await self._submit(
            lambda c: _extend(c, key_hash, fencing_token, now, lease), False
        )
        return result

    async def get(self, key_hash: str) -> KeyRecord | None:
        result: KeyRecord | None = await self._submit(lambda c: _get(c, key_hash), True)
        return result


def _deliver(fut: asyncio.Future[Any], ok: bool, value: Any, url: str) -> None:
    """Hand one operation's outcome to its caller (driver errors translated and chained)."""
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    elif isinstance(value, sqlite3.Error):
        err = _translate(value, url)
        err.__cause__ = value
        fut.set_exception(err)
    else:
        fut.set_exception(value)


def sqlite_path_from_url(url: str, params: Mapping[str, str] | None = None) -> str:
    """``sqlite:///relative.db`` → ``relative.db``; ``sqlite:////abs/x.db`` → ``/abs/x.db``."""
    rest = url[len("sqlite://") :]
    if not rest.startswith("/"):
        raise ConfigurationError(
            f"SQLite URL {url!r} must look like sqlite:///path.db or sqlite:////abs/path.db",
            option="store",
        )
    path = rest[1:]
    if not path:
        raise ConfigurationError(f"SQLite URL {url!r} names no file", option="store")
    return path
