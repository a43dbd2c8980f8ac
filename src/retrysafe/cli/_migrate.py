"""``retrysafe migrate``: create or upgrade a store's schema and record its version.

SQLite and PostgreSQL keep their schema version in the ``retrysafe_meta`` table; every command
refuses a version newer than it understands. ``migrate`` creates a missing schema, upgrades an
older one (every statement is ``CREATE … IF NOT EXISTS``, so a second run changes nothing),
and exits 1 on a newer one. Redis has no schema: nothing to migrate.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from retrysafe._exceptions import RetrysafeError
from retrysafe.cli._common import fail, store_option

__all__ = ["migrate"]


@dataclass(frozen=True)
class MigrateReport:
    """What ``migrate`` did: ``action`` is created, upgraded, none or not-applicable."""

    store: str
    dialect: str
    action: str
    from_version: int | None
    to_version: int | None
    message: str


def _newer(store: str, found: int, understood: int) -> str:
    return (
        f"{store} has schema version {found}; this retrysafe understands up to {understood}. "
        "Upgrade retrysafe (`pip install -U retrysafe`), then run `retrysafe migrate` again."
    )


def _sqlite(url: str) -> MigrateReport:
    from retrysafe.stores._sqlite import SCHEMA_VERSION, SQLiteStore, sqlite_path_from_url

    path = sqlite_path_from_url(url)
    before: int | None = None
    if Path(path).expanduser().is_file():
        conn = sqlite3.connect(f"file:{Path(path).expanduser()}?mode=ro", uri=True)
        try:
            row = conn.execute(
                "SELECT value FROM retrysafe_meta WHERE name = 'schema_version'"
            ).fetchone()
            before = None if row is None else int(row[0])
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
        finally:
            conn.close()
    if before is not None and before > SCHEMA_VERSION:
        fail(_newer(f"SQLite store {path}", before, SCHEMA_VERSION))
    SQLiteStore(path).close()  # creates or upgrades under its write lock
    return _report(url, "sqlite", before, SCHEMA_VERSION, complete=True)


def _postgres(url: str, schema: str) -> MigrateReport:
    import psycopg

    from retrysafe.stores._postgres import (
        _SCHEMA_NAME,
        SCHEMA_VERSION,
        PostgresStore,
        schema_state,
    )

    if not _SCHEMA_NAME.match(schema):
        fail(f"--schema {schema!r} must be a plain identifier (letters, digits, _)")
    before: int | None = None
    complete = False
    try:
        with psycopg.connect(
            url, autocommit=True, connect_timeout=5, options=f"-c search_path={schema}"
        ) as conn:
            before, complete = schema_state(conn)
    except psycopg.Error:
        pass  # the store's constructor below reports it, password redacted
    # Creates or upgrades under an advisory lock; a newer version raises SchemaError naming
    # both versions and `retrysafe migrate`.
    opened = PostgresStore(url, schema=schema)
    where = opened.where
    opened.close()
    return _report(f"postgresql://{where}", "postgresql", before, SCHEMA_VERSION, complete)


def _report(
    store: str, dialect: str, before: int | None, after: int, complete: bool
) -> MigrateReport:
    if before is None:
        action, msg = "created", f"created the retrysafe schema, version {after}"
    elif before < after:
        action, msg = "upgraded", f"upgraded the schema from version {before} to {after}"
    elif not complete:
        action, msg = "upgraded", f"added missing feature tables to schema version {after}"
    else:
        action, msg = "none", f"schema is at version {after}; nothing to do"
    return MigrateReport(store, dialect, action, before, after, f"{store}: {msg}")


@click.command("migrate")
@store_option
@click.option(
    "--schema",
    default="public",
    show_default=True,
    help="PostgreSQL schema holding retrysafe's tables.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def migrate(store: str, schema: str, as_json: bool) -> None:
    """Create or upgrade the store's schema and record its version.

    sqlite and postgresql: creates missing tables, upgrades an older schema, and does
    nothing when the schema is current; a schema written by a newer retrysafe is refused
    (exit 1). redis: no schema, nothing to migrate.
    """
    scheme = store.split("://", 1)[0].lower() if "://" in store else ""
    report: MigrateReport
    try:
        if scheme == "sqlite":
            report = _sqlite(store)
        elif scheme in ("postgresql", "postgres"):
            report = _postgres(store, schema)
        elif scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "memory"):
            # Nothing to create, but connect once so a wrong host or password is an error.
            from retrysafe.stores import open_store
            from retrysafe.stores._url_check import redact_url

            open_store(store).close()
            report = MigrateReport(
                redact_url(store),
                scheme,
                "not-applicable",
                None,
                None,
                f"{scheme} store: no schema, nothing to migrate",
            )
        else:
            fail(f"store URL {store!r} is not a sqlite://, postgresql:// or redis:// URL")
    except RetrysafeError as exc:
        fail(str(exc))
    except (sqlite3.Error, ValueError) as exc:
        fail(f"cannot read the schema version of {store}: {exc}")
    out: Any = asdict(report)
    click.echo(json.dumps(out) if as_json else report.message)
