"""Stores for the model tests, each on the caller's clock (the machines drive ``now``), and
the example budget of the machines that talk to a real database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from retrysafe.stores import KeyStore, MemoryStore, SQLiteStore

#: Every key store (SPEC §9): the model test of the key-store contract runs on each.
KEY_STORES = ["sqlite", "memory", "postgres", "redis"]
#: Every store with an outbox.
OUTBOX_STORES = ["sqlite", "postgres"]


def model_settings(share: float = 1.0) -> settings:
    """The current profile, with ``share`` of its examples (a machine's examples each run
    dozens of statements against a real database, so it gets fewer than a pure property)."""
    current = settings()  # the loaded profile's values
    return settings(current, max_examples=max(5, int(current.max_examples * share)))


def open_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh store of ``kind`` in a private namespace, on the caller's clock."""
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "model.db")
    if kind == "memory":
        return MemoryStore()
    if kind == "postgres":
        from retrysafe.stores import PostgresStore

        url = request.getfixturevalue("pg_url")
        return PostgresStore(url, schema=request.getfixturevalue("pg_schema"), clock="caller")
    if kind == "redis":
        from retrysafe.stores import RedisStore

        url = request.getfixturevalue("redis_url")
        return RedisStore(url, prefix=request.getfixturevalue("redis_prefix"), clock="caller")
    raise AssertionError(kind)


@pytest.fixture(params=KEY_STORES)
def key_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyStore]:
    """One store per test; the machine's examples share it and clean up after themselves."""
    store: KeyStore = open_store(request.param, request, tmp_path)
    yield store
    store.close()


@pytest.fixture(params=OUTBOX_STORES)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A SQLite or PostgreSQL store (for its outbox), one per test."""
    store = open_store(request.param, request, tmp_path)
    yield store
    store.close()
