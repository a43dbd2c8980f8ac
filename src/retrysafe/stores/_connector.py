"""Connectors: run named SQL statements for one dialect, and nothing about keys, jobs or webhooks.

A feature store (idempotency keys here, the outbox in :mod:`retrysafe.client`, webhooks in
:mod:`retrysafe.webhooks`, agent runs in :mod:`retrysafe.agents`) is written once for both
dialects as *operations*: generators that yield :class:`Exec` requests (a named
:class:`Statement`, its parameters, and what to fetch) and receive each result, like the server
engine's generator of store operations. A connector drives an operation on one connection:

- :class:`Connector` (sync): ``run(op)`` on this thread's connection (SQLite) or one pool
  connection (PostgreSQL), or on the connection of an open ``transaction()``;
- :class:`AsyncConnector`: ``await run(op)`` without blocking the event loop.

``atomic=True`` runs the whole operation in one transaction (a savepoint inside an open one).
A statement's SQL lives in ``<package>/sql/<feature>.<dialect>.sql`` as ``-- name: <name>``
blocks; both dialects' files hold the same names with the same parameter names. A block of
several ``;``-separated statements runs them in order in one transaction and returns the first
one's result (SQLite has no writable CTE, so a PostgreSQL one-statement write can be two there).

Driver errors are translated in one place per dialect: "cannot serve now" →
:class:`~retrysafe.StoreUnavailableError`, a missing table → :class:`~retrysafe.SchemaError`,
anything else → :class:`~retrysafe.StoreError`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractContextManager, contextmanager
from functools import cache, partial
from importlib import resources
from typing import (
    Any,
    Concatenate,
    Literal,
    NamedTuple,
    ParamSpec,
    Protocol,
    TypeVar,
    runtime_checkable,
)

from retrysafe._exceptions import ConfigurationError, StoreUnavailableError

__all__ = [
    "AsyncConnector",
    "Clock",
    "Connector",
    "Exec",
    "HasConnector",
    "JsonText",
    "OnAsyncConnector",
    "OnConnector",
    "Op",
    "Statement",
    "Statements",
    "Transaction",
    "Transactions",
    "adrive",
    "all_rows",
    "async_op",
    "count",
    "drive",
    "feature_store",
    "one",
    "split_statements",
    "sync_op",
]

_T = TypeVar("_T")
_R = TypeVar("_R")
_P = ParamSpec("_P")

#: ``"caller"``: every ``now`` argument is the time (SQLite; tests on PostgreSQL);
#: ``"server"``: PostgreSQL measures time on the database server's clock and ``now`` is NULL.
Clock = Literal["server", "caller"]
Fetch = Literal["one", "all", "count"]

DIALECTS = ("sqlite", "postgres")
_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


class Statement:
    """One named statement, in every dialect: ``parts[dialect]`` is a tuple of SQL texts (``str``
    for SQLite, ``bytes`` for psycopg), one per ``;``-separated statement of the block.

    ``each[dialect]``: the parameter a block marked ``-- each: NAME`` runs once per element of
    there (a list of mappings, each the parameters of one run; ``"all"`` returns the rows of
    every run's first statement, ``"count"`` their total), or None. A batch one dialect
    takes in one statement (PostgreSQL: ``jsonb_to_recordset``) can so be plain statements
    per row in another (SQLite, where taking JSON apart costs more than the rows' writes);
    the operation passes both forms.

    ``lenient``: the rows it returns go to a converter that checks every value (a job's:
    :func:`~retrysafe.client._store.job_from_row`), so a text value that is no UTF-8 (SQLite
    stores whatever bytes it is given as TEXT) comes back as ``bytes`` for the converter to
    report, instead of failing the statement after its writes (a claim's leases) were made.
    """

    __slots__ = ("each", "lenient", "name", "parts")

    def __init__(
        self,
        name: str,
        parts: dict[str, tuple[Any, ...]],
        each: dict[str, str | None] | None = None,
        *,
        lenient: bool = False,
    ) -> None:
        self.name = name
        self.parts = parts
        self.each = each or dict.fromkeys(parts)
        self.lenient = lenient

    def __repr__(self) -> str:
        return f"Statement({self.name!r})"


class Statements:
    """The named statements of one feature: ``<package>/sql/<feature>.<dialect>.sql``.

    Args:
        columns: column lists by name, substituted for ``{name}`` in every statement of both
            dialects (``RETURNING {job_columns}``): the order a row converter reads lives in
            one place, beside the converter.
        reads: per dialect, the SQL that reads a column of those lists where it is not the
            column itself (SQLite reads a large job body from a table of its own:
            :data:`~retrysafe.client._store.JOB_READS`).
        lenient: the names of ``columns`` whose rows a converter checks value by value: the
            statements that name one are :attr:`Statement.lenient`.

    Raises:
        RuntimeError: (at import) the dialects' files name different statements, or a
            statement names a column list that was not given — packaging bugs, never a user
            error.
    """

    def __init__(
        self,
        package: str,
        feature: str,
        *,
        columns: Mapping[str, Sequence[str]] | None = None,
        reads: Mapping[str, Mapping[str, str]] | None = None,
        lenient: Sequence[str] = (),
    ) -> None:
        self.feature = feature
        lists = {
            d: {
                f"{{{name}}}": ", ".join((reads or {}).get(d, {}).get(c, c) for c in cols)
                for name, cols in (columns or {}).items()
            }
            for d in DIALECTS
        }
        texts = {d: _load(package, f"sql/{feature}.{d}.sql") for d in DIALECTS}
        names = set(texts["sqlite"])
        if names != set(texts["postgres"]):
            odd = sorted(names ^ set(texts["postgres"]))
            raise RuntimeError(f"{feature}: statements {odd} exist in one dialect only")

        def parts(dialect: str, name: str) -> list[str]:
            text = texts[dialect][name]
            for placeholder, cols in lists[dialect].items():
                text = text.replace(placeholder, cols)
            unknown = _PLACEHOLDER.search(text)
            if unknown:
                raise RuntimeError(f"{feature}.{name}: no column list {unknown.group(0)}")
            return split_statements(text)

        each = {d: _each(package, f"sql/{feature}.{d}.sql") for d in DIALECTS}
        self._by_name = {
            name: Statement(
                f"{feature}.{name}",
                {
                    "sqlite": tuple(parts("sqlite", name)),
                    "postgres": tuple(p.encode() for p in parts("postgres", name)),
                },
                {d: each[d].get(name) for d in DIALECTS},
                lenient=any(f"{{{c}}}" in texts["sqlite"][name] for c in lenient),
            )
            for name in names
        }

    def __getitem__(self, name: str) -> Statement:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name


_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")


@cache
def _blocks(package: str, path: str) -> dict[str, str]:
    """The ``-- name:`` blocks of one SQL file, by name, as written (comments included)."""
    text = resources.files(package).joinpath(path).read_text("utf-8")
    parts = _NAME.split(text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


#: A block of no SQL whose statement is another block's (``-- as: add_job``): a name one
#: dialect needs for a rule of its own, the other dialect's statement being its plain one.
_AS = re.compile(r"^--\s*as:\s*(\w+)\s*$", re.MULTILINE)


def _load(package: str, path: str) -> dict[str, str]:
    """Each block's SQL, comment lines dropped (a block ``-- as: NAME``: NAME's SQL).

    Raises:
        RuntimeError: (at import) a block ``-- as:`` that has SQL of its own or names no
            block — a packaging bug.
    """
    blocks = _blocks(package, path)
    out: dict[str, str] = {}
    for name, body in blocks.items():
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        out[name] = "\n".join(lines).strip()
    for name, body in blocks.items():
        same = _AS.search(body)
        if same is not None:
            if out[name] or not out.get(same.group(1)):
                raise RuntimeError(f"{path}: block {name} is `as: {same.group(1)}` and is not")
            out[name] = out[same.group(1)]
    return out


_EACH = re.compile(r"^--\s*each:\s*(\w+)\s*$", re.MULTILINE)


def _each(package: str, path: str) -> dict[str, str]:
    """The ``-- each: NAME`` line of each block that has one (see :class:`Statement`)."""
    found: dict[str, str] = {}
    for name, body in _blocks(package, path).items():
        match = _EACH.search(body)
        if match:
            found[name] = match.group(1)
    return found


_END = re.compile(r";[ \t]*(?:\n|$)")


def split_statements(block: str) -> list[str]:
    """The statements of a block: each ends with ``;`` at the end of a line (so a ``;`` inside
    a string literal or mid-line stays part of its statement)."""
    return [part.strip() for part in _END.split(block) if part.strip()]


class JsonText:
    """A parameter sent as the JSON text of ``value``, written only by a dialect whose
    statement binds it (PostgreSQL's connector registers it with psycopg): an operation can
    pass a batch both as JSON and as rows (a block marked ``-- each:``) and SQLite, which
    binds only the rows, never serialises it. ``str()`` gives the text too."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return json.dumps(self.value)

    def __repr__(self) -> str:
        return f"JsonText({self.value!r})"


class Exec(NamedTuple):
    """One request of an operation: run ``statement`` with ``params``; the connector sends back
    the first row (``"one"``: a tuple or None), every row (``"all"``: a list of tuples) or the
    number of rows changed (``"count"``)."""

    statement: Statement
    params: Mapping[str, Any]
    fetch: Fetch


#: An operation: yields :class:`Exec` requests, receives each result, returns its value.
Op = Generator[Exec, Any, _T]


def one(statement: Statement, params: Mapping[str, Any]) -> Exec:
    return Exec(statement, params, "one")


def all_rows(statement: Statement, params: Mapping[str, Any]) -> Exec:
    return Exec(statement, params, "all")


def count(statement: Statement, params: Mapping[str, Any]) -> Exec:
    return Exec(statement, params, "count")


def drive(op: Generator[_R, Any, _T], execute: Callable[[_R], Any]) -> _T:
    """Run ``op`` to its end, answering each request with ``execute(request)``. An exception
    from ``execute`` is thrown into the operation (it may handle it) and, if not handled,
    propagates. Requests are :class:`Exec` for the SQL connectors; the Redis key store drives
    its own requests (script calls) with the same two functions. (A plain loop: it runs for
    every statement of every store, so it allocates nothing per step.)"""
    try:
        request = op.send(None)
        while True:
            try:
                value = execute(request)
            except Exception as exc:
                request = op.throw(exc)
            else:
                request = op.send(value)
    except StopIteration as stop:
        result: _T = stop.value
        return result


async def adrive(op: Generator[_R, Any, _T], execute: Callable[[_R], Awaitable[Any]]) -> _T:
    """:func:`drive` with an async ``execute``."""
    try:
        request = op.send(None)
        while True:
            try:
                value = await execute(request)
            except Exception as exc:
                request = op.throw(exc)
            else:
                request = op.send(value)
    except StopIteration as stop:
        result: _T = stop.value
        return result


class Transaction(Protocol):
    """One open transaction on one connection (from :meth:`Connector.begin`).

    Attributes:
        connection: the driver connection (``sqlite3`` or ``psycopg``) the application writes
            with; never commit it yourself.
        clock: the connector's clock.
        holds_write_lock: whether the open transaction keeps every other writer out (SQLite).
    """

    connection: Any
    clock: Clock
    holds_write_lock: bool

    def run(self, op: Op[_T]) -> _T:
        """Drive ``op`` inside this transaction (not yet committed)."""
        ...

    def commit(self) -> None: ...

    def rollback(self) -> None:
        """Idempotent; never raises."""
        ...


# Every open transaction of the process, by driver connection: a connection opened by one
# store object is accepted by another object on the same database (``Outbox(url)`` beside
# ``SQLiteStore(path).transaction()``), never by a store on another database.
_OPEN: dict[int, Any] = {}
_OPEN_LOCK = threading.Lock()


class Transactions:
    """The open transactions of sync connectors, by driver connection: how ``run(op,
    connection=…)`` finds the transaction a connection belongs to, and refuses one that is not
    an open transaction on this connector's database (another database's, one that ended, or no
    connection at all). Subclasses implement :meth:`begin` and :attr:`database`."""

    @property
    def url(self) -> str:
        raise NotImplementedError

    @property
    def database(self) -> tuple[str, ...]:
        """What names this connector's database: two connectors with the same value write the
        same tables (SQLite: the resolved file; PostgreSQL: server, database and schema)."""
        raise NotImplementedError

    def begin(self) -> Any:
        raise NotImplementedError

    def opened(self, tx: _T) -> _T:
        with _OPEN_LOCK:
            _OPEN[id(tx.connection)] = tx  # type: ignore[attr-defined]
        return tx

    def ended(self, tx: Any) -> None:
        key = id(tx.connection)
        with _OPEN_LOCK:
            if _OPEN.get(key) is tx:
                del _OPEN[key]

    def transaction_of(self, connection: Any) -> Any:
        """The open transaction whose driver connection ``connection`` is.

        Raises:
            ConfigurationError: it is not an open transaction on this store's database.
        """
        tx: Any = _OPEN.get(id(connection))
        if tx is None or tx.connection is not connection:
            raise ConfigurationError(
                f"connection= must be the connection of an open store.transaction() on "
                f"{self.url}; got a {type(connection).__name__} that is not one (its block "
                "ended, or it never came from store.transaction())",
                option="connection",
            )
        if tx.database != self.database:
            raise ConfigurationError(
                f"connection= is an open transaction on {tx.url}, not on {self.url}: a job "
                "must commit in the database that holds it (open the outbox on the same store)",
                option="connection",
            )
        return tx

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A transaction on a connection of its own (see :meth:`begin`): yields the driver
        connection; commits when the block ends, rolls back if it raises."""
        tx = self.begin()
        try:
            yield tx.connection
        except BaseException:
            tx.rollback()
            raise
        tx.commit()


class Connector(Protocol):
    """The sync face of one database (see the module docstring).

    Attributes:
        dialect: ``"sqlite"`` or ``"postgres"``: which statement texts it runs.
        clock: ``"caller"`` or ``"server"`` (see :data:`Clock`).
        url: the store's URL, without a password (for messages).
    """

    dialect: str
    clock: Clock

    @property
    def url(self) -> str: ...

    def run(self, op: Op[_T], *, atomic: bool = False, connection: Any = None) -> _T:
        """Drive ``op`` on one connection; ``connection``: the driver connection of one of this
        connector's open :meth:`transaction` blocks (the op joins that transaction).

        Raises:
            ConfigurationError: ``connection`` is not an open transaction of this connector.
            StoreUnavailableError / SchemaError / StoreError: translated driver errors.
        """
        ...

    def begin(self) -> Transaction:
        """Open a transaction on a connection of its own (end it with ``commit()`` or
        ``rollback()``).

        Raises:
            StoreUnavailableError: no connection (or, SQLite, no write lock) in time.
            StoreError: the connector is closed.
        """
        ...

    def transaction(self) -> AbstractContextManager[Any]:
        """A transaction on one connection: yields the driver connection (``sqlite3`` or
        ``psycopg``) for the application's own writes; commits at the end of the block, rolls
        back if it raises. Pass that connection as ``connection=`` to join it."""
        ...

    def async_connector(self) -> AsyncConnector:
        """A new async face of the same database (its own connection or pool)."""
        ...

    def may_have_written(self, exc: StoreUnavailableError) -> bool:
        """Whether a write that raised ``exc`` may have been committed all the same (its
        answer lost on the way back), so that its outcome is unknown: never on SQLite, which
        commits in this process (a write that raised was rolled back); on a server, unless
        nothing was sent (no connection in time, a server that only reads)."""
        ...

    def close(self) -> None: ...


class NeedsWrite:
    """The type of :data:`NEEDS_WRITE`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEEDS_WRITE"


#: What an operation's read-only form (``when_locked``, see :class:`AsyncConnector`) returns
#: when reading cannot answer: the operation itself has to run, and write.
NEEDS_WRITE = NeedsWrite()


class AsyncConnector(Protocol):
    """The async face: the same operations, never blocking the event loop.

    ``skippable=True``: the operation may be dropped, unrun, once its caller was cancelled
    (claims and reads: nobody would use the result). Writes that finish or give up a claim are
    never skippable.

    ``when_locked``: a read-only form of the operation, for a store whose writers wait for
    one another (SQLite's write lock; other stores ignore it): it returns what the operation
    would return, or :data:`NEEDS_WRITE` when only the operation itself can say. An
    operation that met another process's write lock runs it at once, and waits for the lock
    only on ``NEEDS_WRITE``: a replay's claim finds its completed record by reading, and WAL
    readers never wait for the writer.
    """

    dialect: str
    clock: Clock

    @property
    def url(self) -> str: ...

    async def run(
        self,
        op: Callable[[], Op[_T]],
        *,
        atomic: bool = False,
        skippable: bool = False,
        when_locked: Callable[[], Op[Any]] | None = None,
    ) -> _T:
        """Drive the operation ``op()`` creates. ``op`` may be called again when a run failed
        without effect (SQLite: the inline attempt found the database locked and the operation
        restarts in a worker thread), so it must only create the generator."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class HasConnector(Protocol):
    """A store built on a SQL connector (``SQLiteStore``, ``PostgresStore``): every feature
    store (outbox, webhooks, agents) can be opened on its ``connector``."""

    @property
    def connector(self) -> Connector: ...


class _HasAsyncConnector(Protocol):
    @property
    def connector(self) -> AsyncConnector: ...


def sync_op(
    fn: Callable[Concatenate[Clock, _P], Op[_T]], *, atomic: bool = False
) -> Callable[Concatenate[HasConnector, _P], _T]:
    """A sync store method from an operation function ``fn(clock, *args, **kwargs)``."""

    def method(self: HasConnector, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        c = self.connector
        return c.run(fn(c.clock, *args, **kwargs), atomic=atomic)

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


def async_op(
    fn: Callable[Concatenate[Clock, _P], Op[_T]],
    *,
    atomic: bool = False,
    skippable: bool = False,
    when_locked: Callable[Concatenate[Clock, _P], Op[Any]] | None = None,
) -> Callable[Concatenate[_HasAsyncConnector, _P], Coroutine[Any, Any, _T]]:
    """An async store method from the same operation function (see :func:`sync_op`);
    ``when_locked``, with the same arguments: see :class:`AsyncConnector`."""

    if when_locked is None:

        async def method(self: _HasAsyncConnector, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
            c = self.connector
            # A partial, not a lambda: one object per call instead of a function and its cells.
            op = partial(fn, c.clock, *args, **kwargs)
            return await c.run(op, atomic=atomic, skippable=skippable)

    else:
        locked = when_locked

        async def method(self: _HasAsyncConnector, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
            c = self.connector
            op = partial(fn, c.clock, *args, **kwargs)
            return await c.run(
                op,
                atomic=atomic,
                skippable=skippable,
                # Made only if the store needs it: a lambda costs less than a second partial.
                when_locked=lambda: locked(*op.args, **op.keywords),
            )

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


class OnConnector:
    """The base of a feature store on a sync :class:`Connector` (keys, outbox, webhooks,
    agents): holds it and names it. It does not own it: the store it came from closes it."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def url(self) -> str:
        return self.connector.url


class OnAsyncConnector:
    """The base of a feature store's async face: holds its own :class:`AsyncConnector` (a
    connection or pool of its own) and closes it with :meth:`aclose`."""

    def __init__(self, connector: AsyncConnector) -> None:
        self.connector = connector

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.connector.url!r})"

    async def aclose(self) -> None:
        """Close this face's connection or pool. Idempotent."""
        await self.connector.aclose()


def feature_store(
    store: object, protocol: type[Any], factory: Callable[[Connector], _T], refusal: str
) -> Any:
    """The one rule for opening a feature's store on ``store``: ``store`` itself when it
    already implements the feature's ``protocol`` (a runtime-checkable Protocol), else
    ``factory(store.connector)`` for a SQL store (``SQLiteStore``, ``PostgresStore``).

    Raises:
        ConfigurationError: neither (a key store such as ``RedisStore`` or ``MemoryStore``):
            "``<store> <refusal>``".
    """
    if isinstance(store, protocol):
        return store
    if isinstance(store, HasConnector):
        return factory(store.connector)
    raise ConfigurationError(f"{store!r} {refusal}", option="store")


def caller_now(clock: Clock, now: float) -> float | None:
    """The ``now`` parameter of a statement: the caller's time, or NULL (the server's clock)."""
    return now if clock == "caller" else None


def caller_time(clock: Clock, at: float, now: float) -> dict[str, float | None]:
    """A time the caller computed on its own clock, as the ``<x>_at`` / ``<x>_in`` pair: the
    absolute time (NULL on the server's clock) and its offset from the caller's now, which a
    server-clock statement adds to the server's now (so hosts whose clocks drift agree)."""
    return {"at": at if clock == "caller" else None, "in": at - now}


def before_user_write(store: object) -> None:
    """Before a write someone asked for (a submit, a send, a console action): a SQLite
    store's connections compare their file with its path at their next use, whatever the
    time since the last comparison, so a file deleted a moment ago is a
    ``StoreUnavailableError``, never a write into the unlinked file that no one will read
    (:meth:`~retrysafe.stores._sqlite.SQLiteConnector.replaced`). Other stores: nothing."""
    recheck = getattr(getattr(store, "connector", None), "recheck_files", None)
    if recheck is not None:
        recheck()


def may_have_written(store: object, exc: StoreUnavailableError) -> bool:
    """Whether a write of ``store`` that raised ``exc`` may have been committed all the same
    (:meth:`Connector.may_have_written`); a store without a connector (one of your own):
    possibly."""
    connector = getattr(store, "connector", None)
    return connector is None or bool(connector.may_have_written(exc))
