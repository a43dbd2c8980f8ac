"""The embedded default store: one SQLite file in WAL mode (SPEC §9).

:class:`SQLiteConnector` runs named statements (see :mod:`retrysafe.stores._connector`): each
thread gets its own connection in autocommit mode, so every statement is its own transaction,
atomic under SQLite's write lock; an atomic operation or a block of several statements runs in
``BEGIN IMMEDIATE`` … ``COMMIT`` (a savepoint inside an open transaction). Safe for many threads
and many processes on one host. :class:`SQLiteStore` is the key store on it; the outbox, webhooks
and agents open their own stores on ``store.connector``. The schema of every feature is
``sql/schema.sqlite.sql``.

A store recovers by itself: no connection that was opened or failed while the file was unusable
is kept. SQLite opens a file it may not write read-only without a word; such a connection serves
reads, and the next operation after the file became writable again opens a new one. A
connection that failed because the store was unusable (read-only, disk full, an I/O error, a file
it could not open) is closed, and the next operation opens a new one; "locked" and "busy" are
only waited for.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import threading
import time
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
from retrysafe.stores._connector import (
    NEEDS_WRITE,
    Clock,
    Exec,
    Op,
    Transactions,
    drive,
    split_statements,
)
from retrysafe.stores._connector import _load as load_sql
from retrysafe.stores._keys import KeyEffect, SQLKeyStore
from retrysafe.stores._schema import (
    ADDED_COLUMNS,
    MIGRATE_HINT,
    SCHEMA_VERSION,
    Migration,
    State,
    indexes,
    migrate,
    parse_version,
    tables,
)

__all__ = [
    "SCHEMA_VERSION",
    "AsyncSQLiteConnector",
    "SQLiteConnector",
    "SQLiteStore",
    "SQLiteTransaction",
    "sqlite_path_from_url",
]

_T = TypeVar("_T")
_SCHEMA = load_sql("retrysafe.stores", "sql/schema.sqlite.sql")
_TABLES = tables(_SCHEMA["schema"])
_INDEXES = indexes(_SCHEMA["schema"])

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
    if isinstance(exc, sqlite3.OperationalError) and (
        "no such column" in low or "has no column named" in low
    ):
        # A table of an earlier layout, used by a process that did not open the store
        # itself (a Django project before its migration 0002, say).
        return SchemaError(
            f"SQLite store {store} has an older retrysafe schema: {msg} ({MIGRATE_HINT})",
            store=store,
        )
    return StoreError(f"SQLite store {store} failed: {msg}", store=store)


@contextmanager
def _errors(url: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as exc:
        raise _translate(exc, url) from exc


def _is_busy(exc: sqlite3.Error) -> bool:
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    low = str(exc).lower()
    return "locked" in low or "busy" in low


def _unusable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store was unusable (read-only, disk full, an I/O error, a file
    it could not open) rather than busy: a new connection may succeed where this one failed."""
    if not isinstance(exc, sqlite3.OperationalError) or _is_busy(exc):
        return False
    low = str(exc).lower()
    return any(s in low for s in _UNAVAILABLE)


# os.access checks the effective ids where it can (a setuid process opens files with those).
_EFFECTIVE_IDS = os.access in os.supports_effective_ids


# ---------------------------------------------------------------------- running operations
def _execute(conn: sqlite3.Connection, request: Exec) -> Any:
    statement = request.statement
    if statement.lenient:
        previous, conn.text_factory = conn.text_factory, _lenient_text  # a caller's, kept
        try:
            return _execute_statement(conn, request)
        finally:
            conn.text_factory = previous
    return _execute_statement(conn, request)


def _lenient_text(raw: bytes) -> str | bytes:
    """A TEXT value as ``str``, or as the ``bytes`` stored when they are no UTF-8 (see
    :attr:`~retrysafe.stores._connector.Statement.lenient`)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw


def _execute_statement(conn: sqlite3.Connection, request: Exec) -> Any:
    statement = request.statement
    parts = statement.parts["sqlite"]
    each = statement.each["sqlite"]
    if each is not None:
        return _execute_each(conn, parts, request.params[each], request.fetch)
    if len(parts) == 1:
        return _fetch(conn.execute(parts[0], request.params), request.fetch)
    with _atomic(conn):
        result = _fetch(conn.execute(parts[0], request.params), request.fetch)
        for part in parts[1:]:
            conn.execute(part, request.params)
    return result


def _execute_each(
    conn: sqlite3.Connection, parts: tuple[str, ...], rows: Any, fetch: str
) -> Any:
    """A block marked ``-- each:``: every statement once per element of ``rows``, all in one
    transaction (a savepoint inside an open one); the first statement's rows of every run
    (``"all"``) or their total count."""
    out: list[Any] = []
    total = 0
    with _atomic(conn):
        for row in rows:
            cur = conn.execute(parts[0], row)
            if fetch == "count":
                total += cur.rowcount
            else:
                out.extend(cur.fetchall())
            for part in parts[1:]:
                conn.execute(part, row)
    if fetch == "count":
        return total
    return out[0] if fetch == "one" and out else (None if fetch == "one" else out)


def _fetch(cur: sqlite3.Cursor, fetch: str) -> Any:
    if fetch == "one":
        return cur.fetchone()
    if fetch == "all":
        return cur.fetchall()
    return cur.rowcount


@contextmanager
def _atomic(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``, or a savepoint inside an open transaction."""
    nested = conn.in_transaction
    conn.execute("SAVEPOINT retrysafe_op" if nested else "BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                if nested:
                    conn.execute("ROLLBACK TO retrysafe_op")
                    conn.execute("RELEASE retrysafe_op")
                else:
                    conn.execute("ROLLBACK")
        raise
    conn.execute("RELEASE retrysafe_op" if nested else "COMMIT")


def _drive(conn: sqlite3.Connection, op: Op[_T], atomic: bool) -> _T:
    def execute(request: Exec) -> Any:
        return _execute(conn, request)

    if not atomic:
        return drive(op, execute)
    with _atomic(conn):
        return drive(op, execute)


class _Conn:
    """One tracked connection (a WeakSet tracks them for :meth:`SQLiteConnector.close`).

    ``degraded``: opened while the store could not be used fully (the file could not be written,
    so SQLite opened it read-only; or, for a read-only store, read as immutable): it is replaced
    as soon as :meth:`SQLiteConnector.healed` says a new connection would do better.

    Every use holds ``lock`` (``with holder as conn:``), and :meth:`close` never closes a
    connection in use: ``sqlite3`` frees a connection's statements on close, so closing one
    while another thread steps a statement on it crashes the process (a heartbeat renewal
    still in flight when the store closes). A connection in use is closed by its user, as its
    use ends.
    """

    __slots__ = ("__weakref__", "asked", "checked", "closing", "conn", "degraded", "file", "lock")

    def __init__(
        self,
        conn: sqlite3.Connection,
        degraded: bool = False,
        file: tuple[int, int] | None = None,
    ) -> None:
        self.conn = conn
        self.degraded = degraded
        #: The database file's (device, inode) when the connection was opened (None: not a
        #: plain file), and when :meth:`SQLiteConnector.replaced` last compared it (monotonic).
        self.file = file
        self.checked = time.monotonic()
        #: The connector's :meth:`~SQLiteConnector.recheck_files` count at that comparison.
        self.asked = 0
        self.lock = threading.Lock()
        self.closing = False

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        # close() set ``closing`` before it found the lock taken, so it is seen here.
        if self.closing:
            self.close()

    def close(self) -> None:
        """Close now if no thread is using the connection, else as that use ends. Idempotent;
        never raises."""
        self.closing = True
        if self.lock.acquire(blocking=False):
            try:
                with suppress(sqlite3.Error):
                    self.conn.close()
            finally:
                self.lock.release()


#: The size in bytes a WAL file is trimmed back to after a checkpoint (_connect_writable).
WAL_SIZE_LIMIT = 64 * 1024 * 1024

#: Seconds between two checks that a connection's file is still the store's (see
#: :meth:`SQLiteConnector.replaced`).
_REPLACED_EVERY = 1.0


class SQLiteConnector(Transactions):
    """Named SQL on one SQLite file (:class:`~retrysafe.stores._connector.Connector`).

    Args: see :class:`SQLiteStore`.
    """

    dialect = "sqlite"
    clock: Clock = "caller"

    def __init__(
        self, path: str, *, busy_timeout: float, readonly: bool, create: bool = True
    ) -> None:
        self.path = path
        #: The file's path as ``os.stat`` takes it (``~`` expanded once: each submission
        #: compares it, see :meth:`replaced`).
        self._stat_path = os.path.expanduser(path)
        self.busy_timeout = busy_timeout
        self.readonly = readonly
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._asked = 0  # recheck_files calls (see replaced)
        self._closed = False
        #: What opening did to the schema (``retrysafe migrate`` reports it).
        self.migration = Migration("none", SCHEMA_VERSION)
        #: Set once the file exists with its schema: later connections open it ``mode=rw``,
        #: so a file deleted under a running process is reported unavailable, never silently
        #: re-created empty (a metrics scrape's thread, a new worker thread).
        file_uri = None
        if path != ":memory:" and not path.startswith("file:"):
            file_uri = "file:" + quote(str(Path(path).expanduser().resolve())) + "?mode=rw"
        # Without create a missing file is not created either (it would be an empty database).
        self._rw_uri: str | None = None if create else file_uri
        self._ensure_schema(create and not readonly)
        self._rw_uri = file_uri

    def __repr__(self) -> str:
        return f"SQLiteConnector({self.path!r})"

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path}"

    @functools.cached_property
    def database(self) -> tuple[str, ...]:
        # Resolved once: every submit in a caller's transaction asks (a realpath per call
        # cost ~45 µs, a tenth of a submit).
        if self.path == ":memory:":
            return ("sqlite", ":memory:", str(id(self)))  # private to this connector
        return ("sqlite", str(Path(self.path).expanduser().resolve()))

    # ------------------------------------------------------------------ connections
    def connect(self, busy_timeout: float) -> sqlite3.Connection:
        """A new connection (autocommit, WAL, foreign keys), usable from any thread.

        Raises:
            StoreUnavailableError / StoreError: the file cannot be opened.
        """
        return self._new(busy_timeout).conn

    def open(self, busy_timeout: float) -> _Conn:
        """A new connection, tracked for :meth:`close`, marked degraded when it was opened
        while the store could not be used fully (see :class:`_Conn`)."""
        holder = self._new(busy_timeout)
        self.track(holder)
        return holder

    def _new(self, busy_timeout: float) -> _Conn:
        try:
            if self.readonly:
                conn, degraded = self._connect_readonly(busy_timeout)
            else:
                conn, degraded = self._connect_writable(busy_timeout)
        except sqlite3.Error as exc:
            raise _translate(exc, self.url) from exc
        holder = _Conn(conn, degraded, self._identity())
        holder.asked = self._asked  # its file was just compared: a recheck asked before is met
        return holder

    def _identity(self) -> tuple[int, int] | None:
        """The database file's (device, inode), or None (``:memory:``, a ``file:`` URI)."""
        if self.path == ":memory:" or self.path.startswith("file:"):
            return None
        try:
            st = os.stat(self._stat_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def replaced(self, holder: _Conn) -> bool:
        """Whether ``holder``'s file is no longer the store's: deleted, or replaced by another
        file (a restored backup, ``mv``). An open connection goes on reading and writing the
        file it opened even once it is unlinked, so without this a long-running process (a
        worker, the console) would record into a file nobody else can see. Asked at most
        once a second per connection (one ``stat``); the caller then opens a new connection,
        which reports a missing file as unavailable (it is never re-created empty) and reads
        a replacing one."""
        if holder.file is None:
            return False
        now, asked = time.monotonic(), self._asked
        if now - holder.checked < _REPLACED_EVERY and holder.asked == asked:
            return False
        holder.checked, holder.asked = now, asked
        try:
            st = os.stat(self._stat_path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != holder.file

    def _connect_writable(self, busy_timeout: float) -> tuple[sqlite3.Connection, bool]:
        # A file this process may not write is opened read-only, silently (SQLite's fallback):
        # the connection serves reads, and is marked degraded so that it is replaced once the
        # file is writable again. Asked before and after opening: a file that changed in between
        # is marked too; any other read-only connection is dropped by its first failed write.
        writable = self._file_writable()
        rw = self._rw_uri
        conn = sqlite3.connect(
            self.path if rw is None else rw,
            timeout=busy_timeout,
            isolation_level=None,  # autocommit: each statement is its own transaction
            check_same_thread=False,
            uri=rw is not None,
        )
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            # Statement journals (each savepoint of a group commit, each multi-statement
            # block) and the ephemeral tables of RETURNING stay in memory rather than in
            # a temporary file: the batched attempt record takes ~20 % less CPU per job
            # (`python benchmarks/record_bench.py`). They are small: a batch's pages.
            conn.execute("PRAGMA temp_store=MEMORY")
            # A WAL that a long read let grow (hundreds of MB) is trimmed back to 64 MiB
            # after the next checkpoint, instead of keeping its size until the last
            # connection closes. The checkpoint itself stays at SQLite's 1,000 pages: see
            # docs/performance.md for what a larger one gained and cost.
            conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        except BaseException:
            conn.close()
            raise
        return conn, not (writable and self._file_writable())

    def _connect_readonly(self, busy_timeout: float) -> tuple[sqlite3.Connection, bool]:
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
            # file there is nothing to miss: read the database file as immutable (degraded:
            # replaced once the directory is writable or a WAL file appears, since an immutable
            # reader would not see another process's writes).
            low = str(exc).lower()
            conn.close()
            if os.path.exists(file + "-wal") or not ("open" in low or "readonly" in low):
                raise
            return connect(uri + "&immutable=1"), True
        return conn, False

    def _file_writable(self) -> bool:
        """Whether this process may open the database file for writing now (a file that does
        not exist yet is created writable, or not at all)."""
        if self.path == ":memory:":
            return True
        file = Path(self.path).expanduser()
        return os.access(file, os.W_OK, effective_ids=_EFFECTIVE_IDS) or not file.exists()

    def healed(self) -> bool:
        """Whether a new connection would now do better than a degraded one: the file can be
        written again (a read-only store: its WAL index can be kept, or another process
        writes)."""
        if not self.readonly:
            return self._file_writable()
        file = Path(self.path).expanduser().resolve()
        writable_dir = os.access(file.parent, os.W_OK, effective_ids=_EFFECTIVE_IDS)
        return writable_dir or os.path.exists(str(file) + "-wal")

    def recheck_files(self) -> None:
        """Make the next use of every connection compare its file with the path (see
        :meth:`replaced`) whatever the time since the last comparison: before a change
        someone asked for (a submission, the console's actions), the one-second window is
        closed. One count, not a walk of the connections: it runs before every submit."""
        self._asked += 1  # each connection compares once it sees a count it did not compare at

    def track(self, holder: _Conn) -> None:
        with self._lock:
            self._connections.add(holder)

    def forget(self, holder: _Conn) -> None:
        """Close a connection that must not be used again."""
        with self._lock:
            self._connections.discard(holder)
        holder.close()

    def fails_for_good(self, exc: BaseException) -> bool:
        """Whether a connection that raised ``exc`` must be replaced: the store was unusable
        (see :func:`_unusable`), except a write refused by a store opened read-only (what
        every write there does) and a ``":memory:"`` database (it lives in its connection)."""
        if self.path == ":memory:" or not _unusable(exc):
            return False
        return not (self.readonly and "readonly" in str(exc).lower())

    def thread_connection(self) -> _Conn:
        """This thread's connection (use it as ``with holder as conn:``): opened on first use,
        and opened anew when the one it had was degraded and the store healed, or failed
        because the store was unusable.

        Raises:
            StoreError: the connector is closed, or the file cannot be opened.
        """
        if self._closed:
            raise StoreError(f"SQLite store {self.url} is closed", store=self.url)
        holder: _Conn | None = getattr(self._local, "conn", None)
        if holder is not None and ((holder.degraded and self.healed()) or self.replaced(holder)):
            self._drop_thread_connection()
            holder = None
        if holder is None:
            holder = self.open(self.busy_timeout)
            self._local.conn = holder
        return holder

    def _drop_thread_connection(self) -> None:
        holder: _Conn | None = getattr(self._local, "conn", None)
        if holder is not None:
            self._local.conn = None
            self.forget(holder)

    # ------------------------------------------------------------------ Connector
    def run(self, op: Op[_T], *, atomic: bool = False, connection: Any = None) -> _T:
        if connection is not None:
            tx = self.transaction_of(connection)
            with tx.lock, _errors(self.url):
                return _drive(tx.connection, op, atomic)
        return self.with_connection(lambda conn: _drive(conn, op, atomic))

    def with_connection(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """``fn(connection)`` on this thread's connection, driver errors translated; a
        connection that failed because the store was unusable is closed (the next call opens a
        new one)."""
        holder = self.thread_connection()
        try:
            with holder as conn:
                return fn(conn)
        except sqlite3.Error as exc:
            if self.fails_for_good(exc):
                self._drop_thread_connection()
            raise _translate(exc, self.url) from exc

    def begin(self) -> SQLiteTransaction:
        """Open a transaction on a dedicated connection (``BEGIN IMMEDIATE``: it holds the
        database's write lock until it ends, so other writers wait up to ``busy_timeout``).

        Raises:
            StoreUnavailableError: the write lock stayed taken for ``busy_timeout``.
            StoreError: the store is closed or the connection failed.
        """
        if self._closed:
            raise StoreError(f"SQLite store {self.url} is closed", store=self.url)
        conn = self.connect(self.busy_timeout)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            conn.close()
            raise _translate(exc, self.url) from exc
        return self.opened(SQLiteTransaction(self, conn))

    def async_connector(self) -> AsyncSQLiteConnector:
        return AsyncSQLiteConnector(self)

    def may_have_written(self, exc: StoreUnavailableError) -> bool:
        """Never: SQLite commits in this process, so a write that raised was rolled back (a
        lock held too long, a read-only or full disk, a deleted file)."""
        return False

    # ------------------------------------------------------------------ schema
    def _ensure_schema(self, create: bool) -> None:
        where = f"SQLite store {self.url}"
        if not create and self._rw_uri is not None and not os.path.exists(self.path):
            # Not created empty (mode=rw): a missing file is a store without a schema.
            raise SchemaError(
                f"{where} has no retrysafe schema: the file does not exist ({MIGRATE_HINT})",
                store=self.url,
            )

        if not create and not self.readonly and self._rw_uri is not None:
            self._check_schema_read_only(where)
        self.migration = self.with_connection(
            functools.partial(ensure_schema, where=where, create=create)
        )

    def _check_schema_read_only(self, where: str) -> None:
        """Refuse a file without a usable schema before the first writable connection, which
        switches the file to WAL: a command pointed at the wrong file (an empty one, another
        application's database) must leave it exactly as it was.

        Raises:
            SchemaError: the schema is missing, older, or newer than this release.
        """
        assert self._rw_uri is not None
        uri = self._rw_uri.replace("?mode=rw", "?mode=ro")
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout, isolation_level=None)
        except sqlite3.Error:
            return  # the writable path reports it, with its own translation
        try:
            ensure_schema(conn, where=where, create=False)
        except sqlite3.Error:
            return  # e.g. a read-only directory that cannot hold a WAL index: as above
        finally:
            conn.close()

    def close(self) -> None:
        """Close every connection this connector opened. Idempotent."""
        with self._lock:
            self._closed = True
            for holder in list(self._connections):
                holder.close()
            self._connections.clear()


#: Tables whose SQLite layout changed after their first release, so that an upgrade rebuilds
#: them: ``(table, column, trigger, block)``. A table without ``column`` is of the earlier
#: layout: the upgrade drops ``trigger`` (the current layout's, which refers to the table),
#: renames the table to ``retrysafe_rebuilt_<table>``, lets the layout script create the
#: current one, copies the rows with ``block`` of ``sql/schema.sqlite.sql`` and drops the old
#: table, all in the migration's one transaction. PostgreSQL keeps its layout of these tables.
#:
#: Version 3: ``outbox_attempts`` keyed by the job's creation time first.
REBUILT_TABLES: tuple[tuple[str, str, str, str], ...] = (
    ("outbox_attempts", "job_created_at", "outbox_attempts_of_deleted_job", "copy_outbox_attempts"),
)


#: The triggers that delete a job's rows of another table with it, and the block of
#: ``sql/schema.sqlite.sql`` that deletes the rows they missed while they were gone (dropped
#: by hand): a migration that re-creates one runs its block (a purge meanwhile left a
#: job's attempts and its large body behind, and re-creating the trigger alone kept them).
ORPHANED_BY: tuple[tuple[str, str], ...] = (
    ("outbox_attempts_of_deleted_job", "delete_orphan_attempts"),
    ("outbox_bodies_of_deleted_job", "delete_orphan_bodies"),
)


def ensure_schema(conn: sqlite3.Connection, *, where: str, create: bool) -> Migration:
    """Check the schema on ``conn`` and, with ``create``, create or upgrade it (inside an
    open transaction: in a savepoint). ``where`` names the store in messages.

    Raises:
        SchemaError: the schema is missing or older and ``create`` is false, or it is newer
            than this release.
    """

    def columns(table: str) -> set[str]:
        rows = conn.execute(_SCHEMA["table_columns"], {"table": table}).fetchall()
        return {str(row[0]) for row in rows}

    def apply() -> None:
        present = {str(r[0]) for r in conn.execute(_SCHEMA["list_objects"]).fetchall()}
        # A table of an earlier layout is renamed aside first (its triggers go: the layout
        # makes the current ones), so that the layout creates the current table in its place.
        rebuilt = []
        for table, column, trigger, block in REBUILT_TABLES:
            have = columns(table)
            if have and column not in have:
                conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
                conn.execute(f"ALTER TABLE {table} RENAME TO retrysafe_rebuilt_{table}")
                rebuilt.append((table, block))
        for stmt in split_statements(_SCHEMA["schema"]):
            conn.execute(stmt)
        for table, block in rebuilt:
            conn.execute(_SCHEMA[block])
            conn.execute(f"DROP TABLE retrysafe_rebuilt_{table}")
        for table, column, block in ADDED_COLUMNS:  # no ADD COLUMN IF NOT EXISTS
            if column not in columns(table):
                conn.execute(_SCHEMA[block])
        for trigger, block in ORPHANED_BY:
            if trigger not in present:
                conn.execute(_SCHEMA[block])
        conn.execute(_SCHEMA["set_schema_version"], {"version": str(SCHEMA_VERSION)})

    # BEGIN IMMEDIATE is the lock: a second migration waits for the first.
    return migrate(
        where,
        create=create,
        read=lambda: _state(conn, where),
        locked=lambda: _atomic(conn),
        apply=apply,
    )


def _state(conn: sqlite3.Connection, where: str) -> State:
    """The schema's version and what of the current layout is missing, as the file holds
    them now (see :class:`~retrysafe.stores._schema.State`)."""
    present = {str(r[0]) for r in conn.execute(_SCHEMA["list_objects"]).fetchall()}
    version = None
    if "retrysafe_meta" in present:
        row = conn.execute(_SCHEMA["get_schema_version"]).fetchone()
        version = None if row is None else parse_version(row[0], where)
    missing = [name for name in _TABLES if name not in present]
    for table, column, *_ in (*REBUILT_TABLES, *ADDED_COLUMNS):
        if table in present:
            have = {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                missing.append(f"{table}.{column}")
    unindexed = tuple(n for n in _INDEXES if n not in present)
    return State(version, tuple(missing), unindexed)


class SQLiteTransaction:
    """One open transaction on a dedicated connection (usable from any thread, access
    serialised).

    Attributes:
        connection: the ``sqlite3`` connection (``isolation_level=None``, inside ``BEGIN
            IMMEDIATE``) the application writes with. Never commit it yourself.
    """

    __slots__ = ("_connector", "_done", "connection", "lock")

    clock: Clock = "caller"

    #: The open transaction holds the database's write lock: no other writer (a take-over
    #: included) can touch a key until it ends, so the middleware need not renew the lease.
    holds_write_lock = True

    def __init__(self, connector: SQLiteConnector, conn: sqlite3.Connection) -> None:
        self._connector = connector
        self.connection = conn
        self.lock = threading.Lock()
        self._done = False

    @property
    def url(self) -> str:
        return self._connector.url

    @property
    def database(self) -> tuple[str, ...]:
        return self._connector.database

    def run(self, op: Op[_T]) -> _T:
        """Drive ``op`` inside this transaction (not yet committed)."""
        with self.lock, _errors(self._connector.url):
            return _drive(self.connection, op, False)

    def commit(self) -> None:
        """COMMIT and close the connection.

        Raises:
            StoreUnavailableError / StoreError: the COMMIT failed (nothing was written).
        """
        with self.lock:
            if self._done:
                return
            self._done = True
            try:
                with _errors(self._connector.url):
                    self.connection.execute("COMMIT")
            finally:
                self._close()

    def rollback(self) -> None:
        """ROLLBACK and close the connection. Idempotent; never raises."""
        with self.lock:
            if self._done:
                return
            self._done = True
            with suppress(sqlite3.Error):
                if self.connection.in_transaction:
                    self.connection.execute("ROLLBACK")
            self._close()

    def _close(self) -> None:
        self._connector.ended(self)
        with suppress(sqlite3.Error):
            self.connection.close()


# ---------------------------------------------------------------------- the async face
_Fn = Callable[[sqlite3.Connection], Any]
#: Seconds between the tries of a batch waiting for another process's write lock (each try
#: fails at once while the lock is held: about 10 µs on the event loop).
_LOCK_POLL = 0.005
# One queued operation: the function that drives it on a connection, the future its caller
# awaits, whether it may be skipped once that caller has gone, and its read-only form, run
# when it meets another process's write lock (``run(when_locked=…)``, or None).
_Queued = tuple[_Fn, "asyncio.Future[Any]", bool, "Callable[[], Op[Any]] | None"]


def _run_batch(conn: sqlite3.Connection, fns: list[_Fn]) -> list[tuple[bool, Any]]:
    """Run ``fns`` in order in one ``BEGIN IMMEDIATE`` … ``COMMIT`` (group commit).

    Returns one ``(ok, result or error)`` per function. An error fails only its own operation:
    an operation writes with one statement or atomically (a savepoint), and SQLite undoes a
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
            except StoreError as exc:  # an operation's own refusal (e.g. a claim that raced)
                outcomes.append((False, exc))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise
    return outcomes


class AsyncSQLiteConnector:
    """The async face of :class:`SQLiteConnector`, with group commit.

    Operations issued during one event-loop iteration are queued and run together, on the loop
    thread, in one ``BEGIN IMMEDIATE`` … ``COMMIT`` on a connection that never waits for a lock
    (``busy_timeout=0``): an uncontended SQLite write takes tens of microseconds, less than a
    hop to a worker thread, and one commit for many operations writes each page to the WAL
    once. Every operation gets its own result or error, and only after the ``COMMIT``, so a
    claim is never reported before it is durable. When another process holds the write lock
    the batch is tried again every few milliseconds for the store's ``busy_timeout`` (each try
    fails at once, so the loop never blocks on it), and what a read can answer is answered
    meanwhile; when the batch cannot run as one transaction at all, its operations run one by
    one. One event loop at a time uses an instance. The inline connection recovers
    like the sync face's (see the module docstring): it is replaced once a degraded one healed,
    and closed after it failed because the store was unusable.
    """

    dialect = "sqlite"
    clock: Clock = "caller"

    def __init__(self, connector: SQLiteConnector) -> None:
        self._sync = connector
        self._inline: _Conn | None = None
        self._queue: list[_Queued] = []
        self._queue_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # While one batch waits for another process's write lock, the operations that meet
        # the lock after it wait with it (None: no batch is waiting).
        self._behind_lock: list[_Queued] | None = None

    @property
    def url(self) -> str:
        return self._sync.url

    def _inline_conn(self) -> _Conn:
        if self._sync._closed:
            raise StoreError(f"SQLite store {self.url} is closed", store=self.url)
        holder = self._inline
        if holder is not None and (
            (holder.degraded and self._sync.healed()) or self._sync.replaced(holder)
        ):
            self._drop_inline()
            holder = None
        if holder is None:
            holder = self._inline = self._sync.open(0.0)
        return holder

    def _drop_inline(self) -> None:
        holder, self._inline = self._inline, None
        if holder is not None:
            self._sync.forget(holder)

    def _failed(self, exc: BaseException) -> None:
        """The inline connection raised ``exc``: close it if the store was unusable."""
        if self._sync.fails_for_good(exc):
            self._drop_inline()

    async def run(
        self,
        op: Callable[[], Op[_T]],
        *,
        atomic: bool = False,
        skippable: bool = False,
        when_locked: Callable[[], Op[Any]] | None = None,
    ) -> _T:
        result: _T = await self._submit(
            lambda conn: _drive(conn, op(), atomic), skippable, when_locked
        )
        return result

    async def aclose(self) -> None:
        self._drop_inline()

    def _submit(
        self, fn: _Fn, skippable: bool, locked: Callable[[], Op[Any]] | None = None
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        if loop is not self._queue_loop:
            # A loop that stopped before flushing left its queue behind: nobody awaits it.
            self._queue = []
            self._queue_loop = loop
        fut = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((fn, fut, skippable, locked))
        return fut

    def _flush(self) -> None:
        queue, self._queue = self._queue, []
        batch = [q for q in queue if not (q[2] and q[1].cancelled())]
        if not batch:
            return
        url = self.url
        try:
            holder = self._inline_conn()
        except StoreError as exc:
            for _, fut, _, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        if len(batch) == 1:  # no batch transaction: the operation on its own
            busy = self._inline_each(batch, holder)
            if busy:
                self._wait_behind_lock(busy)
            return
        try:
            with holder as conn:
                outcomes = _run_batch(conn, [q[0] for q in batch])
        except sqlite3.Error as exc:
            if _is_busy(exc):
                self._wait_for_lock(batch)
            else:
                self._failed(exc)
                self._spawn(self._one_by_one(batch))
            return
        except Exception:
            self._spawn(self._one_by_one(batch))
            return
        for (_, fut, _, _), (ok, value) in zip(batch, outcomes, strict=True):
            if not ok:
                self._failed(value)
            _deliver(fut, ok, value, url)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wait_for_lock(self, batch: list[_Queued]) -> None:
        """``batch`` met another process's write lock: wait for it (:meth:`_batch_waiting`),
        for the store's ``busy_timeout``. One batch waits at a time; a batch that meets the
        lock while one waits waits with it, then runs as soon as the lock is free, or fails
        with it when the lock outlasted the wait. (Each waiting on its own in the default
        thread pool, the fifth batch's 503 came after four whole busy timeouts: 20 requests
        to a locked store got theirs at 6, 11, 16 and 21 s, a fresh user's check.)"""
        busy = self._inline_each(batch)  # reads need no lock: they are done now
        if busy:
            self._wait_behind_lock(busy)

    def _wait_behind_lock(self, batch: list[_Queued]) -> None:
        """:meth:`_wait_for_lock` for operations that each met the lock on their own."""
        if self._behind_lock is not None:
            self._behind_lock.extend(batch)
            return
        self._behind_lock = []
        self._spawn(self._batch_waiting(batch))

    async def _batch_waiting(self, batch: list[_Queued]) -> None:
        """Run ``batch`` as soon as another process's write lock is free: tried inline (it
        never blocks: ``busy_timeout=0``) every :data:`_LOCK_POLL` seconds, for the store's
        ``busy_timeout``; then every operation fails with the lock, those waiting behind it
        too. Tried here, not in a thread under SQLite's own busy handler, whose sleeps grow
        to 100 ms: a lease renewal waiting for the lock landed up to 0.1 s after the lock
        ended, and a retry that reached the store first took the key over (a fresh user's
        check)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._sync.busy_timeout
        while True:
            await asyncio.sleep(_LOCK_POLL)
            batch = [q for q in batch if not (q[2] and q[1].cancelled())]
            try:
                with self._inline_conn() as conn:
                    outcomes = _run_batch(conn, [q[0] for q in batch])
            except Exception as exc:
                if isinstance(exc, sqlite3.Error) and _is_busy(exc):
                    if loop.time() < deadline:
                        continue
                    for _, fut, _, _ in batch + self._lock_freed():
                        _deliver(fut, False, exc, self.url)
                    return
                if isinstance(exc, sqlite3.Error):
                    self._failed(exc)
                # Not the lock: each operation on its own (its own error, or its result).
                self._requeue(self._lock_freed())
                await self._one_by_one(batch)
                return
            self._requeue(self._lock_freed())
            for (_, fut, _, _), (ok, value) in zip(batch, outcomes, strict=True):
                if not ok:
                    self._failed(value)
                _deliver(fut, ok, value, self.url)
            return

    def _lock_freed(self) -> list[_Queued]:
        """The operations that waited behind the batch waiting for the lock; none waits now."""
        behind, self._behind_lock = self._behind_lock or [], None
        return behind

    def _requeue(self, behind: list[_Queued]) -> None:
        """Run operations that waited behind the lock with the next flush (first in it)."""
        if not behind:
            return
        if not self._queue:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queue[:0] = behind

    def _inline_each(self, batch: list[_Queued], holder: _Conn | None = None) -> list[_Queued]:
        """Run each operation of ``batch`` on its own on the inline connection, outside any
        batch transaction; return those that met another process's write lock.

        An operation that only reads completes even while another process writes (WAL
        readers never wait for the writer: a replay's look-up waited out the whole
        busy_timeout behind the lock, a fresh user's check); one that writes meets the lock at
        once (``busy_timeout=0``) before it changed anything. One that met it and has a
        read-only form (``run(when_locked=…)``) runs that next, and waits only when that
        says it must write (``NEEDS_WRITE``): a replay's claim finds its completed key by
        reading (it waited out the whole busy_timeout behind a transactional handler's
        lock)."""
        busy: list[_Queued] = []
        for item in batch:
            fn, fut, skippable, locked = item
            if skippable and fut.cancelled():
                continue
            if self._met_lock(fn, fut, holder) and (
                locked is None or self._met_lock(_reading(locked), fut, holder)
            ):
                busy.append(item)
        return busy

    def _met_lock(self, fn: _Fn, fut: asyncio.Future[Any], holder: _Conn | None) -> bool:
        """Run ``fn`` on the inline connection and hand its outcome to ``fut``; True (and
        nothing handed over) when it met another process's write lock, or is a read-only
        form that says the operation must write."""
        url = self.url
        try:
            with holder or self._inline_conn() as conn:
                result = fn(conn)
        except sqlite3.Error as exc:
            if _is_busy(exc):
                return True
            self._failed(exc)
            _deliver(fut, False, exc, url)
        except Exception as exc:  # the operation's own error: its caller sees it
            _deliver(fut, False, exc, url)
        else:
            if result is NEEDS_WRITE:
                return True
            _deliver(fut, True, result, url)
        return False

    async def _one_by_one(self, batch: list[_Queued]) -> None:
        """Each operation on its own: inline first, in a thread when locked."""
        url = self.url
        for fn, fut, skippable, _ in self._inline_each(batch):
            if skippable and fut.cancelled():
                continue
            try:
                result = await asyncio.to_thread(self._sync.with_connection, fn)
            except Exception as exc:
                _deliver(fut, False, exc, url)
            else:
                _deliver(fut, True, result, url)


def _reading(read_only: Callable[[], Op[Any]]) -> _Fn:
    """What drives an operation's read-only form on a connection: its statements on their
    own, in no transaction (a read holds nothing)."""
    return lambda conn: _drive(conn, read_only(), False)


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


# ---------------------------------------------------------------------- the key store
class SQLiteStore(SQLKeyStore):
    """The SQLite store: :class:`~retrysafe.stores.KeyStore` on one file, and the
    :attr:`connector` the outbox, webhooks and agents keep their tables on.

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

    The store recovers by itself: a file that could not be written (or a directory that could
    not hold the WAL index) serves the first operation after it can again, on the same object;
    no connection opened or failed while the store was unusable is kept.

    Raises:
        ConfigurationError: the directory does not exist, ``busy_timeout`` < 0, or
            ``readonly`` and the file does not exist.
        SchemaError: the file holds a schema from a newer retrysafe.
        StoreUnavailableError: the file cannot be opened (permissions, locked).
    """

    dialect = "sqlite"
    connector: SQLiteConnector

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 5.0,
        create: bool = True,
        readonly: bool = False,
    ) -> None:
        if (
            isinstance(busy_timeout, bool)
            or not isinstance(busy_timeout, int | float)
            or not (0 <= busy_timeout < float("inf"))
        ):
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
        self.connector = SQLiteConnector(
            self.path, busy_timeout=busy_timeout, readonly=readonly, create=create
        )

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(connection)`` on this thread's connection, translating driver errors."""
        return self.connector.with_connection(fn)

    def transaction(self) -> Any:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` on a dedicated connection (rollback on error);
        yields the ``sqlite3`` connection.

        Applications use it to commit their own rows and a retrysafe write together
        (transactional outbox: ``outbox.submit(..., connection=conn)``).
        """
        return self.connector.transaction()

    def begin_effect(self) -> KeyEffect:
        """Open a transaction for a handler's own writes (SPEC §4 transactional mode): see
        :meth:`SQLiteConnector.begin`."""
        return KeyEffect(self.connector.begin())


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
