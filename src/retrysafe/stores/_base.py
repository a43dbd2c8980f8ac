"""The store seam: the few atomic primitives every store offers, and their contract.

Stores are dumb (STYLE §2): they run atomic statements and hold no policy. TTLs, fingerprints,
what to store and when to take over are decided by :mod:`retrysafe.core` and passed in as
plain values. One contract test suite (``tests/stores``) runs against every implementation.

Times are Unix seconds (float). ``lease`` and ``retention`` are durations in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from retrysafe._exceptions import ConfigurationError
from retrysafe.core import KeyRecord, StoredResponse

__all__ = [
    "ENTRY_STATES",
    "AsyncKeyStore",
    "Effect",
    "HasAsyncKeyStore",
    "HasEffects",
    "KeyAdmin",
    "KeyEntry",
    "KeyPosition",
    "KeyStore",
    "SyncKeysFace",
    "check_limit",
    "entry_position",
    "listed_states",
    "page_of",
]

#: The states a :class:`KeyEntry` can have, in the order ``retrysafe keys`` lists them.
ENTRY_STATES = ("running", "completed", "released", "expired")


@runtime_checkable
class KeyStore(Protocol):
    """Idempotency-key storage for the middleware (SPEC §3, §4, §9).

    Concurrency contract (every implementation keeps it, across threads and processes that
    share the store):

    * ``claim`` is one atomic step: it inserts the key if absent or if its retention expired,
      else it returns the existing record untouched. Of N concurrent claims of one absent key
      exactly one returns ``claimed=True``.
    * ``take_over``, ``complete``, ``release`` and ``extend_lease`` are compare-and-swap on the
      fencing token: they change the record only while it is ``running`` under exactly that
      token, so an owner whose lease was taken over can never overwrite or delete the new
      owner's record.
    * Every fencing token of a key hash is larger than all earlier ones — also across
      ``release``: a released key reads as absent (``get`` returns None, ``claim`` takes it)
      but the store remembers its last token (a tombstone row; Redis: a per-key counter), so
      the next claim's token is larger and an owner fenced out before the release still
      matches nothing. Otherwise a take-over, a release and a new claim could hand the first
      owner's token 1 out again, and that owner's late ``complete`` would overwrite the new
      owner's record.
    * Residual caveat: ``purge_keys`` deletes records and tombstones once their retention
      ended, and with them the key's token history (Redis: the counter's TTL). An owner
      still running past the retention window could then match a fresh claim's token; keep
      retention far longer than any handler runs (it is hours, leases are seconds).

    Errors: :class:`~retrysafe.StoreUnavailableError` when the store cannot serve now (callers
    answer 503), :class:`~retrysafe.StoreError` for anything else; driver errors are chained.
    """

    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        """Insert a running record (lease until ``now + lease``, retained until ``now +
        retention``) if absent or expired; return ``(True, new)`` or ``(False, existing)``."""
        ...

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        """Give a running record whose lease expired a new token and lease; None if the
        record changed meanwhile (someone else took over, it completed, or was released)."""
        ...

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        """Store the response and mark completed, retained until ``now + retention``.
        False when the token no longer owns the running record (nothing is written)."""
        ...

    def release(self, key_hash: str, fencing_token: int) -> bool:
        """Release the running record so the next attempt runs again: it reads as absent from
        then on, while its fencing token stays remembered (see above). False when not owner."""
        ...

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        """Move the owner's lease to ``now + lease``. False when not owner."""
        ...

    def get(self, key_hash: str) -> KeyRecord | None:
        """The record as stored (expired or not), or None."""
        ...

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        """Delete records (released ones included) whose retention ended at or before ``now``,
        at most ``batch`` per statement, until none remain; return how many were deleted."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One stored idempotency-key record as an operator inspects it (``retrysafe keys``):
    what the store holds, tombstones included, and never the raw key or its scope.

    Attributes:
        key_hash: SHA-256 hex of (scope, key) (:func:`retrysafe.core.key_hash`).
        state: ``"running"`` or ``"completed"`` as stored; ``"released"`` for a tombstone
            (released by its owner, or evicted: it reads as absent and only keeps the token
            sequence; Redis forgets a record its owner released at once, so it lists only
            evicted ones, whose marker it keeps until their retention ends);
            ``"expired"`` once ``expires_at`` passed by the store's clock, whatever was stored
            (it reads as absent; a purge, or Redis's TTL, removes it).
        fingerprint: SHA-256 hex of the request that claimed it (``""`` for a tombstone).
        fencing_token: the record's fencing token (what :meth:`KeyAdmin.evict` compares).
        lease_expires_at: Unix seconds when a running claim may be taken over (for a
            completed or released record: the last lease it had, which no longer means
            anything).
        expires_at: Unix seconds when the retention ends.
        created_at: Unix seconds of the claim that wrote this record (a claim after expiry
            or release writes a new record); None for records claimed before the store had
            the column (SQL schema version 1, or an older retrysafe on Redis).
        status: the stored HTTP status once completed, else None.
        headers: the stored replayable headers, ``(lower-case name, value)`` pairs.
        body_size: bytes of the stored body once completed, else None.
        replayable: False when the answer was larger than the replay limit (no body kept).
        body: the stored body; only :meth:`KeyAdmin.find_keys` reads it (None from
            :meth:`KeyAdmin.list_keys`: a page never carries bodies).
    """

    key_hash: str
    state: str
    fingerprint: str
    fencing_token: int
    lease_expires_at: float
    expires_at: float
    created_at: float | None
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body_size: int | None = None
    replayable: bool = True
    body: bytes | None = None


class KeyPosition(NamedTuple):
    """Where a record sorts in :meth:`KeyAdmin.list_keys` (descending: newest claim first,
    then the larger key hash): the keyset a page continues from. It names a place in the
    order, not a record, so a page can continue after a record that was evicted, expired or
    purged since the previous page was read.

    Attributes:
        created_at: the record's claim time in Unix seconds (0 when it is unknown: records
            claimed before the store recorded claim times sort last).
        key_hash: the record's key hash (64 lower-case hex digits).
    """

    created_at: float
    key_hash: str


@runtime_checkable
class KeyAdmin(Protocol):
    """What an operator needs of a key store (``retrysafe keys list|show|evict``): read
    records without the raw key, and forget one. Every store of this package offers it; it is
    not part of :class:`KeyStore`, which the middleware needs, so a third-party store need
    not implement it.

    Contract:

    * Reads are not one snapshot of the store: records claimed, completed or purged while a
      page is read may appear in either form or be missed (on Redis a record's fields and its
      body size are two commands). Act on what you read only through ``evict``, which
      checks it.
    * ``evict`` is a compare-and-swap on the fencing token the caller read: it forgets the
      record only while it is still that record (same token), whatever its state, and the
      key's token history stays (a tombstone; Redis: the per-key counter), exactly as after
      ``release``. So the next claim runs the handler again with a larger token, and an owner
      still running under the evicted token (or an earlier one) matches no fenced write: its
      ``complete``, ``release``, ``extend_lease`` and ``take_over`` change nothing.
    * An evicted record reads as ``"released"`` afterwards on every store (``find_keys``,
      ``list_keys``) until its retention ends — the SQL stores' tombstone; on Redis a marker
      the eviction leaves beside the record, with the record's remaining TTL — so a second
      evictor, or a person looking again, sees "released already", not "no such key".
    """

    def list_keys(
        self,
        *,
        now: float,
        limit: int = 100,
        states: Collection[str] | None = None,
        after: KeyEntry | KeyPosition | None = None,
    ) -> list[KeyEntry]:
        """Up to ``limit`` records, newest claim first (records without ``created_at``
        last, then by key hash), without bodies.

        Args:
            now: Unix seconds, for ``"expired"`` (ignored by stores on the server's clock).
            limit: the most entries returned (≥ 1).
            states: the :data:`ENTRY_STATES` to return (None: all).
            after: the last entry of the previous page, or its :class:`KeyPosition`
                (keyset pagination: the page holds the entries that sort after it; the
                record itself need not exist any more).

        Raises:
            ConfigurationError: ``limit`` < 1 or an unknown state.

        SQL stores sort with a scan (no index on ``created_at``: a claim updates no more
        indexes for it); Redis runs ``SCAN`` over the store's prefix (never ``KEYS``) and
        sorts in the client. Both are for a person at a prompt, not for the request path.
        """
        ...

    def find_keys(self, prefix: str, *, now: float, limit: int = 2) -> list[KeyEntry]:
        """Up to ``limit`` records (bodies included) whose key hash starts with ``prefix``
        (lower-case hex, compared literally; a whole 64-digit hash is one lookup), in hash
        order: none, the one, or ``limit`` of an ambiguous prefix. An empty prefix names
        none."""
        ...

    def evict(self, key_hash: str, fencing_token: int) -> bool:
        """Forget the record of ``key_hash`` if its token is still ``fencing_token`` (see
        the contract above). False when it is absent, already released, or changed (claimed
        again, taken over) since it was read: nothing is changed then."""
        ...


def check_limit(limit: int) -> int:
    """``limit`` of a :class:`KeyAdmin` read, checked once for every store.

    Raises:
        ConfigurationError: it is not a whole number ≥ 1.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError("limit must be an integer >= 1", option="limit")
    return limit


def listed_states(states: Collection[str] | None, limit: int) -> frozenset[str]:
    """The states a :meth:`KeyAdmin.list_keys` call asks for, its arguments checked once for
    every store.

    Raises:
        ConfigurationError: ``limit`` is not a whole number ≥ 1, or a state is not one of
            :data:`ENTRY_STATES`.
    """
    check_limit(limit)
    if states is None:
        return frozenset(ENTRY_STATES)
    odd = sorted(set(states) - set(ENTRY_STATES))
    if odd:
        raise ConfigurationError(
            f"unknown key states {odd}; the states are {', '.join(ENTRY_STATES)}",
            option="states",
        )
    return frozenset(states)


def entry_position(entry: KeyEntry | KeyPosition) -> KeyPosition:
    """Where ``entry`` sorts in :meth:`KeyAdmin.list_keys` (descending): its claim time
    (0 when unknown), then its key hash. The keyset a page continues from; a
    :class:`KeyPosition` is returned as it is."""
    if isinstance(entry, KeyPosition):
        return entry
    return KeyPosition(0.0 if entry.created_at is None else entry.created_at, entry.key_hash)


def page_of(
    entries: Collection[KeyEntry],
    *,
    limit: int,
    states: frozenset[str],
    after: KeyEntry | KeyPosition | None,
) -> list[KeyEntry]:
    """One :meth:`KeyAdmin.list_keys` page of ``entries`` (every record), for the stores
    that sort in the client (memory, Redis) as the SQL stores' ``list_keys`` statement does."""
    start = None if after is None else entry_position(after)
    chosen = [
        e
        for e in entries
        if e.state in states and (start is None or entry_position(e) < start)
    ]
    chosen.sort(key=entry_position, reverse=True)
    return chosen[:limit]


@runtime_checkable
class AsyncKeyStore(Protocol):
    """The async face of :class:`KeyStore`: the same methods and contract, awaitable."""

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]: ...

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None: ...

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool: ...

    async def release(self, key_hash: str, fencing_token: int) -> bool: ...

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool: ...

    async def get(self, key_hash: str) -> KeyRecord | None: ...


@runtime_checkable
class HasAsyncKeyStore(Protocol):
    """A key store that has its own async face (every store of this package): the ASGI
    middleware and the webhook receiver use it instead of running sync calls in threads."""

    def asyncio_key_store(self) -> AsyncKeyStore:
        """A new :class:`AsyncKeyStore` face of the same store (its own connection or pool,
        bound to the event loop that first uses it)."""
        ...


class Effect(Protocol):
    """One open transaction holding a handler's effect and, at the end, the key's completion
    (SPEC §4 transactional mode).

    Attributes:
        connection: the driver connection the handler writes with (never commit it yourself).
        holds_write_lock: whether the open transaction keeps every other writer out (SQLite),
            so the middleware need not renew the lease meanwhile.
    """

    connection: Any
    holds_write_lock: bool

    def complete_in(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        """Complete the key inside the transaction, fenced (False: the lease was lost)."""
        ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


@runtime_checkable
class HasEffects(Protocol):
    """A key store that can hold a handler's own writes (the SQL stores)."""

    def begin_effect(self) -> Effect:
        """Open a transaction on a connection of its own.

        Raises:
            StoreUnavailableError: no connection or lock within the store's timeout.
        """
        ...


class SyncKeysFace:
    """An :class:`AsyncKeyStore` face of a sync :class:`KeyStore`: each call runs inline
    (``in_thread=False``: a store whose calls never block, like ``MemoryStore``) or in a worker
    thread (a third-party store without an async face of its own), so the event loop never
    blocks on it."""

    def __init__(self, store: KeyStore, *, in_thread: bool) -> None:
        self._s = store
        self._in_thread = in_thread

    async def _call(self, fn: Callable[..., Any], *a: Any, **k: Any) -> Any:
        return await asyncio.to_thread(fn, *a, **k) if self._in_thread else fn(*a, **k)

    async def claim(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.claim, *a, **k)

    async def take_over(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.take_over, *a, **k)

    async def complete(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.complete, *a, **k)

    async def release(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.release, *a, **k)

    async def extend_lease(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.extend_lease, *a, **k)

    async def get(self, *a: Any, **k: Any) -> Any:
        return await self._call(self._s.get, *a, **k)
