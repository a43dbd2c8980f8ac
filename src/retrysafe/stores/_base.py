"""The store seam: the few atomic primitives every store offers, and their contract.

Stores are dumb (STYLE §2): they run atomic statements and hold no policy. TTLs, fingerprints,
what to store and when to take over are decided by :mod:`retrysafe.core` and passed in as
plain values. One contract test suite (``tests/stores``) runs against every implementation.

Times are Unix seconds (float). ``lease`` and ``retention`` are durations in seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from retrysafe.core import KeyRecord, StoredResponse

__all__ = [
    "AsyncKeyStore",
    "Effect",
    "HasAsyncKeyStore",
    "HasEffects",
    "KeyStore",
    "SyncKeysFace",
]


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
