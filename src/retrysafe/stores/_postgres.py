"""The PostgreSQL store: many API replicas and workers sharing one database (SPEC §9).

:class:`PostgresConnector` runs named statements (see :mod:`retrysafe.stores._connector`) on a
:mod:`psycopg_pool` pool of autocommit connections: each statement is its own transaction and its
row locks make every claim and fenced write atomic across processes and hosts; an atomic operation
runs in one transaction (a savepoint inside an open one). :class:`PostgresStore` is the key store
on it; the outbox, webhooks and agents open their own stores on ``store.connector``. The schema of
every feature is ``sql/schema.postgres.sql``.

Clock: by default (``clock="server"``) leases and retention are measured on the **database
server's clock** — the ``now`` argument of every key and outbox operation is ignored and the
statement uses ``extract(epoch FROM statement_timestamp())`` — so replicas whose clocks drift
apart still agree on when a lease or a key expired. ``clock="caller"`` honours the ``now``
argument instead (the contract tests drive time by hand with it).

Group commit (the key store's async face, the ASGI middleware's): the operations issued during one
event-loop iteration run together on one pool connection, in one transaction, their statements
pipelined (psycopg pipeline mode): one round trip per step of the operations and one ``COMMIT``
for all of them, instead of a pool checkout, a round trip and a commit each. Every operation gets
its own result, and only after the ``COMMIT``. A statement that fails rolls the batch back and
its operations run again one by one, each on its own, so each gets its own answer; a connection
that fails mid-batch fails every operation of it as unavailable (as it would fail one).

A store recovers by itself: when an operation finds its connection closed by the server (a
restart, a failover, ``pg_terminate_backend``), that operation fails as unavailable and the pool's
other idle connections are checked at once (:meth:`psycopg_pool.ConnectionPool.check`), so the
next operation gets a live connection instead of another one left from before. A read-only server
(a standby, ``default_transaction_read_only``) is unavailable, not broken.

psycopg and psycopg-pool are imported only when this module is (``pip install
retrysafe[postgres]``); ``import retrysafe`` never imports them.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar
from urllib.parse import urlsplit

import psycopg
import psycopg_pool
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from retrysafe._exceptions import ConfigurationError, SchemaError, StoreError, StoreUnavailableError
from retrysafe.stores._connector import (
    Clock,
    Exec,
    JsonText,
    Op,
    Transactions,
    adrive,
    drive,
    split_statements,
)
from retrysafe.stores._connector import _load as load_sql
from retrysafe.stores._keys import AsyncSQLKeyStore, KeyEffect, SQLKeyStore
from retrysafe.stores._schema import (
    MIGRATE_HINT,
    SCHEMA_VERSION,
    Migration,
    State,
    indexes,
    migrate,
    parse_version,
    tables,
)
from retrysafe.stores._url_check import SCHEMA_NAME, check_postgres_url, reserved_schema

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "SCHEMA_VERSION",
    "AsyncPostgresConnector",
    "Clock",
    "PostgresConnector",
    "PostgresOptions",
    "PostgresStore",
    "PostgresTransaction",
]

_T = TypeVar("_T")


class _JsonTextDumper(psycopg.adapt.Dumper):
    """A :class:`~retrysafe.stores._connector.JsonText` parameter as its JSON text, with the
    OID psycopg gives a ``str`` (unknown: the statement's cast, e.g. ``::jsonb``, types it)."""

    oid = 0

    def dump(self, obj: Any) -> bytes:
        return str(obj).encode()  # JsonText's own text: one rule for what it writes


# Global adapters: only this package's own type, so no other connection's dumping changes.
psycopg.adapters.register_dumper(JsonText, _JsonTextDumper)

# bytes: psycopg accepts them as queries, and they are not LiteralString-checked.
_SCHEMA = {
    k: v.encode() for k, v in load_sql("retrysafe.stores", "sql/schema.postgres.sql").items()
}
# The layout: these scripts, in order; its tables are what they create.
_SCRIPTS = ("schema", "outbox_schema", "agents_schema", "webhooks_schema")
_TABLES = tables(*(_SCHEMA[name].decode() for name in _SCRIPTS))
_INDEXES = indexes(*(_SCHEMA[name].decode() for name in _SCRIPTS))


def _redact(message: str, password: str | None) -> str:
    """One line, without the password: psycopg's messages carry a second line ("Is the server
    running…") and, for SQL errors, the statement's ``LINE n:`` and a caret line."""
    if password:
        # As a whole token only: a short password ("p") inside words ("port", "accepting")
        # would otherwise garble the message; a password in a URL or quoted stays masked.
        token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(password)}(?![A-Za-z0-9])")
        message = token.sub("***", message)
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"}]
    return " ".join(kept)


def translate_error(
    exc: Exception, *, where: str, url: str, password: str | None, no_schema: str
) -> StoreError:
    """The one translation of a psycopg error into the store's errors, for every connection
    retrysafe runs its SQL on (its own pool, or a framework's: Django's).

    Args:
        where: how messages name the server; ``url``: the store, for ``StoreError.store``;
        password: masked wherever it appears; no_schema: the :class:`SchemaError` message,
            with ``{msg}`` for the driver's.

    Returns:
        :class:`SchemaError` for a missing table; :class:`StoreUnavailableError` for "cannot
        serve now" (unreachable, a pool timeout, a read-only server: a standby or a primary
        being demoted serves again once writable); :class:`StoreError` for the rest.
    """
    msg = _redact(str(exc).strip(), password)
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return SchemaError(no_schema.format(msg=msg), store=url)
    unavailable = (
        psycopg.OperationalError,
        psycopg_pool.PoolTimeout,
        psycopg.errors.ReadOnlySqlTransaction,
    )
    if isinstance(exc, unavailable):
        return StoreUnavailableError(f"PostgreSQL store at {where} unavailable: {msg}", store=url)
    return StoreError(f"PostgreSQL store at {where} failed: {msg}", store=url)


def _fetch(cur: psycopg.Cursor[Any], fetch: str) -> Any:
    if fetch == "one":
        return cur.fetchone()
    if fetch == "all":
        return cur.fetchall()
    return cur.rowcount


def _drive_sync(conn: psycopg.Connection[Any], op: Op[_T], atomic: bool) -> _T:
    def execute(request: Exec) -> Any:
        parts = request.statement.parts["postgres"]
        if len(parts) == 1:
            return _fetch(conn.execute(parts[0], request.params), request.fetch)
        with conn.transaction():
            result = _fetch(conn.execute(parts[0], request.params), request.fetch)
            for part in parts[1:]:
                conn.execute(part, request.params)
        return result

    if not atomic:
        return drive(op, execute)
    with conn.transaction():
        return drive(op, execute)


async def _drive_async(conn: psycopg.AsyncConnection[Any], op: Op[_T], atomic: bool) -> _T:
    async def execute(request: Exec) -> Any:
        parts = request.statement.parts["postgres"]
        if len(parts) == 1:
            return await _afetch(await conn.execute(parts[0], request.params), request.fetch)
        async with conn.transaction():
            result = await _afetch(await conn.execute(parts[0], request.params), request.fetch)
            for part in parts[1:]:
                await conn.execute(part, request.params)
        return result

    if not atomic:
        return await adrive(op, execute)
    async with conn.transaction():
        return await adrive(op, execute)


async def _afetch(cur: psycopg.AsyncCursor[Any], fetch: str) -> Any:
    if fetch == "one":
        return await cur.fetchone()
    if fetch == "all":
        return await cur.fetchall()
    return cur.rowcount


#: One operation waiting for its batch: its factory, its caller's future, whether it may be
#: skipped once that caller has gone (see :class:`~retrysafe.stores._connector.AsyncConnector`).
_Queued = tuple[Callable[[], Op[Any]], "asyncio.Future[Any]", bool]


def _lock_order(item: tuple[int, Exec]) -> tuple[str, str]:
    """The order a step's statements run in: by statement, then by key hash, so that batches
    of concurrent processes lock the rows of one statement in the same order and never wait
    on each other in a cycle."""
    request = item[1]
    return request.statement.name, str(request.params.get("key_hash", ""))


async def _drive_batch(
    conn: psycopg.AsyncConnection[Any], ops: list[Callable[[], Op[Any]]]
) -> list[tuple[bool, Any]]:
    """Drive ``ops`` together in one transaction: every operation's next statement is sent in
    one pipeline, the results are read after one sync, and each operation gets its result and
    yields its next statement, until all are done. Returns one ``(ok, result or the
    operation's own error)`` per operation, in order.

    Raises:
        psycopg.Error: a statement (or the COMMIT) failed; the transaction was rolled back.
    """
    outcomes: list[tuple[bool, Any]] = [(False, None)] * len(ops)
    pending: list[tuple[int, Exec]] = []

    def advance(i: int, gen: Op[Any], ok: bool, value: Any) -> None:
        try:
            request = gen.send(value) if ok else gen.throw(value)
        except StopIteration as stop:
            outcomes[i] = (True, stop.value)
        except Exception as exc:  # the operation's own error: only its caller sees it
            outcomes[i] = (False, exc)
        else:
            pending.append((i, request))

    gens = [op() for op in ops]
    for i, gen in enumerate(gens):
        advance(i, gen, True, None)
    async with conn.pipeline() as pipeline, conn.transaction():
        while pending:
            step = sorted(pending, key=_lock_order)
            pending = []
            cursors = []
            for _, request in step:
                parts = request.statement.parts["postgres"]
                cur = conn.cursor()
                await cur.execute(parts[0], request.params, prepare=True)
                for part in parts[1:]:
                    await conn.execute(part, request.params, prepare=True)
                cursors.append(cur)
            await pipeline.sync()  # one round trip for the whole step
            for (i, request), cur in zip(step, cursors, strict=True):
                advance(i, gens[i], True, await _afetch(cur, request.fetch))
    return outcomes


#: libpq's TCP keepalives, unless the URL sets its own: a connection whose server or network
#: went away without a word (a failover, a dropped NAT entry) fails within about a minute
#: (30 s idle, then 3 probes 10 s apart) instead of leaving a worker waiting on it for the
#: kernel's two hours; ``tcp_user_timeout`` (ms) bounds a write the peer never acknowledges.
_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}


def _options(url_options: object, schema: str, statement_timeout: float | None = None) -> str:
    """The connection's ``options``: the store's ``-c statement_timeout`` first (so one the
    URL sets wins), the URL's own (e.g. ``-c work_mem=64MB``), then ``-c
    search_path=<schema>``, last, so the store's schema wins over a ``search_path`` the URL
    names.

    Raises:
        ConfigurationError: the URL's options end in an unescaped backslash, which would
            escape the space before the store's own option (libpq's quoting).
    """
    own = f"-c search_path={schema}"
    if statement_timeout is not None:
        url_options = f"-c statement_timeout={round(statement_timeout * 1000)} {url_options or ''}"
    if not url_options:
        return own
    text = str(url_options)
    if (len(text) - len(text.rstrip("\\"))) % 2:
        raise ConfigurationError(
            "the URL's options end with a backslash, which would swallow the store's own "
            "-c search_path; remove it (or double it for a literal backslash)",
            option="store",
        )
    return f"{text} {own}"


class PostgresOptions(TypedDict, total=False):
    """The keyword arguments of :class:`PostgresStore` (see there)."""

    schema: str
    create: bool
    clock: Clock
    min_size: int
    max_size: int
    connect_timeout: float
    statement_timeout: float | None


#: Default ``statement_timeout`` of a PostgreSQL store (seconds): a lock held elsewhere or a
#: stalled server fails an operation with StoreUnavailableError (503 + Retry-After at the
#: middleware) instead of holding the request for as long as the stall lasts.
DEFAULT_STATEMENT_TIMEOUT = 10.0
#: Seconds the async face waits beyond ``statement_timeout`` for the server's own answer
#: before it gives up on the connection (a network that swallows everything).
_CLIENT_MARGIN = 5.0

#: Seconds a pool slot keeps reconnecting before it gives up (psycopg_pool's
#: ``reconnect_timeout``; its own default is 300). psycopg_pool waits 1, 2, 4, 8 … s between
#: two attempts of one slot, so after an outage of 22 s a server that came back was noticed
#: only 8 s later. A slot that gave up is opened again by the next operation that needs a
#: connection, at once, so a server back is noticed within about two seconds.
RECONNECT_WINDOW = 3.0
#: Seconds an abandoned operation whose connection was shut down may take to end before it
#: is cancelled.
_ABANDONED_WAIT = 1.0


class _Deadlines:
    """The sync face's bound on the server's silence, the twin of the async face's: psycopg's
    sync calls take no timeout, and the server's own ``statement_timeout`` cannot reach a
    client it does not answer (a stopped server process, a frozen VM, a proxy that holds the
    connection): a WSGI request waited as long as that lasted. An operation whose connection
    has waited ``limit`` seconds gets its socket shut down, so psycopg's wait ends with an
    error and the caller with :class:`~retrysafe.StoreUnavailableError`; the pool drops the
    connection. One thread per connector, started by its first operation; an operation costs
    a dict entry under a lock."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        #: Operations waiting on the server: number → (monotonic deadline, connection).
        self._ops: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._cut: set[int] = set()
        #: The connections shut down, for as long as they live.
        self.cut_connections: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
        self._count = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, conn: psycopg.Connection[Any]) -> Iterator[Callable[[], bool]]:
        """Bound the block's wait on ``conn``; yields "was the connection cut?"."""
        with self._lock:
            n = self._count = self._count + 1
            first = not self._ops
            # Every deadline is ``limit`` after its start: the first entry is the earliest.
            self._ops[n] = (time.monotonic() + self.limit, conn)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="retrysafe-pg-deadlines", daemon=True
                )
                self._thread.start()
        if first:
            self._wake.set()
        try:
            yield lambda: n in self._cut
        finally:
            with self._lock:
                del self._ops[n]
                self._cut.discard(n)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                due = [(n, c) for n, (at, c) in self._ops.items() if at <= now]
                for n, c in due:
                    self._ops[n] = (math.inf, c)  # cut once
                    self._cut.add(n)
                    self.cut_connections.add(c)
                later = min((at for at, _ in self._ops.values()), default=math.inf)
            for _, conn in due:
                _shut_down(conn)
            self._wake.wait(None if later == math.inf else later - now)


def _shut_down(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Shut ``conn``'s socket down (both ways): a wait on it returns at once, with an error."""
    with suppress(Exception):  # closed meanwhile: nothing waits on it any more
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


class PostgresConnector(Transactions):
    """Named SQL on one PostgreSQL database (:class:`~retrysafe.stores._connector.Connector`).

    Args: see :class:`PostgresStore`.
    """

    dialect = "postgres"

    def __init__(
        self,
        url: str,
        *,
        schema: str = "public",
        create: bool = True,
        clock: Clock = "server",
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 5.0,
        statement_timeout: float | None = DEFAULT_STATEMENT_TIMEOUT,
    ) -> None:
        if statement_timeout is not None and (
            isinstance(statement_timeout, bool)
            or not isinstance(statement_timeout, int | float)
            or not 0.001 <= statement_timeout <= 86_400
        ):
            raise ConfigurationError(
                f"statement_timeout must be None or seconds between 0.001 and 86400, "
                f"not {statement_timeout!r}",
                option="statement_timeout",
            )
        if not isinstance(schema, str) or not SCHEMA_NAME.fullmatch(schema):
            raise ConfigurationError(
                f"schema {schema!r} must be a plain lower-case identifier (letters, digits, _; "
                "PostgreSQL folds unquoted names to lower case)",
                option="schema",
            )
        reserved = reserved_schema(schema)
        if reserved is not None:
            raise ConfigurationError(f"schema {schema!r}: {reserved}", option="schema")
        if clock not in ("server", "caller"):
            raise ConfigurationError("clock must be 'server' or 'caller'", option="clock")
        check_postgres_url(url)
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ConfigurationError("need 0 <= min_size <= max_size, max_size >= 1")
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error as exc:
            # psycopg's message quotes the part it could not parse, the password included.
            try:
                typed = urlsplit(url).password
            except ValueError:
                typed = None
            raise ConfigurationError(
                f"malformed PostgreSQL URL: {_redact(str(exc), typed)}", option="store"
            ) from exc
        password = params.get("password")
        self._password = None if password is None else str(password)
        host = params.get("host") or params.get("hostaddr") or "localhost"
        self.where = f"{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"
        self.schema = schema
        self.clock: Clock = clock
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        #: The bound on the server's silence for one sync operation (None: none).
        self._deadlines = (
            None if statement_timeout is None else _Deadlines(statement_timeout + _CLIENT_MARGIN)
        )
        self.min_size = min_size
        self.max_size = max_size
        self.kwargs: dict[str, Any] = {
            "autocommit": True,
            "options": _options(params.get("options"), schema, statement_timeout),
            "connect_timeout": max(2, round(connect_timeout)),
            **{k: v for k, v in _KEEPALIVES.items() if k not in params},
        }
        self.conninfo = make_conninfo(url)
        self._closed = False
        #: What opening did to the schema (``retrysafe migrate`` reports it).
        self.migration = Migration("none", SCHEMA_VERSION)
        self._ensure_schema(create)
        self._pool = psycopg_pool.ConnectionPool(
            self.conninfo,
            min_size=min_size,
            max_size=max_size,
            kwargs=self.kwargs,
            timeout=connect_timeout,
            reconnect_timeout=RECONNECT_WINDOW,
            open=False,
            name="retrysafe",
        )
        self._pool.open(wait=False)

    def __repr__(self) -> str:
        return f"PostgresConnector({self.url!r})"

    @property
    def url(self) -> str:
        """The URL without the password."""
        return f"postgresql://{self.where}"

    @property
    def database(self) -> tuple[str, ...]:
        return ("postgres", self.where, self.schema)

    # ------------------------------------------------------------------ errors
    def translate(self, exc: Exception) -> StoreError:
        """The one translation of psycopg's errors (the password never appears)."""
        return translate_error(
            exc,
            where=self.where,
            url=self.url,
            password=self._password,
            no_schema=f"PostgreSQL store {self.where} has no retrysafe schema in "
            f"{self.schema!r}: {{msg}} ({MIGRATE_HINT})",
        )

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self.translate(exc) from exc

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """One pool connection (autocommit), driver errors translated; when it turns out
        broken, the pool's idle connections are checked (see the module docstring)."""
        if self._closed:
            raise StoreError(f"PostgreSQL store {self.url} is closed", store=self.url)
        broken = False
        try:
            with self._pool.connection() as conn:
                try:
                    yield conn
                except psycopg.Error:
                    broken = conn.broken and not self._was_cut(conn)
                    raise
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            if broken:
                self._sweep()
            raise self.translate(exc) from exc

    def _was_cut(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether ``conn`` broke because :class:`_Deadlines` shut it down: the server is
        silent, so checking the pool's idle connections (a query each, with no bound of its
        own) would wait on it too; they are left to fail, each within its own bound."""
        return self._deadlines is not None and conn in self._deadlines.cut_connections

    def _sweep(self) -> None:
        """Drop the pool's idle connections the server closed (the pool replaces them)."""
        with suppress(Exception):
            self._pool.check()

    # ------------------------------------------------------------------ Connector
    def run(self, op: Op[_T], *, atomic: bool = False, connection: Any = None) -> _T:
        if connection is not None:
            tx: PostgresTransaction = self.transaction_of(connection)
            return tx.run(op, atomic=atomic)
        with self.connection() as conn, self.bounded(conn):
            return _drive_sync(conn, op, atomic)

    @contextmanager
    def bounded(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """The block's wait on ``conn`` bounded by ``statement_timeout`` + 5 s
        (:class:`_Deadlines`); past it, :class:`~retrysafe.StoreUnavailableError` saying so.
        """
        if self._deadlines is None:
            yield
            return
        with self._deadlines.watch(conn) as was_cut:
            try:
                yield
            except (psycopg.Error, StoreError) as exc:
                if was_cut():
                    raise self.silent() from exc
                raise

    def silent(self) -> StoreUnavailableError:
        """The error of an operation the server left unanswered past its bound."""
        limit = self._deadlines.limit if self._deadlines is not None else math.inf
        return StoreUnavailableError(
            f"PostgreSQL store at {self.where} unavailable: no answer within "
            f"{limit:g} s (statement_timeout + {_CLIENT_MARGIN:g} s)",
            store=self.url,
        )

    def begin(self) -> PostgresTransaction:
        """Open a transaction on a connection of the pool (it goes back at commit or rollback).

        Raises:
            StoreUnavailableError: no connection within ``connect_timeout``.
            StoreError: the store is closed.
        """
        if self._closed:
            raise StoreError(f"PostgreSQL store {self.url} is closed", store=self.url)
        with self._errors():
            conn = self._pool.getconn()
        try:
            conn.autocommit = False
        except psycopg.Error as exc:
            self._pool.putconn(conn)
            raise self.translate(exc) from exc
        return self.opened(PostgresTransaction(self, conn))

    def _give_back(self, tx: PostgresTransaction) -> None:
        self.ended(tx)
        conn = tx.connection
        with suppress(psycopg.Error):
            if not conn.closed:
                conn.rollback()
                conn.autocommit = True
        self._pool.putconn(conn)
        if conn.broken and not self._was_cut(conn):
            self._sweep()

    def async_connector(self) -> AsyncPostgresConnector:
        return AsyncPostgresConnector(self)

    def may_have_written(self, exc: StoreUnavailableError) -> bool:
        """Unless nothing was sent: no connection within ``connect_timeout`` (the pool's
        timeout), or a server that only reads refused the write. A connection lost or
        silent after the statement went out may have committed it."""
        return not isinstance(
            exc.__cause__, psycopg_pool.PoolTimeout | psycopg.errors.ReadOnlySqlTransaction
        )

    # ------------------------------------------------------------------ schema
    def _ensure_schema(self, create: bool) -> None:
        try:
            with psycopg.connect(self.conninfo, **self.kwargs) as conn:
                # A migration takes as long as it needs (an index on a large table).
                conn.execute("SET statement_timeout = 0")
                self._check_or_create(conn, create)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self.translate(exc) from exc

    def _check_or_create(self, conn: psycopg.Connection[Any], create: bool) -> None:
        where = f"PostgreSQL store {self.where} (schema {self.schema!r})"
        self.migration = ensure_schema(conn, where=where, schema=self.schema, create=create)

    def close(self) -> None:
        """Close the sync pool. Idempotent. (Async faces close with ``aclose()``.)"""
        if not self._closed:
            self._closed = True
            self._pool.close()


def ensure_schema(
    conn: psycopg.Connection[Any], *, where: str, schema: str, create: bool
) -> Migration:
    """Check the schema in ``schema`` on ``conn`` and, with ``create``, create or upgrade it
    under the schema's advisory lock (inside an open transaction: in a savepoint). ``where``
    names the store in messages.

    Raises:
        SchemaError: the schema is missing or older and ``create`` is false, or it is newer
            than this release.
    """

    @contextmanager
    def locked() -> Iterator[None]:
        with conn.transaction():
            # The advisory lock comes first: CREATE SCHEMA IF NOT EXISTS itself races (two
            # creators collide on the catalog's unique index).
            conn.execute(_SCHEMA["lock_schema"], {"schema": schema})
            create_schema = sql.SQL(_SCHEMA["create_schema"].decode())
            conn.execute(create_schema.format(schema=sql.Identifier(schema)))
            yield

    def apply() -> None:
        for name in _SCRIPTS:
            for stmt_text in split_statements(_SCHEMA[name].decode()):
                conn.execute(stmt_text.encode())
        conn.execute(_SCHEMA["set_schema_version"], {"version": str(SCHEMA_VERSION)})

    return migrate(
        where, create=create, read=lambda: _state(conn, where), locked=locked, apply=apply
    )


def _state(conn: psycopg.Connection[Any], where: str) -> State:
    """The schema's version and its missing tables and indexes, as the database holds them
    now."""
    version = None
    row = conn.execute(_SCHEMA["meta_exists"]).fetchone()
    if row is not None and row[0]:
        got = conn.execute(_SCHEMA["get_schema_version"]).fetchone()
        version = None if got is None else parse_version(got[0], where)
    rows = conn.execute(_SCHEMA["missing_tables"], {"tables": [*_TABLES, *_INDEXES]})
    missing = {str(r[0]) for r in rows.fetchall()}
    return State(
        version,
        tuple(n for n in _TABLES if n in missing),
        tuple(n for n in _INDEXES if n in missing),
    )


class PostgresTransaction:
    """One open transaction on a pool connection (usable from any thread, access serialised).

    Attributes:
        connection: the :class:`psycopg.Connection` (not autocommit; its search_path is the
            store's schema) the application writes with. Never commit it yourself.
    """

    __slots__ = ("_connector", "_done", "clock", "connection", "lock")

    #: Other connections can still write a key's row: the middleware keeps renewing the lease.
    holds_write_lock = False

    def __init__(self, connector: PostgresConnector, conn: psycopg.Connection[Any]) -> None:
        self._connector = connector
        self.clock: Clock = connector.clock
        self.connection = conn
        self.lock = threading.Lock()
        self._done = False

    @property
    def url(self) -> str:
        return self._connector.url

    @property
    def database(self) -> tuple[str, ...]:
        return self._connector.database

    def run(self, op: Op[_T], *, atomic: bool = False) -> _T:
        """Drive ``op`` inside this transaction (not yet committed)."""
        with self.lock, self._connector.bounded(self.connection), self._connector._errors():
            return _drive_sync(self.connection, op, atomic)

    def commit(self) -> None:
        """COMMIT; the connection goes back to the pool.

        Raises:
            StoreUnavailableError / StoreError: the COMMIT failed.
        """
        with self.lock:
            if self._done:
                return
            self._done = True
            try:
                with self._connector._errors():
                    self.connection.commit()
            finally:
                self._connector._give_back(self)

    def rollback(self) -> None:
        """ROLLBACK; the connection goes back to the pool. Idempotent; never raises."""
        with self.lock:
            if self._done:
                return
            self._done = True
            with suppress(psycopg.Error):
                self.connection.rollback()
            self._connector._give_back(self)


class AsyncPostgresConnector:
    """The async face of :class:`PostgresConnector`: the same operations on a
    :class:`psycopg_pool.AsyncConnectionPool`.

    The pool belongs to the event loop that first uses the face; used from another loop the face
    opens a new pool there. Close it with :meth:`aclose`.

    Args:
        connector: the sync connector whose database and pool settings it shares.
        group_commit: run the operations of one event-loop iteration together (see the module
            docstring); atomic operations always run on their own. Needs libpq's pipeline mode
            (libpq >= 14, which psycopg[binary] bundles); without it operations run one by one.
    """

    dialect = "postgres"

    def __init__(self, connector: PostgresConnector, *, group_commit: bool = False) -> None:
        self._sync = connector
        self.clock: Clock = connector.clock
        self._pool: psycopg_pool.AsyncConnectionPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None
        self.group_commit = group_commit and psycopg.AsyncPipeline.is_supported()
        self._queue: list[_Queued] = []
        self._queue_loop: asyncio.AbstractEventLoop | None = None
        self._batches: set[asyncio.Task[Any]] = set()
        #: The connection each task of this face is using, to shut down when it is abandoned.
        self._using: dict[asyncio.Task[Any], psycopg.AsyncConnection[Any]] = {}
        #: Tasks whose connection was shut down (abandoned): their failure says nothing
        #: about the pool's other connections.
        self._cut: set[asyncio.Task[Any]] = set()
        timeout = connector.statement_timeout
        #: Seconds to wait for the server's answer to one operation or batch (None: as long
        #: as it takes): its statement_timeout should have answered by then.
        self._limit = None if timeout is None else timeout + _CLIENT_MARGIN

    @property
    def url(self) -> str:
        return self._sync.url

    async def _bounded(self, work: Coroutine[Any, Any, _T]) -> _T:
        """``work``'s result, or :class:`~retrysafe.StoreUnavailableError` once the server
        has been silent for ``statement_timeout`` + 5 s (a network that swallows its answer,
        where the server's own timeout cannot reach us): the operations that do not go
        through a batch (atomic ones, or without group commit). The abandoned work is
        cancelled and finishes in the background: psycopg cancels the query, the pool drops
        the connection."""
        if self._limit is None:
            return await work
        task = asyncio.get_running_loop().create_task(work)
        try:
            done, _ = await asyncio.wait((task,), timeout=self._limit)
        except BaseException:
            task.cancel()
            raise
        if done:
            return task.result()
        self._abandon(task)
        self._batches.add(task)
        task.add_done_callback(_abandoned)
        task.add_done_callback(self._batches.discard)
        raise self._silent()

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        """End ``task``, past its bound: its connection's socket is shut down, so its wait on
        the server fails at once and the pool drops the connection. Not cancelled while it
        has one (psycopg would ask the silent server to cancel the query, and wait for that
        seconds more, holding the connection and ``aclose``); a task still waiting for a
        connection, or one the shutdown does not end within a second, is cancelled."""
        conn = self._using.get(task)
        if conn is None:
            task.cancel()
            return
        self._cut.add(task)
        task.add_done_callback(self._cut.discard)
        _shut_down(conn)
        task.get_loop().call_later(_ABANDONED_WAIT, task.cancel)

    async def _alone(self, op: Op[_T], atomic: bool) -> _T:
        async with self._connection() as conn:
            return await _drive_async(conn, op, atomic)

    async def _get_pool(self) -> psycopg_pool.AsyncConnectionPool:
        loop = asyncio.get_running_loop()
        if self._pool is not None and self._loop is loop:
            return self._pool
        if self._opening is None or self._loop is not loop:
            self._opening, self._loop, self._pool = asyncio.Lock(), loop, None
        async with self._opening:
            if self._pool is None:
                s = self._sync
                pool = psycopg_pool.AsyncConnectionPool(
                    s.conninfo,
                    min_size=s.min_size,
                    max_size=s.max_size,
                    kwargs=s.kwargs,
                    timeout=s.connect_timeout,
                    reconnect_timeout=RECONNECT_WINDOW,
                    open=False,
                    name="retrysafe-async",
                )
                await pool.open(wait=False)
                self._pool = pool
            return self._pool

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """One pool connection; when it turns out broken, the pool's idle connections are
        checked (see the module docstring)."""
        broken: psycopg_pool.AsyncConnectionPool | None = None
        try:
            pool = await self._get_pool()
            async with pool.connection() as conn:
                task = asyncio.current_task()
                if task is not None:
                    self._using[task] = conn
                try:
                    yield conn
                except psycopg.Error:
                    cut = task in self._cut  # shut down by _abandon, not by the server
                    broken = pool if conn.broken and not cut else None
                    raise
                finally:
                    if task is not None:
                        self._using.pop(task, None)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            if broken is not None:
                with suppress(Exception):
                    await broken.check()
            raise self._sync.translate(exc) from exc

    async def run(
        self,
        op: Callable[[], Op[_T]],
        *,
        atomic: bool = False,
        skippable: bool = False,
        when_locked: Callable[[], Op[Any]] | None = None,  # no write lock here: row locks
    ) -> _T:
        if not self.group_commit or atomic:
            return await self._bounded(self._alone(op(), atomic))
        loop = asyncio.get_running_loop()
        if loop is not self._queue_loop:
            # A loop that stopped before flushing left its queue behind: nobody awaits it.
            self._queue = []
            self._queue_loop = loop
        future: asyncio.Future[_T] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((op, future, skippable))
        return await future

    def _flush(self) -> None:
        """Start the batch of this event-loop iteration's operations (group commit)."""
        queue, self._queue = self._queue, []
        batch = [q for q in queue if not (q[2] and q[1].cancelled())]
        if batch:
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[_Queued]) -> None:
        """One batch, in its own task (:meth:`_flush`), under one deadline: past
        ``statement_timeout`` + 5 s every caller still waiting gets StoreUnavailableError and
        the task is cancelled (a timer, not a second task per batch: this is the hot path)."""
        timer = None
        if self._limit is not None:
            task = asyncio.current_task()
            assert task is not None
            timer = asyncio.get_running_loop().call_later(
                self._limit, self._expire, batch, task
            )
        try:
            await self._run_batch_now(batch)
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self, batch: list[_Queued], task: asyncio.Task[Any]) -> None:
        error = self._silent()
        for _, future, _ in batch:
            _deliver(future, False, error)
        self._abandon(task)

    def _silent(self) -> StoreUnavailableError:
        return self._sync.silent()

    async def _run_batch_now(self, batch: list[_Queued]) -> None:
        if len(batch) == 1:
            await self._run_alone(batch[0])
            return
        try:
            async with self._connection() as conn:
                outcomes = await _drive_batch(conn, [q[0] for q in batch])
        except StoreUnavailableError as exc:
            # The connection failed (or none came): whether the COMMIT landed is unknown, so
            # nothing is run again; every operation fails as it would have alone.
            for _, future, _ in batch:
                _deliver(future, False, exc)
            return
        except Exception:
            # A statement failed (or something else did) and the transaction rolled back:
            # nothing of the batch took effect. Each operation runs again on its own, so each
            # gets its own answer.
            for queued in batch:
                await self._run_alone(queued)
            return
        except BaseException:  # cancelled (the loop is closing): nobody gets a result
            for _, future, _ in batch:
                _deliver(future, False, None)
            raise
        for (_, future, _), (ok, value) in zip(batch, outcomes, strict=True):
            _deliver(future, ok, value)

    async def _run_alone(self, queued: _Queued) -> None:
        op, future, skippable = queued
        if skippable and future.cancelled():
            return
        try:
            result = await self._alone(op(), False)
        except Exception as exc:
            _deliver(future, False, exc)
        except BaseException:
            _deliver(future, False, None)
            raise
        else:
            _deliver(future, True, result)

    async def aclose(self) -> None:
        """Close this face's pool (after the batches under way). Idempotent."""
        if self._queue and self._queue_loop is asyncio.get_running_loop():
            self._flush()  # operations queued this iteration run first, on the pool
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


def _abandoned(task: asyncio.Task[Any]) -> None:
    """Retrieve what an abandoned operation ended with (nobody awaits it any more)."""
    if not task.cancelled():
        task.exception()


def _deliver(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    """Hand one operation's outcome to its caller (``value`` None with ``ok`` False: the batch
    was cancelled, and so is the caller's wait)."""
    if future.done():
        return
    if ok:
        future.set_result(value)
    elif value is None:
        future.cancel()
    else:
        future.set_exception(value)


class PostgresStore(SQLKeyStore):
    """The PostgreSQL store: :class:`~retrysafe.stores.KeyStore` on one database, and the
    :attr:`connector` the outbox, webhooks and agents keep their tables on.

    Concurrency contract: see :class:`~retrysafe.stores.KeyStore` — claims insert if absent or
    expired else return the existing record, fenced writes are compare-and-swap on the fencing
    token, tokens grow by one per claim or takeover of a key hash (a row is replaced in place,
    never deleted and re-inserted: ``release`` leaves a ``released`` tombstone that keeps the
    token; only ``purge_keys`` deletes rows, once their retention ended).

    Args:
        url: ``postgresql://user:password@host:port/database`` (or ``postgres://``); any libpq
            connection string works too.
        schema: the PostgreSQL schema holding retrysafe's tables (default ``"public"``);
            created with ``create=True``.
        create: create the tables if missing (default True); with False a database without
            them raises :class:`~retrysafe.SchemaError`.
        clock: ``"server"`` (default): leases and retention use the database server's clock
            and every ``now`` argument is ignored; ``"caller"``: the ``now`` arguments are
            used (tests).
        min_size, max_size: bounds of the connection pool (per face: sync and async).
        connect_timeout: seconds to wait for a connection (at startup and from the pool)
            before raising :class:`~retrysafe.StoreUnavailableError`.
        statement_timeout: seconds one statement may run, lock waits included, before it
            fails with :class:`~retrysafe.StoreUnavailableError` (default 10; PostgreSQL's
            ``statement_timeout``, sent when connecting; one in the URL's ``options`` wins;
            None: the server's own setting). It covers the statements of
            :meth:`transaction` and :meth:`begin_effect` too: pass None, or set your own in
            the URL, for long statements of your own there. The async face also stops
            waiting 5 s after it, for a network that swallows the server's answer. Schema
            creation and migration run without it.

    Raises:
        ConfigurationError: a malformed URL or schema name, bad pool sizes, clock or
            statement_timeout.
        StoreUnavailableError: the server cannot be reached or refuses the login; the message
            names host and port, never the password.
        SchemaError: the schema is missing (``create=False``) or newer than this release.
    """

    dialect = "postgresql"
    connector: PostgresConnector

    def __init__(self, url: str, **options: Unpack[PostgresOptions]) -> None:
        self.connector = PostgresConnector(url, **options)
        self.where = self.connector.where
        self.schema = self.connector.schema
        self.clock: Clock = self.connector.clock

    def __repr__(self) -> str:
        return f"PostgresStore({self.url!r})"

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self) -> Any:
        """A transaction on one pool connection (rollback on error); yields the
        :class:`psycopg.Connection` (transactional outbox: ``outbox.submit(...,
        connection=conn)``)."""
        return self.connector.transaction()

    def begin_effect(self) -> KeyEffect:
        """Open a transaction for a handler's own writes (SPEC §4 transactional mode): see
        :meth:`PostgresConnector.begin`."""
        return KeyEffect(self.connector.begin())

    def asyncio_key_store(self) -> AsyncSQLKeyStore:
        """A new :class:`~retrysafe.stores.AsyncKeyStore` face with group commit (see the
        module docstring): its own pool, bound to the event loop that first uses it; close it
        with ``aclose()``."""
        return AsyncSQLKeyStore(AsyncPostgresConnector(self.connector, group_commit=True))
