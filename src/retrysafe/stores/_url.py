"""Store URLs: ``sqlite:///path.db``, ``memory://``, ``postgresql://…``, ``redis://…`` and
``redis+cluster://…``.

The PostgreSQL and Redis stores are imported only when such a URL is opened, so importing
``retrysafe`` never imports psycopg or redis.
"""

from __future__ import annotations

from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.stores._base import AsyncKeyStore, HasAsyncKeyStore, KeyStore, SyncKeysFace
from retrysafe.stores._memory import MemoryStore
from retrysafe.stores._sqlite import SQLiteStore, sqlite_path_from_url
from retrysafe.stores._url_check import CLUSTER_SCHEMES, redact_url

__all__ = ["as_async_key_store", "open_store", "redact_url"]


def open_store(url: str, **options: Any) -> Any:
    """Open the store a URL names.

    Args:
        url: ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``,
            ``postgresql://user:password@host:5432/db`` (or ``postgres://``; needs
            ``retrysafe[postgres]``), ``redis://[:password@]host:6379/0`` or ``rediss://``
            (needs ``retrysafe[redis]``), ``redis+cluster://[:password@]host:7000[,host:7001…]``
            or ``rediss+cluster://`` (a Redis Cluster; any reachable node is enough), or
            ``memory://`` (tests only: unsafe, SPEC §9).
        options: passed to the store's constructor (e.g. ``busy_timeout``, ``schema``,
            ``prefix``).

    Raises:
        ConfigurationError: unknown scheme or malformed URL, or the driver for the scheme
            is not installed.
        StoreUnavailableError / SchemaError: as the store's constructor raises them.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"store URL {url!r} is not a URL; expected e.g. sqlite:///retrysafe.db",
            option="store",
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        return SQLiteStore(sqlite_path_from_url(url), **options)
    if scheme == "memory":
        return MemoryStore()
    if scheme in ("postgresql", "postgres"):
        try:
            from retrysafe.stores._postgres import PostgresStore
        except ImportError as exc:
            raise _missing("postgres", exc) from exc
        return PostgresStore(url, **options)
    if scheme in ("redis", "rediss", *CLUSTER_SCHEMES):
        try:
            from retrysafe.stores._redis import RedisStore
        except ImportError as exc:
            raise _missing("redis", exc) from exc
        return RedisStore(url, **options)
    shown = url.split("://", 1)[0] + "://…" if "@" in url else url
    raise ConfigurationError(
        f"unsupported store scheme {scheme!r} in {shown!r}; supported: sqlite, postgresql, "
        "redis, redis+cluster, memory",
        option="store",
    )


def _missing(extra: str, exc: ImportError) -> ConfigurationError:
    return ConfigurationError(
        f"the {extra} store needs its driver ({exc.name or exc}): "
        f"pip install 'retrysafe[{extra}]'",
        option="store",
    )


def as_async_key_store(store: KeyStore | AsyncKeyStore) -> AsyncKeyStore:
    """The async face of a store: its own (``asyncio_key_store()``), or threads around it."""
    if isinstance(store, HasAsyncKeyStore):
        return store.asyncio_key_store()
    if isinstance(store, KeyStore):
        threaded: AsyncKeyStore = SyncKeysFace(store, in_thread=True)
        return threaded
    return store
