"""Transactional mode (SPEC §4): the handler's own writes and the key's completion commit in
one transaction.

The middleware puts a ``begin_effect`` callable into the per-request state dict it stores under
:data:`~retrysafe.server._outcome.SCOPE_KEY` while it holds a claim; :func:`transaction` calls
it once per request and keeps the open transaction there (``"effect"``), and the middleware
completes and commits it — or rolls it back — when the response ends
(:meth:`~retrysafe.server._engine.Engine.end_effect`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.server._outcome import SCOPE_KEY
from retrysafe.stores._base import HasEffects

__all__ = ["effect_opener", "transaction"]

_SUPPORTED = "SQLiteStore (sqlite:///…) and PostgresStore (postgresql://…)"


def effect_opener(store: Any) -> Callable[[], Any]:
    """The store's ``begin_effect``, or a callable raising a clear error for stores without SQL."""
    if isinstance(store, HasEffects):
        return store.begin_effect

    def unsupported() -> Any:
        raise ConfigurationError(
            f"transaction() needs a SQL store that can hold the handler's writes: {store!r} "
            f"cannot; transactional mode works with {_SUPPORTED}",
            option="store",
        )

    return unsupported


@contextmanager
def transaction(scope_or_environ: MutableMapping[str, Any]) -> Iterator[Any]:
    """A DB-API connection, inside a transaction bound to this request's claim (SPEC §4).

    Write the handler's effect with it; leaving the ``with`` block does **not** commit. When the
    response ends, the middleware completes the key on this same connection — fenced by the
    request's fencing token — and commits effect and completion together, when the response is
    stored (2xx, 3xx, 4xx but 408/429). Otherwise (5xx, 408, 429, an exception, an incomplete
    response, the block itself raised, or the lease was taken over) it rolls the effect back and,
    except when the lease was lost or the outcome marked unknown, releases the key. Calling it
    again in the same request returns the same connection.

    SQLite: a dedicated ``sqlite3`` connection in ``BEGIN IMMEDIATE``, which holds the database's
    write lock until the response ends (other writers wait up to ``busy_timeout``). PostgreSQL: a
    connection of the store's pool (``search_path`` = the store's schema). The effect's tables
    must live in that database. Under ASGI, call it from a sync endpoint (the threadpool), not
    from a coroutine: the connection blocks.

    Args:
        scope_or_environ: the request's ASGI scope or WSGI environ.

    Yields:
        The open transaction's connection (``sqlite3.Connection`` or ``psycopg.Connection``).

    Raises:
        ConfigurationError: the request is not a protected request whose key the middleware
            claimed (no middleware, an unprotected method, no key, fail-open), the response
            already ended, or the store has no SQL (memory, Redis).
        StoreError: the transaction could not be opened (``StoreUnavailableError`` when the
            database is locked or unreachable).
    """
    state = scope_or_environ.get(SCOPE_KEY)
    if not isinstance(state, dict) or "begin_effect" not in state:
        raise ConfigurationError(
            "transaction() works only inside a request whose Idempotency-Key the retrysafe "
            "middleware claimed (a protected method with a key, the handler running)",
            option="transaction",
        )
    effect = state.get("effect")
    if effect is None:
        effect = state["begin_effect"]()
        state["effect"] = effect
    try:
        yield effect.connection
    except BaseException:
        state["effect_failed"] = True
        raise
