"""The PostgreSQL key store: many API replicas sharing one database (SPEC §9).

Every primitive is one statement: a claim is ``INSERT … ON CONFLICT (key_hash) DO UPDATE …
WHERE expires_at <= now OR state = 'released' RETURNING``, every fenced write an ``UPDATE``
guarded by the fencing token, so PostgreSQL's row locks make each of them atomic across
processes and hosts.
All SQL lives in ``sql/postgres.sql``.

Clock: by default (``clock="server"``) leases and retention are measured on the **database
server's clock** — the ``now`` argument of every method is ignored and the statement uses
``extract(epoch FROM statement_timestamp())`` — so replicas whose clocks drift apart still agree
on when a lease or a key expired. ``clock="caller"`` honours the ``now`` argument instead (the
contract tests drive time by hand with it; the semantics are otherwise identical).

psycopg and psycopg-pool are imported only when this module is (``pip install
retrysafe[postgres]``); ``import retrysafe`` never imports them.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, Literal

import psycopg
import psycopg_pool
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from retrysafe._exceptions import ConfigurationError, SchemaError, StoreError, StoreUnavailableError
from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._postgres_agents import PostgresAgentsMixin
from retrysafe.stores._postgres_outbox import PostgresOutboxMixin
from retrysafe.stores._sql import queries
from retrysafe.stores._url_check import check_postgres_url

__all__ = ["SCHEMA_VERSION", "PostgresEffect", "PostgresStore"]

#: The schema version this release writes and understands.
SCHEMA_VERSION = 1

# bytes: psycopg accepts them as queries, and they are not LiteralString-checked.
_Q: dict[str, bytes] = {name: q.encode() for name, q in queries("postgres").items()}
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_STATES = {state.value: state for state in KeyState}
_CLAIM_TRIES = 8

Clock = Literal["server", "caller"]


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


def _complete_params(
    key_hash: str, token: int, response: StoredResponse, now: float | None, retention: float
) -> dict[str, Any]:
    return {
        "key_hash": key_hash,
        "token": token,
        "status": response.status,
        "headers": json.dumps([list(p) for p in response.headers]),
        "body": response.body,
        "replayable": response.replayable,
        "now": now,
        "retention": retention,
    }


class PostgresStore(PostgresOutboxMixin, PostgresAgentsMixin):
    """PostgreSQL-backed :class:`~retrysafe.stores.KeyStore`,
    :class:`~retrysafe.stores.OutboxStore` (and their async faces; the outbox half is
    :class:`~retrysafe.stores._postgres_outbox.PostgresOutboxMixin`) and
    :class:`~retrysafe.stores.AgentStore` (agent runs and calls, SPEC §7; the agent half is
    :class:`~retrysafe.stores._postgres_agents.PostgresAgentsMixin`).

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

    Raises:
        ConfigurationError: a malformed URL or schema name, bad pool sizes or clock.
        StoreUnavailableError: the server cannot be reached or refuses the login; the message
            names host and port, never the password.
        SchemaError: the schema is missing (``create=False``) or newer than this release.
    """

    dialect = "postgresql"

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
    ) -> None:
        if not _SCHEMA_NAME.match(schema):
            raise ConfigurationError(
                f"schema {schema!r} must be a plain identifier (letters, digits, _)",
                option="schema",
            )
        if clock not in ("server", "caller"):
            raise ConfigurationError("clock must be 'server' or 'caller'", option="clock")
        check_postgres_url(url)
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ConfigurationError("need 0 <= min_size <= max_size, max_size >= 1")
        try:
            params = conninfo_to_dict(url)
        except psycopg.Error as exc:
            raise ConfigurationError(
                f"malformed PostgreSQL URL: {_redact(str(exc), None)}", option="store"
            ) from exc
        password = params.get("password")
        self._password = None if password is None else str(password)
        host = params.get("host") or params.get("hostaddr") or "localhost"
        self.where = f"{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"
        self.schema = schema
        self.clock: Clock = clock
        self.connect_timeout = connect_timeout
        self._min_size = min_size
        self._max_size = max_size
        self._kwargs: dict[str, Any] = {
            "autocommit": True,
            "options": f"-c search_path={schema}",
            "connect_timeout": max(2, round(connect_timeout)),
        }
        self._conninfo = make_conninfo(url)
        self._closed = False
        self._ensure_schema(create)
        self._pool = psycopg_pool.ConnectionPool(
            self._conninfo,
            min_size=min_size,
            max_size=max_size,
            kwargs=self._kwargs,
            timeout=connect_timeout,
            open=False,
            name="retrysafe",
        )
        self._pool.open(wait=False)

    def __repr__(self) -> str:
        return f"PostgresStore({self.url!r})"

    @property
    def url(self) -> str:
        """The URL without the password."""
        return f"postgresql://{self.where}"

    # ------------------------------------------------------------------ errors
    def _translate(self, exc: Exception) -> StoreError:
        msg = _redact(str(exc).strip(), self._password)
        if isinstance(exc, psycopg.errors.UndefinedTable):
            return SchemaError(
                f"PostgreSQL store {self.where} has no retrysafe schema in {self.schema!r}: "
                f"{msg} (run `retrysafe migrate --store URL`, or open it with create=True)",
                store=self.url,
            )
        if isinstance(exc, psycopg.OperationalError | psycopg_pool.PoolTimeout):
            return StoreUnavailableError(
                f"PostgreSQL store at {self.where} unavailable: {msg}", store=self.url
            )
        return StoreError(f"PostgreSQL store at {self.where} failed: {msg}", store=self.url)

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        try:
            with self._pool.connection() as conn:
                yield conn
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self._translate(exc) from exc

    def _now(self, now: float) -> float | None:
        return now if self.clock == "caller" else None

    # ------------------------------------------------------------------ schema
    def _ensure_schema(self, create: bool) -> None:
        try:
            with psycopg.connect(self._conninfo, **self._kwargs) as conn:
                self._check_or_create(conn, create)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self._translate(exc) from exc

    def _check_or_create(self, conn: psycopg.Connection[Any], create: bool) -> None:
        version = self._version(conn)
        if version == SCHEMA_VERSION and self._complete(conn):
            return
        if not create:
            what = "no retrysafe schema" if version is None else "no outbox or agent tables"
            raise SchemaError(
                f"PostgreSQL store {self.where} has {what} in {self.schema!r} "
                "(run `retrysafe migrate --store URL`, or open it with create=True)",
                store=self.url,
            )
        with conn.transaction():
            stmt = sql.SQL(_Q["create_schema"].decode()).format(schema=sql.Identifier(self.schema))
            conn.execute(stmt)
            conn.execute(_Q["lock_schema"])
            version = self._version(conn)  # another process may have won the race
            if version is None or not self._complete(conn):
                # Every statement is IF NOT EXISTS: this creates the schema, or adds the
                # outbox and agent tables to a version-1 schema written before they existed.
                feature_tables = _split(_Q["outbox_schema"]) + _split(_Q["agents_schema"])
                for stmt_text in _split(_Q["schema"]) + feature_tables:
                    conn.execute(stmt_text)
                conn.execute(_Q["set_schema_version"], {"version": str(SCHEMA_VERSION)})

    def _complete(self, conn: psycopg.Connection[Any]) -> bool:
        for probe in ("outbox_exists", "agents_exists"):
            row = conn.execute(_Q[probe]).fetchone()
            if row is None or not row[0]:
                return False
        return True

    def _version(self, conn: psycopg.Connection[Any]) -> int | None:
        row = conn.execute(_Q["meta_exists"]).fetchone()
        if row is None or not row[0]:
            return None
        got = conn.execute(_Q["get_schema_version"]).fetchone()
        if got is None:
            return None
        version = int(got[0])
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"PostgreSQL store {self.where} (schema {self.schema!r}) has schema version "
                f"{version}; this retrysafe understands up to {SCHEMA_VERSION}. Upgrade "
                "retrysafe (`pip install -U retrysafe`) before running "
                "`retrysafe migrate --store URL`.",
                store=self.url,
            )
        return version

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the sync pool. Idempotent. (Async faces close with ``aclose()``.)"""
        if not self._closed:
            self._closed = True
            self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin_effect(self) -> PostgresEffect:
        """Open a transaction for a handler's own writes (SPEC §4 transactional mode).

        Takes a connection from the sync pool and starts a transaction on it; the connection
        goes back to the pool after :meth:`PostgresEffect.commit` or
        :meth:`PostgresEffect.rollback`. Usable from any thread.

        Raises:
            StoreUnavailableError: no connection within ``connect_timeout``.
            StoreError: the store is closed.
        """
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        try:
            conn = self._pool.getconn()
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self._translate(exc) from exc
        try:
            conn.autocommit = False
        except psycopg.Error as exc:
            self._pool.putconn(conn)
            raise self._translate(exc) from exc
        return PostgresEffect(self, conn)

    def asyncio_key_store(self) -> AsyncPostgresKeys:
        """A new async face (its own :class:`psycopg_pool.AsyncConnectionPool`, opened on
        first use in the running event loop; close it with ``aclose()``)."""
        return AsyncPostgresKeys(self)

    # ------------------------------------------------------------------ KeyStore
    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        params = _claim_params(key_hash, fingerprint, self._now(now), lease, retention)
        with self._conn() as conn:
            for _ in range(_CLAIM_TRIES):
                row = conn.execute(_Q["claim_key"], params).fetchone()
                if row is not None:
                    return True, _row_to_record(row)
                row = conn.execute(_Q["get_key"], params).fetchone()
                if row is not None:
                    return False, _row_to_record(row)
                # Released or purged between the two statements: claim again.
        raise StoreError(f"claim of {key_hash} kept racing; giving up", store=self.url)

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        params = _token_params(key_hash, fencing_token, self._now(now), lease=lease)
        with self._conn() as conn:
            row = conn.execute(_Q["take_over_key"], params).fetchone()
        return None if row is None else _row_to_record(row)

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        params = _complete_params(key_hash, fencing_token, response, self._now(now), retention)
        with self._conn() as conn:
            return conn.execute(_Q["complete_key"], params).rowcount == 1

    def release(self, key_hash: str, fencing_token: int) -> bool:
        params = _token_params(key_hash, fencing_token, None)
        with self._conn() as conn:
            return conn.execute(_Q["release_key"], params).rowcount == 1

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        params = _token_params(key_hash, fencing_token, self._now(now), lease=lease)
        with self._conn() as conn:
            return conn.execute(_Q["extend_key_lease"], params).rowcount == 1

    def get(self, key_hash: str) -> KeyRecord | None:
        with self._conn() as conn:
            row = conn.execute(_Q["get_key"], {"key_hash": key_hash}).fetchone()
        return None if row is None else _row_to_record(row)

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        if batch < 1:
            raise ConfigurationError("batch must be >= 1", option="batch")
        params = {"now": self._now(now), "batch": batch}
        total = 0
        with self._conn() as conn:
            while True:
                deleted = conn.execute(_Q["purge_keys"], params).rowcount
                total += deleted
                if deleted < batch:
                    return total


class PostgresEffect:
    """One open transaction holding a handler's effect and, at the end, the key's completion.

    Attributes:
        connection: the :class:`psycopg.Connection` (not autocommit) the handler writes with;
            its search_path is the store's schema. Never commit it yourself.
    """

    __slots__ = ("_done", "_lock", "_store", "connection")

    #: Other connections can still write the key's row: the middleware keeps renewing the lease.
    holds_write_lock = False

    def __init__(self, store: PostgresStore, conn: psycopg.Connection[Any]) -> None:
        self._store = store
        self.connection = conn
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
        s = self._store
        params = _complete_params(key_hash, fencing_token, response, s._now(now), retention)
        with self._lock:
            try:
                return self.connection.execute(_Q["complete_key"], params).rowcount == 1
            except psycopg.Error as exc:
                raise s._translate(exc) from exc

    def commit(self) -> None:
        """COMMIT the effect (and the completion); the connection goes back to the pool."""
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                self.connection.commit()
            except psycopg.Error as exc:
                raise self._store._translate(exc) from exc
            finally:
                self._give_back()

    def rollback(self) -> None:
        """ROLLBACK the effect; the connection goes back to the pool. Idempotent; never
        raises."""
        with self._lock:
            if self._done:
                return
            self._done = True
            with suppress(psycopg.Error):
                self.connection.rollback()
            self._give_back()

    def _give_back(self) -> None:
        conn = self.connection
        with suppress(psycopg.Error):
            if not conn.closed:
                conn.rollback()
                conn.autocommit = True
        self._store._pool.putconn(conn)


def _claim_params(
    key_hash: str, fingerprint: str, now: float | None, lease: float, retention: float
) -> dict[str, Any]:
    return {
        "key_hash": key_hash,
        "fingerprint": fingerprint,
        "now": now,
        "lease": lease,
        "keep": max(retention, lease),
    }


def _token_params(
    key_hash: str, token: int, now: float | None, *, lease: float = 0.0
) -> dict[str, Any]:
    return {"key_hash": key_hash, "token": token, "now": now, "lease": lease}


def _split(script: bytes) -> list[bytes]:
    return [s.strip() for s in script.split(b";") if s.strip()]


def _redact(message: str, password: str | None) -> str:
    if password:
        message = message.replace(password, "***")
    return message


class AsyncPostgresKeys:
    """The async face of :class:`PostgresStore` (:class:`~retrysafe.stores.AsyncKeyStore`):
    the same statements on an :class:`psycopg_pool.AsyncConnectionPool`.

    The pool belongs to the event loop that first uses the face; used from another loop the
    face opens a new pool there. Close it with :meth:`aclose`.
    """

    def __init__(self, store: PostgresStore) -> None:
        self._s = store
        self._pool: psycopg_pool.AsyncConnectionPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Lock | None = None

    async def _get_pool(self) -> psycopg_pool.AsyncConnectionPool:
        loop = asyncio.get_running_loop()
        if self._pool is not None and self._loop is loop:
            return self._pool
        if self._opening is None or self._loop is not loop:
            self._opening, self._loop, self._pool = asyncio.Lock(), loop, None
        async with self._opening:
            if self._pool is None:
                s = self._s
                pool = psycopg_pool.AsyncConnectionPool(
                    s._conninfo,
                    min_size=s._min_size,
                    max_size=s._max_size,
                    kwargs=s._kwargs,
                    timeout=s.connect_timeout,
                    open=False,
                    name="retrysafe-async",
                )
                await pool.open(wait=False)
                self._pool = pool
            return self._pool

    async def _fetch(self, query: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        try:
            pool = await self._get_pool()
            async with pool.connection() as conn:
                cur = await conn.execute(_Q[query], params)
                return await cur.fetchone()
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self._s._translate(exc) from exc

    async def _rowcount(self, query: str, params: Mapping[str, Any]) -> int:
        try:
            pool = await self._get_pool()
            async with pool.connection() as conn:
                return (await conn.execute(_Q[query], params)).rowcount
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise self._s._translate(exc) from exc

    async def aclose(self) -> None:
        """Close this face's pool. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        params = _claim_params(key_hash, fingerprint, self._s._now(now), lease, retention)
        for _ in range(_CLAIM_TRIES):
            row = await self._fetch("claim_key", params)
            if row is not None:
                return True, _row_to_record(row)
            row = await self._fetch("get_key", params)
            if row is not None:
                return False, _row_to_record(row)
        raise StoreError(f"claim of {key_hash} kept racing; giving up", store=self._s.url)

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        params = _token_params(key_hash, fencing_token, self._s._now(now), lease=lease)
        row = await self._fetch("take_over_key", params)
        return None if row is None else _row_to_record(row)

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        params = _complete_params(key_hash, fencing_token, response, self._s._now(now), retention)
        return await self._rowcount("complete_key", params) == 1

    async def release(self, key_hash: str, fencing_token: int) -> bool:
        return (
            await self._rowcount("release_key", _token_params(key_hash, fencing_token, None)) == 1
        )

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool:
        params = _token_params(key_hash, fencing_token, self._s._now(now), lease=lease)
        return await self._rowcount("extend_key_lease", params) == 1

    async def get(self, key_hash: str) -> KeyRecord | None:
        row = await self._fetch("get_key", {"key_hash": key_hash})
        return None if row is None else _row_to_record(row)
