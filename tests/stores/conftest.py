"""Every key store runs the same contract suite (SPEC §9)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from retrysafe.stores import KeyStore, MemoryStore, SQLiteStore


@pytest.fixture(params=["sqlite", "memory"])
def key_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyStore]:
    store: KeyStore = (
        SQLiteStore(tmp_path / "keys.db") if request.param == "sqlite" else MemoryStore()
    )
    yield store
    store.close()
