"""Every key store runs the same contract suite (SPEC §9), against the real services.

PostgreSQL (``RETRYSAFE_TEST_POSTGRES``, default ``postgresql://postgres@127.0.0.1:5432/test``)
gets a fresh schema per test; Redis (``RETRYSAFE_TEST_REDIS``, default
``redis://127.0.0.1:6379/0``) a fresh key prefix per test; both are removed afterwards. When a
service is unreachable the tests using it are skipped with the reason — except under
``CI=true``, where they fail: CI must never go green without the real stores.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from retrysafe.stores import KeyStore, MemoryStore, SQLiteStore

PG_URL = os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RETRYSAFE_TEST_REDIS", "redis://127.0.0.1:6379/0")
KEY_STORES = ["sqlite", "memory", "postgres", "redis"]


def _unreachable(service: str, url: str, exc: BaseException) -> None:
    reason = f"{service} at {url} is unreachable ({type(exc).__name__}: {exc})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; under CI=true the store tests must run, not skip")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The test PostgreSQL URL, once checked reachable (skip or, under CI, fail)."""
    import psycopg

    try:
        with psycopg.connect(PG_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        _unreachable("PostgreSQL", PG_URL, exc)
    return PG_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis URL, once checked reachable (skip or, under CI, fail)."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
        client.close()
    except redis.RedisError as exc:
        _unreachable("Redis", REDIS_URL, exc)
    return REDIS_URL


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh, unique PostgreSQL schema name; the schema is dropped after the test."""
    import psycopg

    name = f"rs_test_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A fresh, unique Redis key prefix; every key under it is deleted after the test."""
    import redis

    prefix = f"rs-test:{uuid.uuid4().hex[:16]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def open_test_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path, **kw: Any) -> Any:
    """Open a store of ``kind`` on a private namespace (caller's clock for the SQL/Redis ones,
    so the contract tests can drive time with ``now``)."""
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "keys.db")
    if kind == "memory":
        return MemoryStore()
    if kind == "postgres":
        from retrysafe.stores import PostgresStore

        schema = request.getfixturevalue("pg_schema")
        kw.setdefault("clock", "caller")
        return PostgresStore(request.getfixturevalue("pg_url"), schema=schema, **kw)
    if kind == "redis":
        from retrysafe.stores import RedisStore

        prefix = request.getfixturevalue("redis_prefix")
        kw.setdefault("clock", "caller")
        return RedisStore(request.getfixturevalue("redis_url"), prefix=prefix, **kw)
    raise AssertionError(kind)


@pytest.fixture(params=KEY_STORES)
def key_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyStore]:
    store: KeyStore = open_test_store(request.param, request, tmp_path)
    yield store
    store.close()
