"""SQLite-specific behaviour: processes sharing a file, bad files, schema versions."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path

import pytest

from retrysafe import ConfigurationError, RetrysafeError, SchemaError, StoreUnavailableError
from retrysafe.stores import SQLiteStore, open_store

H = "b" * 64


def _claim_in_process(path: str, barrier: object, out: object) -> None:
    store = SQLiteStore(path, busy_timeout=30)
    barrier.wait()  # type: ignore[attr-defined]
    claimed, _ = store.claim(H, "fp", now=1.0, lease=10, retention=100)
    out.put(claimed)  # type: ignore[attr-defined]
    store.close()


def test_processes_sharing_a_file_have_one_winner(tmp_path: Path) -> None:
    """Eight processes claiming one key in one SQLite file: exactly one wins."""
    path = str(tmp_path / "shared.db")
    SQLiteStore(path).close()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(8)
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(path, barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results.count(True) == 1


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A path in a directory that does not exist fails at startup, naming the directory."""
    with pytest.raises(ConfigurationError, match="does not exist"):
        SQLiteStore(tmp_path / "nope" / "keys.db")


def test_read_only_connection_is_unavailable(tmp_path: Path) -> None:
    """A database that refuses writes surfaces as StoreUnavailableError (→ 503)."""
    path = tmp_path / "ro.db"
    SQLiteStore(path).close()
    store = SQLiteStore(path)
    store.run(lambda c: c.execute("PRAGMA query_only=ON"))
    with pytest.raises(StoreUnavailableError):
        store.claim(H, "fp", now=1.0, lease=1, retention=1)
    store.run(lambda c: c.execute("PRAGMA query_only=OFF"))
    assert store.claim(H, "fp", now=1.0, lease=1, retention=1)[0]


def test_locked_file_is_unavailable(tmp_path: Path) -> None:
    """Another connection holding the write lock makes a write fail fast as unavailable."""
    path = tmp_path / "locked.db"
    store = SQLiteStore(path, busy_timeout=0.05)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailableError):
            store.claim(H, "fp", now=1.0, lease=1, retention=1)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.claim(H, "fp", now=1.0, lease=1, retention=1)[0]


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file written by a newer retrysafe is refused with a SchemaError."""
    path = tmp_path / "new.db"
    SQLiteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE retrysafe_meta SET value='999' WHERE name='schema_version'")
    with pytest.raises(SchemaError, match="999"):
        SQLiteStore(path)


def test_missing_schema_without_create_is_refused(tmp_path: Path) -> None:
    """create=False on an empty file names the migrate command."""
    with pytest.raises(SchemaError, match="migrate"):
        SQLiteStore(tmp_path / "empty.db", create=False)


def test_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    """A file that is not SQLite fails at startup with a retrysafe error, not a traceback."""
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(RetrysafeError, match="not a database"):
        SQLiteStore(path)


@pytest.mark.parametrize(
    "url", ["keys.db", "sqlite://keys.db", "sqlite:///", "mysql://x/y", 42]
)
def test_bad_store_urls_are_clear_errors(url: object) -> None:
    """Malformed or unsupported URLs raise ConfigurationError."""
    with pytest.raises(ConfigurationError):
        open_store(url)  # type: ignore[arg-type]


def test_sqlite_url_opens_a_file(tmp_path: Path) -> None:
    """sqlite:////abs/path.db opens that file."""
    store = open_store(f"sqlite:///{tmp_path}/via-url.db")
    assert isinstance(store, SQLiteStore)
    assert (tmp_path / "via-url.db").exists()
    store.close()
