"""Shared fixtures. Tests use real SQLite files, real sockets and seeded randomness."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from retrysafe.stores import SQLiteStore


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "retrysafe.db"


@pytest.fixture
def sqlite_store(sqlite_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(sqlite_path)
    yield store
    store.close()
