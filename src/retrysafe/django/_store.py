"""The idempotency-key store on Django's own database connection (SPEC §3, §4, §9).

:class:`DjangoConnector` is a :class:`~retrysafe.stores._connector.Connector` that runs the key
store's named SQL (``stores/sql/keys.<dialect>.sql``, the very statements ``SQLiteStore`` and
``PostgresStore`` run) on the driver connection under ``django.db.connections[alias]`` of the
calling thread. So the keys live in the application's database, and a statement run inside an
open ``transaction.atomic()`` belongs to that transaction: in transactional mode the key is
completed in the view's transaction, fenced by the request's token, and commits or rolls back
with the view's own writes.

Django gives every thread its own connection. The request thread's connection is Django's to
open and close (``CONN_MAX_AGE``); work on other threads (the lease's heartbeat, a record
retried in the background) runs inside :meth:`DjangoConnector.borrowed`, which closes the
connection that thread opened when it ends.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils.connection import ConnectionDoesNotExist

from retrysafe._exceptions import (
    ConfigurationError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.stores._connector import Clock, Op
from retrysafe.stores._keys import KeyEffect, SQLKeyStore
from retrysafe.stores._schema import Migration

__all__ = ["DeferredStore", "DjangoConnector", "DjangoStore", "create_schema", "drop_schema"]

_T = TypeVar("_T")

#: Django's ``connection.vendor`` → the dialect of the statement files.
_DIALECTS = {"sqlite": "sqlite", "postgresql": "postgres"}
_SUPPORTED = "SQLite (django.db.backends.sqlite3) and PostgreSQL with psycopg 3"
_MIGRATE_HINT = "run `python manage.py migrate retrysafe`"


def _dialect(alias: str) -> str:
    """The statement dialect of database ``alias``.

    Raises:
        ConfigurationError: no such alias, a vendor other than SQLite or PostgreSQL, or
            PostgreSQL through psycopg2 (the statements are psycopg 3's).
    """
    try:
        conn = connections[alias]
    except ConnectionDoesNotExist as exc:
        raise ConfigurationError(
            f"DATABASES has no database {alias!r} (configured: "
            f"{', '.join(sorted(connections.settings)) or 'none'})",
            option="STORE",
        ) from exc
    dialect = _DIALECTS.get(conn.vendor)
    if dialect is None:
        raise ConfigurationError(
            f"database {alias!r} is {conn.vendor} ({conn.settings_dict.get('ENGINE')}); the "
            f"retrysafe key store on Django's database supports {_SUPPORTED}",
            option="STORE",
        )
    if dialect == "postgres":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            raise ConfigurationError(
                f"database {alias!r} uses psycopg2; the retrysafe key store on Django's "
                "database needs psycopg 3 (pip install 'psycopg[binary]'; Django >= 4.2 "
                "prefers it when both are installed)",
                option="STORE",
            )
    return dialect


class DjangoConnector:
    """Named SQL on one Django database (a sync
    :class:`~retrysafe.stores._connector.Connector`).

    Args:
        alias: the ``DATABASES`` alias (default ``"default"``).

    Raises:
        ConfigurationError: see :func:`_dialect`.
    """

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.alias = alias
        self.dialect = _dialect(alias)
        #: SQLite compares times on the caller's clock; PostgreSQL on the server's, so every
        #: replica of the app agrees (the statement files' NULL ``now``).
        self.clock: Clock = "caller" if self.dialect == "sqlite" else "server"
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"DjangoConnector({self.alias!r})"

    @property
    def url(self) -> str:
        """How messages name the store (no password): ``django:<alias> (<vendor> <name>)``."""
        conn = connections[self.alias]
        return f"django:{self.alias} ({conn.vendor} {conn.settings_dict.get('NAME')})"

    @property
    def database(self) -> tuple[str, ...]:
        conn = connections[self.alias]
        s = conn.settings_dict
        return ("django", conn.vendor, str(s.get("HOST")), str(s.get("PORT")), str(s.get("NAME")))

    # ------------------------------------------------------------------ errors
    def translate(self, exc: Exception) -> StoreError:
        """The store's error for a driver (or Django) error: unavailable, no schema, or a
        failure, by the dialect's own translation; the password never appears (drivers do
        not put it in messages); a missing table says which ``migrate`` to run."""
        if isinstance(exc, StoreError):
            return exc
        url = self.url
        hint = _MIGRATE_HINT
        if self.alias != DEFAULT_DB_ALIAS:
            hint = f"{_MIGRATE_HINT[:-1]} --database {self.alias}`"
        if self.dialect == "postgres":
            from retrysafe.stores._postgres import translate_error

            inner = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            return translate_error(
                inner,
                where=url,
                url=url,
                password=None,
                no_schema=f"store {url} has no retrysafe schema: {{msg}} ({hint})",
            )
        from retrysafe.stores._sqlite import _translate

        cause = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
        if not isinstance(cause, sqlite3.Error):
            return StoreError(f"store {url} failed: {exc}", store=url)
        err = _translate(cause, url)
        if isinstance(err, SchemaError):
            err = SchemaError(f"{err.args[0].split(' (run ')[0]} ({hint})", store=url)
        return err

    @contextmanager
    def _errors(self) -> Iterator[None]:
        from django.db import Error as DjangoError

        try:
            yield
        except StoreError:
            raise
        except (DjangoError, sqlite3.Error) as exc:
            self._failed()
            raise self.translate(exc) from exc
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):
                self._failed()
                raise self.translate(exc) from exc
            raise

    def _failed(self) -> None:
        """A driver error on Django's connection, which Django did not see (the statement ran
        on the driver connection): mark it as Django marks its own errors, and close it now
        when it is broken and no transaction is open, so the next operation (and Django's
        own next query) reconnects instead of failing on a dead connection until
        ``CONN_MAX_AGE`` ends."""
        conn = connections[self.alias]
        conn.errors_occurred = True
        if not conn.in_atomic_block:
            with suppress(Exception):
                if not conn.is_usable():
                    conn.close()

    def _raw(self) -> Any:
        """This thread's driver connection, opened if needed, after Django's health check
        (``CONN_HEALTH_CHECKS``) as Django runs it before its own first query on a reused
        connection."""
        conn = connections[self.alias]
        if not conn.in_atomic_block:
            conn.close_if_health_check_failed()
        conn.ensure_connection()
        return conn.connection

    # ------------------------------------------------------------------ Connector
    def run(self, op: Op[_T], *, atomic: bool = False, connection: Any = None) -> _T:
        """Drive ``op`` on this thread's connection of the database, joining the transaction
        Django has open there (``atomic=True``: in a savepoint of it, or a transaction of its
        own outside one). ``connection`` must be that same connection, if given.

        Raises:
            ConfigurationError: ``connection`` is another connection.
            StoreUnavailableError / SchemaError / StoreError: translated driver errors.
        """
        with self._errors():
            raw = self._raw()
            if connection is not None and connection is not raw:
                raise ConfigurationError(
                    "connection= must be this thread's connection of Django's database "
                    f"{self.alias!r}",
                    option="connection",
                )
            if self.dialect == "sqlite":
                from retrysafe.stores._sqlite import _drive

                # Outside Django's transaction every operation runs in BEGIN IMMEDIATE: a
                # plain statement would read first (a SHARED lock) and then need the write
                # lock, and under Django's default rollback journal SQLite answers such an
                # upgrade "database is locked" at once, without waiting its timeout, while
                # a view's transaction commits.
                return _drive(raw, op, atomic or not raw.in_transaction)
            from retrysafe.stores._postgres import _drive_sync

            return _drive_sync(raw, op, atomic)

    def begin(self) -> DjangoTransaction:
        """Enter ``transaction.atomic(using=alias)`` on this thread's connection: the
        transaction of a view's effect (transactional mode). End it on this same thread.

        Raises:
            StoreUnavailableError: the database cannot be reached.
        """
        return DjangoTransaction(self)

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """``transaction.atomic(using=alias)``, yielding the driver connection."""
        with transaction.atomic(using=self.alias), self._errors():
            yield self._raw()

    @contextmanager
    def borrowed(self) -> Iterator[None]:
        """Work on a thread that is not Django's request thread: the connection this thread
        opens inside is closed at the end (Django closes only request threads' connections)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with suppress(Exception):
                    connections[self.alias].close()

    def async_connector(self) -> Any:
        raise ConfigurationError(
            "the key store on Django's database is sync only: under ASGI the retrysafe "
            "Django middleware runs it in Django's thread (sync_to_async)",
            option="STORE",
        )

    def may_have_written(self, exc: StoreUnavailableError) -> bool:
        """Never on SQLite (it commits in this process); on a server, possibly (Django's
        errors do not tell whether the statement went out)."""
        return self.dialect != "sqlite"

    def close(self) -> None:
        """Nothing to close: the connections are Django's."""


class DjangoTransaction:
    """One ``transaction.atomic()`` block on this thread's connection, opened by the
    middleware around a view (a :class:`~retrysafe.stores._connector.Transaction`).

    Attributes:
        connection: the driver connection (``sqlite3`` or ``psycopg``) Django writes with.
        holds_write_lock: SQLite: True, the transaction takes the database's write lock as
            it opens (a write that changes nothing), so no one can take the key over until
            it ends and the middleware need not renew the lease (renewals from other
            connections would only wait for that lock). PostgreSQL: False (row locks; the
            lease is renewed).
    """

    holds_write_lock = False

    def __init__(self, connector: DjangoConnector) -> None:
        self._connector = connector
        self.clock = connector.clock
        self._thread = threading.get_ident()
        self._atomic = transaction.atomic(using=connector.alias)
        with connector._errors():
            self._atomic.__enter__()
            try:
                self.connection = connector._raw()
                if connector.dialect == "sqlite":
                    # Deferred BEGIN takes the write lock only at the view's first write;
                    # take it now, so the whole view runs under it (see holds_write_lock).
                    self.connection.execute("UPDATE idempotency_keys SET state = state WHERE 0")
                    self.holds_write_lock = True
            except BaseException:
                self._exit(rollback=True)
                raise
        self._done = False

    def run(self, op: Op[_T]) -> _T:
        """Drive ``op`` inside this transaction (not yet committed)."""
        return self._connector.run(op)

    def _exit(self, *, rollback: bool) -> None:
        alias = self._connector.alias
        if rollback:
            with suppress(Exception):
                transaction.set_rollback(True, using=alias)
        self._atomic.__exit__(None, None, None)

    def commit(self) -> None:
        """Leave the atomic block: COMMIT (or RELEASE SAVEPOINT inside an outer one).

        Raises:
            StoreUnavailableError / StoreError: the COMMIT failed (nothing was written).
        """
        if self._done:
            return
        self._done = True
        with self._connector._errors():
            self._exit(rollback=False)

    def rollback(self) -> None:
        """Leave the atomic block rolling it back. Idempotent; never raises."""
        if self._done:
            return
        self._done = True
        with suppress(Exception):
            self._exit(rollback=True)


class DjangoStore(SQLKeyStore):
    """The idempotency-key store in Django's own database: a sync
    :class:`~retrysafe.stores.KeyStore` (and ``KeyAdmin`` for ``manage.py retrysafe_keys``)
    whose statements run on the calling thread's connection of ``DATABASES[alias]``.

    Its tables are created by the ``retrysafe.django`` app's migration (``python manage.py
    migrate retrysafe``); they are the tables ``SQLiteStore`` / ``PostgresStore`` use, so
    ``retrysafe keys --store sqlite:///db.sqlite3`` reads the same keys.

    Args:
        alias: the ``DATABASES`` alias (default ``"default"``).

    Raises:
        ConfigurationError: no such alias; a database other than SQLite or PostgreSQL with
            psycopg 3.
    """

    connector: DjangoConnector

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        super().__init__(DjangoConnector(alias))

    def __repr__(self) -> str:
        return f"DjangoStore({self.connector.alias!r})"

    def begin_effect(self) -> KeyEffect:
        """Open the view's transaction (``transaction.atomic``) for transactional mode: the
        key is completed inside it, with the view's writes (SPEC §4)."""
        return KeyEffect(self.connector.begin())

    def asyncio_key_store(self) -> Any:
        return self.connector.async_connector()


class DeferredStore:
    """A store URL that could not be reached when the middleware was built: a sync
    :class:`~retrysafe.stores.KeyStore` that opens the store on first use. Until it can, each
    operation raises :class:`~retrysafe.StoreUnavailableError` (the middleware answers 503,
    or runs unprotected with ``FAIL_OPEN``); a new attempt to open is made at most once per
    ``retry_every`` seconds.
    """

    def __init__(self, url: str, *, retry_every: float = 1.0) -> None:
        self.url = url
        self.retry_every = retry_every
        self._store: Any = None
        self._error: StoreUnavailableError | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        from retrysafe.stores._url_check import redact_url

        return f"DeferredStore({redact_url(self.url)!r})"

    def _opened(self) -> Any:
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is None:
                now = time.monotonic()
                if now < self._next_try and self._error is not None:
                    raise self._error
                self._next_try = now + self.retry_every
                from retrysafe.stores import open_store

                try:
                    self._store = open_store(self.url)
                except StoreUnavailableError as exc:
                    self._error = exc
                    raise
            return self._store

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().claim(*args, **kwargs)

    def take_over(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().take_over(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().complete(*args, **kwargs)

    def release(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().release(*args, **kwargs)

    def extend_lease(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().extend_lease(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().get(*args, **kwargs)

    def purge_keys(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().purge_keys(*args, **kwargs)

    def list_keys(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().list_keys(*args, **kwargs)

    def find_keys(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().find_keys(*args, **kwargs)

    def evict(self, *args: Any, **kwargs: Any) -> Any:
        return self._opened().evict(*args, **kwargs)

    def close(self) -> None:
        """Close the store if it was opened. Idempotent."""
        store, self._store = self._store, None
        if store is not None:
            store.close()


# ---------------------------------------------------------------------- migrations
def create_schema(connection: Any) -> Migration:
    """Create (or upgrade) retrysafe's tables on a Django connection — the migration of the
    ``retrysafe.django`` app. The same layout as ``retrysafe migrate`` writes (keys, outbox,
    webhooks, agent runs), in the connection's database (PostgreSQL: its current schema).

    Raises:
        ConfigurationError: not SQLite or PostgreSQL with psycopg 3.
        SchemaError: the database holds a schema from a newer retrysafe.
    """
    dialect = _dialect(connection.alias)
    connection.ensure_connection()
    raw = connection.connection
    where = f"Django database {connection.alias!r}"
    if dialect == "sqlite":
        from retrysafe.stores._sqlite import ensure_schema

        return ensure_schema(raw, where=where, create=True)
    from retrysafe.stores._postgres import ensure_schema as ensure_pg

    row = raw.execute("SELECT current_schema()").fetchone()
    if row is None or row[0] is None:
        raise ConfigurationError(
            f"{where} has no current schema (its search_path names no existing schema)",
            option="STORE",
        )
    return ensure_pg(raw, where=where, schema=str(row[0]), create=True)


def drop_schema(connection: Any) -> None:
    """Drop retrysafe's tables from a Django connection (the migration's reverse)."""
    dialect = _dialect(connection.alias)
    if dialect == "sqlite":
        from retrysafe.stores._sqlite import _TABLES as sqlite_tables

        names = sqlite_tables
    else:
        from retrysafe.stores._postgres import _TABLES as pg_tables

        names = pg_tables
    with connection.cursor() as cursor:
        for table in (*reversed(names), "retrysafe_meta"):
            cursor.execute(f"DROP TABLE IF EXISTS {connection.ops.quote_name(table)}")
