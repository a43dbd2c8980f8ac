"""The embedded default store: one SQLite file in WAL mode (SPEC §9).

Safe for many threads and many processes on one host: every claim is a single
``INSERT … ON CONFLICT … RETURNING`` statement and every fenced write a single ``UPDATE``/
``DELETE`` guarded by the fencing token, so SQLite's write lock makes each of them atomic.
Each thread gets its own connection. All SQL lives in ``sql/sqlite.sql``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from retrysafe._exceptions import (
    ConfigurationError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._sql import queries
from retrysafe.stores._sqlite_outbox import SQLiteOutboxMixin

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

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


def _row_to_record(row: tuple[Any, ...]) -> KeyRecord:
    (key_hash, fp, state, token, lease_exp, exp, status, headers, body, replayable) = row
    response = None
    if state == KeyState.COMPLETED.value and status is not None:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(headers or "[]"))
        response = StoredResponse(int(status), pairs, bytes(body or b""), bool(replayable))
    return KeyRecord(
        key_hash=key_hash,
        fingerprint=fp,
        state=KeyState(state),
        fencing_token=int(token),
        lease_expires_at=float(lease_exp),
        expires_at=float(exp),
        response=response,
    )


class SQLiteStore(SQLiteOutboxMixin):
    """SQLite-backed :class:`~retrysafe.stores.KeyStore` (and the outbox's store).

    Args:
        path: the database file. Its directory must exist; the file is created with the schema
            on first use. ``":memory:"`` gives a private per-connection database (tests only).
        busy_timeout: seconds a write waits for another process's write lock before failing
            with :class:`~retrysafe.StoreUnavailableError` (default 5 s).
        create: create the schema if missing (default True); with False a missing schema raises
            :class:`~retrysafe.SchemaError`.

    Raises:
        ConfigurationError: the directory does not exist, or ``busy_timeout`` < 0.
        SchemaError: the file holds a schema from a newer retrysafe.
        StoreUnavailableError: the file cannot be opened (permissions, locked).
    """

    dialect = "sqlite"

    def __init__(
        self, path: str | os.PathLike[str], *, busy_timeout: float = 5.0, create: bool = True
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
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._closed = False
        self._ensure_schema(create)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    # ------------------------------------------------------------------ connections
    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        try:
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
def _claim(
    c: sqlite3.Connection,
    key_hash: str,
    fingerprint: str,
    now: float,
    lease: float,
    retention: float,
) -> tuple[bool, KeyRecord]:
    params = {
        "key_hash": key_hash,
        "fingerprint": fingerprint,
        "lease_expires_at": now + lease,
        "expires_at": now + max(retention, lease),
        "now": now,
    }
    while True:
        row = c.execute(_Q["claim_key"], params).fetchone()
        if row is not None:
            return True, _row_to_record(row)
        existing = c.execute(_Q["get_key"], {"key_hash": key_hash}).fetchone()
        if existing is not None:
            return False, _row_to_record(existing)
        # Purged between the two statements: claim again.


def _take_over(
    c: sqlite3.Connection, key_hash: str, token: int, now: float, lease: float
) -> KeyRecord | None:
    row = c.execute(
        _Q["take_over_key"],
        {
            "key_hash": key_hash,
            "fencing_token": token,
            "lease_expires_at": now + lease,
            "now": now,
        },
    ).fetchone()
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
        {
            "key_hash": key_hash,
            "fencing_token": token,
            "status": response.status,
            "headers": json.dumps([list(p) for p in response.headers]),
            "body": response.body,
            "replayable": 1 if response.replayable else 0,
            "expires_at": now + retention,
        },
    )
    return cur.rowcount == 1


def _release(c: sqlite3.Connection, key_hash: str, token: int) -> bool:
    cur = c.execute(_Q["release_key"], {"key_hash": key_hash, "fencing_token": token})
    return cur.rowcount == 1


def _extend(c: sqlite3.Connection, key_hash: str, token: int, now: float, lease: float) -> bool:
    cur = c.execute(
        _Q["extend_key_lease"],
        {"key_hash": key_hash, "fencing_token": token, "lease_expires_at": now + lease},
    )
    return cur.rowcount == 1


def _get(c: sqlite3.Connection, key_hash: str) -> KeyRecord | None:
    row = c.execute(_Q["get_key"], {"key_hash": key_hash}).fetchone()
    return None if row is None else _row_to_record(row)


class _AsyncSQLiteKeys:
    """Async face of :class:`SQLiteStore` for the event loop.

    Each statement first runs on the loop thread on a connection that never waits for a lock
    (``busy_timeout=0``): an uncontended SQLite write takes tens of microseconds, less than a
    hop to a worker thread. When another process holds the write lock the statement is retried
    in a worker thread with the store's normal ``busy_timeout``, so the loop never blocks on it.
    """

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store
        self._inline: _Conn | None = None

    def _inline_conn(self) -> sqlite3.Connection:
        if self._inline is None:
            self._inline = _Conn(self._store._connect(0.0))
            with self._store._lock:
                self._store._connections.add(self._inline)
        return self._inline.conn

    async def _call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        try:
            return fn(self._inline_conn())
        except sqlite3.OperationalError as exc:
            low = str(exc).lower()
            if "locked" not in low and "busy" not in low:
                raise _translate(exc, self._store.url) from exc
        except sqlite3.Error as exc:
            raise _translate(exc, self._store.url) from exc
        return await asyncio.to_thread(self._store.run, fn)

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        return await self._call(lambda c: _claim(c, key_hash, fingerprint, now, lease, retention))

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        return await self._call(lambda c: _take_over(c, key_hash, fencing_token, now, lease))

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        return await self._call(
            lambda c: _complete(c, key_hash, fencing_token, response, now, retention)
        )

    async def release(self, key_hash: str, fencing_token: int) -> bool:
        return await self._call(lambda c: _release(c, key_hash, fencing_token))

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool:
        return await self._call(lambda c: _extend(c, key_hash, fencing_token, now, lease))

    async def get(self, key_hash: str) -> KeyRecord | None:
        return await self._call(lambda c: _get(c, key_hash))


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
