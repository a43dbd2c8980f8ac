"""The idempotency-key store on SQL, written once for SQLite and PostgreSQL (SPEC §3, §9).

Every primitive is one statement: a claim is ``INSERT … ON CONFLICT (key_hash) DO UPDATE … WHERE
expires_at <= now OR state = 'released' RETURNING``, every fenced write an ``UPDATE`` guarded by
the fencing token (``release`` too: it leaves a tombstone, see
:class:`~retrysafe.stores.KeyStore`), so the database's write lock (SQLite) or row locks
(PostgreSQL) make each of them atomic across threads, processes and hosts. The statements live in
``sql/keys.<dialect>.sql``; :class:`SQLKeyStore` and :class:`AsyncSQLKeyStore` are the same
operations on a sync and an async :mod:`connector <retrysafe.stores._connector>`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from retrysafe._exceptions import ConfigurationError, StoreError
from retrysafe.core import RACE_LIMIT, KeyRecord, KeyState, StoredResponse
from retrysafe.stores._base import (
    KeyEntry,
    KeyPosition,
    check_limit,
    entry_position,
    listed_states,
)
from retrysafe.stores._connector import (
    NEEDS_WRITE,
    Clock,
    NeedsWrite,
    OnAsyncConnector,
    OnConnector,
    Op,
    Statements,
    all_rows,
    async_op,
    caller_now,
    count,
    one,
    sync_op,
)

__all__ = ["AsyncSQLKeyStore", "KeyEffect", "SQLKeyStore", "claimed_record", "headers_json"]

#: The columns every statement returning a row reads, in the order the row converter
#: unpacks them (``{key_columns}`` in the statement files).
KEY_COLUMNS = (
    "key_hash",
    "fingerprint",
    "state",
    "fencing_token",
    "lease_expires_at",
    "expires_at",
    "status",
    "headers",
    "body",
    "replayable",
)

#: The columns of a :class:`~retrysafe.stores.KeyEntry` row (``{entry_columns}``), followed
#: in each inspection statement by the body's size, whether the retention ended and (find_*)
#: the body: :func:`_entry` unpacks them in this order.
ENTRY_COLUMNS = (
    "key_hash",
    "state",
    "fingerprint",
    "fencing_token",
    "lease_expires_at",
    "expires_at",
    "created_at",
    "status",
    "headers",
    "replayable",
)

_SQL = Statements(
    "retrysafe.stores",
    "keys",
    columns={"key_columns": KEY_COLUMNS, "entry_columns": ENTRY_COLUMNS},
)
_CLAIM, _GET, _TAKE_OVER = _SQL["claim_key"], _SQL["get_key"], _SQL["take_over_key"]
_INSERT = _SQL["insert_key"]
_COMPLETE, _RELEASE, _EXTEND = _SQL["complete_key"], _SQL["release_key"], _SQL["extend_key_lease"]
_PURGE = _SQL["purge_keys"]
_LIST, _FIND, _FIND_PREFIX = _SQL["list_keys"], _SQL["find_key"], _SQL["find_keys_by_prefix"]
_EVICT = _SQL["evict_key"]
#: Hex digits of a whole key hash (SHA-256): a prefix this long is one index lookup.
_HASH_LENGTH = 64
_STATES = {state.value: state for state in KeyState}


def headers_json(headers: Sequence[tuple[str, str]]) -> str:
    """Headers as every store keeps them (a stored response's, an outbox job's): the JSON text
    ``json.dumps([[name, value], ...])`` writes, byte for byte, built without the encoder's
    per-call setup (each name and value is quoted by the same C function ``json.dumps`` uses)."""
    try:
        return (
            "["
            + ", ".join(
                f"[{encode_basestring_ascii(k)}, {encode_basestring_ascii(v)}]" for k, v in headers
            )
            + "]"
        )
    except TypeError:  # not (str, str) pairs: let json say what it makes of them
        return json.dumps([list(p) for p in headers])


def claimed_record(
    key_hash: str, fingerprint: str, token: Any, lease_expires_at: Any, expires_at: Any
) -> KeyRecord:
    """The record a claim just wrote, from what the store returned of it (token and times, as
    the driver's types: numbers, or Redis's bytes)."""
    return KeyRecord(
        key_hash,
        fingerprint,
        KeyState.RUNNING,
        int(token),
        float(lease_expires_at),
        float(expires_at),
    )


def _record(row: tuple[Any, ...]) -> KeyRecord:
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


def _entry(row: tuple[Any, ...]) -> KeyEntry:
    (key_hash, state, fp, token, lease_exp, exp, created, status, headers, replayable) = row[:10]
    body_size, expired = row[10], row[11]
    body = row[12] if len(row) > 12 else None
    return KeyEntry(
        key_hash=key_hash,
        state="expired" if expired else state,
        fingerprint=fp,
        fencing_token=int(token),
        lease_expires_at=float(lease_exp),
        expires_at=float(exp),
        created_at=None if created is None else float(created),
        status=None if status is None else int(status),
        headers=tuple((str(k), str(v)) for k, v in json.loads(headers or "[]")),
        body_size=None if status is None else int(body_size or 0),
        replayable=bool(replayable),
        body=None if body is None else bytes(body),
    )


# ---------------------------------------------------------------------- operations
def claim(
    clock: Clock, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
) -> Op[tuple[bool, KeyRecord]]:
    params = {
        "key_hash": key_hash,
        "fingerprint": fingerprint,
        "now": caller_now(clock, now),
        "lease": lease,
        "retention": retention,
    }
    # A first-time key, the hot path: a plain insert. The caller's clock made its times, so
    # the record it wrote is known without reading it back (SQL adds the same doubles). On
    # the server's clock its times are the server's: claim_key returns them.
    if clock == "caller" and (yield count(_INSERT, params)):
        return True, claimed_record(key_hash, fingerprint, 1, now + lease, now + retention)
    for _ in range(RACE_LIMIT):
        row = yield one(_CLAIM, params)
        if row is not None:
            return True, claimed_record(key_hash, fingerprint, *row)
        row = yield one(_GET, params)
        if row is not None:
            return False, _record(row)
        # Released or purged between the two statements: claim again.
    raise StoreError(f"claim of {key_hash} kept racing; giving up")


def claim_by_reading(
    clock: Clock, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
) -> Op[tuple[bool, KeyRecord] | NeedsWrite]:
    """The read-only form of :func:`claim` (``when_locked``, see
    :class:`~retrysafe.stores._connector.AsyncConnector`): what the async face runs when the
    claim met another process's write lock (SQLite). A record that is there and unexpired is
    what :func:`claim` would return unclaimed — its claim statement replaces only a released
    or expired one — so it is returned as read (a replay, a request in progress, a reused
    key: the answer of that moment); anything else is :data:`NEEDS_WRITE`."""
    if clock == "caller":
        record = yield from get(clock, key_hash)
        if record is not None and record.expires_at > now:
            return False, record
    return NEEDS_WRITE


def take_over(
    clock: Clock, key_hash: str, fencing_token: int, *, now: float, lease: float
) -> Op[KeyRecord | None]:
    params = _token(clock, key_hash, fencing_token, now, lease=lease)
    row = yield one(_TAKE_OVER, params)
    return None if row is None else _record(row)


def complete(
    clock: Clock,
    key_hash: str,
    fencing_token: int,
    response: StoredResponse,
    *,
    now: float,
    retention: float,
) -> Op[bool]:
    params = {
        "key_hash": key_hash,
        "token": fencing_token,
        "status": response.status,
        "headers": headers_json(response.headers),
        "body": response.body,
        "replayable": response.replayable,
        "now": caller_now(clock, now),
        "retention": retention,
    }
    changed: int = yield count(_COMPLETE, params)
    return changed == 1


def release(clock: Clock, key_hash: str, fencing_token: int) -> Op[bool]:
    changed: int = yield count(_RELEASE, {"key_hash": key_hash, "token": fencing_token})
    return changed == 1


def extend_lease(
    clock: Clock, key_hash: str, fencing_token: int, *, now: float, lease: float
) -> Op[bool]:
    changed: int = yield count(_EXTEND, _token(clock, key_hash, fencing_token, now, lease=lease))
    return changed == 1


def get(clock: Clock, key_hash: str) -> Op[KeyRecord | None]:
    row = yield one(_GET, {"key_hash": key_hash})
    return None if row is None else _record(row)


def purge_keys(clock: Clock, *, now: float, batch: int = 1000) -> Op[int]:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigurationError("batch must be an integer >= 1", option="batch")
    params = {"now": caller_now(clock, now), "batch": batch}
    total = 0
    while True:
        deleted: int = yield count(_PURGE, params)
        total += deleted
        if deleted < batch:
            return total


def list_keys(
    clock: Clock,
    *,
    now: float,
    limit: int = 100,
    states: Collection[str] | None = None,
    after: KeyEntry | KeyPosition | None = None,
) -> Op[list[KeyEntry]]:
    """See :meth:`~retrysafe.stores.KeyAdmin.list_keys`: one statement (a scan and a top-N
    sort)."""
    wanted = listed_states(states, limit)
    created, key_hash = (None, None) if after is None else entry_position(after)
    params = {
        "now": caller_now(clock, now),
        "limit": limit,
        "after_created": created,
        "after_hash": key_hash,
        **{state: state in wanted for state in ("running", "completed", "released", "expired")},
    }
    rows = yield all_rows(_LIST, params)
    return [_entry(row) for row in rows]


def find_keys(clock: Clock, prefix: str, *, now: float, limit: int = 2) -> Op[list[KeyEntry]]:
    """See :meth:`~retrysafe.stores.KeyAdmin.find_keys`."""
    check_limit(limit)
    params = {"key_hash": prefix, "prefix": prefix, "now": caller_now(clock, now), "limit": limit}
    if len(prefix) == _HASH_LENGTH:
        row = yield one(_FIND, params)
        return [] if row is None else [_entry(row)]
    rows = yield all_rows(_FIND_PREFIX, params)
    return [_entry(row) for row in rows]


def evict(clock: Clock, key_hash: str, fencing_token: int) -> Op[bool]:
    """See :meth:`~retrysafe.stores.KeyAdmin.evict`: one fenced ``UPDATE`` leaving a
    tombstone."""
    changed: int = yield count(_EVICT, {"key_hash": key_hash, "token": fencing_token})
    return changed == 1


def _token(
    clock: Clock, key_hash: str, token: int, now: float, *, lease: float
) -> Mapping[str, Any]:
    return {"key_hash": key_hash, "token": token, "now": caller_now(clock, now), "lease": lease}


# ---------------------------------------------------------------------- faces
class SQLKeyStore(OnConnector):
    """:class:`~retrysafe.stores.KeyStore` on a SQL :class:`~retrysafe.stores._connector.Connector`
    (the base of :class:`~retrysafe.stores.SQLiteStore` and
    :class:`~retrysafe.stores.PostgresStore`).

    Concurrency contract: see :class:`~retrysafe.stores.KeyStore` and, for the operator's
    primitives, :class:`~retrysafe.stores._base.KeyAdmin`.
    """

    claim = sync_op(claim)
    take_over = sync_op(take_over)
    complete = sync_op(complete)
    release = sync_op(release)
    extend_lease = sync_op(extend_lease)
    get = sync_op(get)
    purge_keys = sync_op(purge_keys)
    # KeyAdmin (retrysafe keys)
    list_keys = sync_op(list_keys)
    find_keys = sync_op(find_keys)
    evict = sync_op(evict)

    def close(self) -> None:
        """Close every connection. Idempotent."""
        self.connector.close()

    def asyncio_key_store(self) -> AsyncSQLKeyStore:
        """A new :class:`~retrysafe.stores.AsyncKeyStore` face (its own connection or pool,
        bound to the event loop that first uses it; close it with ``aclose()``)."""
        return AsyncSQLKeyStore(self.connector.async_connector())


class AsyncSQLKeyStore(OnAsyncConnector):
    """The async face of :class:`SQLKeyStore`: the same operations on an
    :class:`~retrysafe.stores._connector.AsyncConnector`."""

    claim = async_op(claim, skippable=True, when_locked=claim_by_reading)
    take_over = async_op(take_over, skippable=True)
    complete = async_op(complete)
    release = async_op(release)
    extend_lease = async_op(extend_lease)
    get = async_op(get, skippable=True)


class KeyEffect:
    """One open transaction holding a handler's effect and, at the end, the key's completion
    (SPEC §4 transactional mode), on either SQL dialect.

    Attributes:
        connection: the driver connection the handler writes with. Never commit it yourself.
        holds_write_lock: whether the open transaction keeps every other writer out (SQLite),
            so the middleware need not renew the lease.
    """

    __slots__ = ("_tx", "connection", "holds_write_lock")

    def __init__(self, tx: Any) -> None:
        self._tx = tx
        self.connection = tx.connection
        self.holds_write_lock: bool = tx.holds_write_lock

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
        op = complete(
            self._tx.clock, key_hash, fencing_token, response, now=now, retention=retention
        )
        result: bool = self._tx.run(op)
        return result

    def commit(self) -> None:
        """COMMIT the effect (and the completion)."""
        self._tx.commit()

    def rollback(self) -> None:
        """ROLLBACK the effect. Idempotent; never raises."""
        self._tx.rollback()
