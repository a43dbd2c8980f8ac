"""Stores: the idempotency-key seam (:class:`KeyStore` and its async face), its
implementations, and the SQL connectors every feature store runs on.

``SQLiteStore`` is the embedded default; ``PostgresStore`` and ``RedisStore`` serve many
replicas (imported lazily: their drivers load only when they are used); ``MemoryStore`` is for
unit tests only (unsafe: a restart forgets every key). Open any of them from a URL with
:func:`open_store`.
"""

from typing import TYPE_CHECKING, Any

from retrysafe.stores._base import AsyncKeyStore, KeyAdmin, KeyEntry, KeyPosition, KeyStore
from retrysafe.stores._memory import MemoryStore
from retrysafe.stores._sqlite import SCHEMA_VERSION, SQLiteStore
from retrysafe.stores._url import as_async_key_store, open_store

if TYPE_CHECKING:
    from retrysafe.stores._postgres import PostgresStore
    from retrysafe.stores._redis import RedisStore


def __getattr__(name: str) -> Any:
    """Import ``PostgresStore`` / ``RedisStore`` (and so psycopg / redis) on first use."""
    if name == "PostgresStore":
        from retrysafe.stores._postgres import PostgresStore

        return PostgresStore
    if name == "RedisStore":
        from retrysafe.stores._redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCHEMA_VERSION",
    "AsyncKeyStore",
    "KeyAdmin",
    "KeyEntry",
    "KeyPosition",
    "KeyStore",
    "MemoryStore",
    "PostgresStore",
    "RedisStore",
    "SQLiteStore",
    "as_async_key_store",
    "open_store",
]
