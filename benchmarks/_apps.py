"""The apps the middleware benchmark serves under uvicorn (one per variant).

Every variant is the same trivial FastAPI JSON POST endpoint; only the middleware differs.
Selected with ``uvicorn --factory benchmarks._apps:<variant>``; ``BENCH_DB`` names the SQLite
file for the variants that need one, ``BENCH_PG_URL`` / ``BENCH_PG_SCHEMA`` the PostgreSQL
database and (fresh) schema, ``BENCH_REDIS_URL`` / ``BENCH_REDIS_PREFIX`` the Redis server and
(unique) key prefix.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI


def _endpoint() -> FastAPI:
    app = FastAPI()
    counter = {"n": 0}

    @app.post("/posts", status_code=201)
    async def create_post(post: dict[str, Any]) -> dict[str, Any]:
        counter["n"] += 1
        return {"id": counter["n"], "title": post.get("title")}

    return app


def baseline() -> Any:
    """(a) no middleware."""
    return _endpoint()


def retrysafe_sqlite() -> Any:
    """(b)/(c) retrysafe's IdempotencyMiddleware on SQLite."""
    from retrysafe import IdempotencyMiddleware, SQLiteStore

    return IdempotencyMiddleware(_endpoint(), store=SQLiteStore(os.environ["BENCH_DB"]))


def retrysafe_sqlite_metrics() -> Any:
    """(k) as (b), with Prometheus metrics on (a registry of its own): what telemetry costs."""
    from prometheus_client import CollectorRegistry

    from retrysafe import IdempotencyMiddleware, SQLiteStore
    from retrysafe.observability import Prometheus

    return IdempotencyMiddleware(
        _endpoint(),
        store=SQLiteStore(os.environ["BENCH_DB"]),
        telemetry=Prometheus(CollectorRegistry()),
    )


def retrysafe_sqlite_no_heartbeat() -> Any:
    """(h) as (b), with lease renewal switched off: isolates what the heartbeat costs."""
    import retrysafe.server._asgi as asgi

    class _NoHeartbeat:
        bounded = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def start(self) -> _NoHeartbeat:
            return self

        def stop(self) -> None:
            pass

    setattr(asgi, "AsyncHeartbeat", _NoHeartbeat)  # noqa: B010 (a deliberate patch)
    return retrysafe_sqlite()


def competitor_sqlite() -> Any:
    """(d) fastapi-idempotency-key 0.1.1 with its SQLite backend."""
    from fastapi_idempotency_key import IdempotencyMiddleware, SQLiteBackend

    app = _endpoint()
    app.add_middleware(IdempotencyMiddleware, backend=SQLiteBackend(os.environ["BENCH_DB"]))
    return app


def retrysafe_postgres() -> Any:
    """(e) retrysafe's IdempotencyMiddleware on PostgreSQL (server clock, default pool)."""
    from retrysafe import IdempotencyMiddleware
    from retrysafe.stores import PostgresStore

    store = PostgresStore(os.environ["BENCH_PG_URL"], schema=os.environ["BENCH_PG_SCHEMA"])
    return IdempotencyMiddleware(_endpoint(), store=store)


def retrysafe_redis() -> Any:
    """(f) retrysafe's IdempotencyMiddleware on Redis (server clock)."""
    from retrysafe import IdempotencyMiddleware
    from retrysafe.stores import RedisStore

    store = RedisStore(os.environ["BENCH_REDIS_URL"], prefix=os.environ["BENCH_REDIS_PREFIX"])
    return IdempotencyMiddleware(_endpoint(), store=store)


def retrysafe_redis_py() -> Any:
    """(i) as (f), with the async face on redis-py's asyncio client instead of the lean
    transport (what retrysafe does without hiredis, or for TLS and clusters)."""
    import retrysafe.stores._redis as redis_store

    setattr(redis_store, "wire_options", None)  # noqa: B010 (a deliberate patch)
    return retrysafe_redis()


def retrysafe_postgres_unbatched() -> Any:
    """(j) as (e), each key operation on its own pool connection and transaction (no group
    commit), as before it."""
    from retrysafe.stores import PostgresStore
    from retrysafe.stores._keys import AsyncSQLKeyStore

    def one_by_one(self: PostgresStore) -> AsyncSQLKeyStore:
        return AsyncSQLKeyStore(self.connector.async_connector())

    setattr(PostgresStore, "asyncio_key_store", one_by_one)  # noqa: B010 (a deliberate patch)
    return retrysafe_postgres()


def competitor_redis() -> Any:
    """(g) fastapi-idempotency-key 0.1.1 with its RedisBackend (redis.asyncio, Lua lock)."""
    from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend

    backend = RedisBackend(
        redis_url=os.environ["BENCH_REDIS_URL"], prefix=os.environ["BENCH_REDIS_PREFIX"]
    )
    app = _endpoint()
    app.add_middleware(IdempotencyMiddleware, backend=backend)
    return app
