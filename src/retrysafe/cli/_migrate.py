"""``retrysafe migrate``: create or upgrade a store's schema and record its version.

SQLite and PostgreSQL keep their schema version in the ``retrysafe_meta`` table; every command
refuses a version newer than it understands. ``migrate`` creates a missing schema, upgrades an
older one (every statement is ``CREATE … IF NOT EXISTS``, so a second run changes nothing),
and exits 1 on a newer one. Redis has no schema: nothing to migrate. Besides ``retrysafe
gateway`` (which, like the middleware, creates its key store on first start), it is the one
command that creates a store; every other refuses one that does not exist and names this
command.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import click

from retrysafe.cli._common import (
    KEY_STORES,
    SCHEMA_ENV,
    SchemaName,
    canonical_scheme,
    epilog,
    errors,
    json_option,
    remember_schema,
    store_option,
)

__all__ = ["migrate"]


@dataclass(frozen=True)
class MigrateReport:
    """What ``migrate`` did: ``action`` is created, upgraded, none or not-applicable;
    ``schema`` is the PostgreSQL schema it looked at (None for other stores)."""

    store: str
    schema: str | None
    dialect: str
    action: str
    from_version: int | None
    to_version: int | None
    message: str


def _sql(url: str, schema: str) -> MigrateReport:
    """Open the SQL store with ``create=True`` (which migrates under the store's lock) and
    report what its connector did."""
    from retrysafe.stores import open_store
    from retrysafe.stores._schema import SCHEMA_VERSION

    options = {} if url.lower().startswith("sqlite:") else {"schema": schema}
    opened = open_store(url, **options)
    try:
        connector = opened.connector
        done = connector.migration
        dialect = connector.dialect if connector.dialect == "sqlite" else "postgresql"
        where = connector.url
    finally:
        opened.close()
    in_schema = schema if dialect == "postgresql" else None
    # The schema is part of where the tables are: a line without it would read the same
    # for every schema of the database.
    shown = where if in_schema is None else f"{where} (schema {in_schema!r})"
    after = SCHEMA_VERSION
    if done.action == "created":
        msg = f"created the retrysafe schema, version {after}"
    elif done.added:
        msg = f"re-created what schema version {after} lacked: {', '.join(done.added)}"
    elif done.action == "upgraded":
        msg = f"upgraded the schema from version {done.from_version} to {after}"
    else:
        msg = f"schema is at version {after}; nothing to do"
    return MigrateReport(
        where, in_schema, dialect, done.action, done.from_version, after, f"{shown}: {msg}"
    )


@click.command(
    "migrate",
    epilog=epilog(
        "for migrate: a schema newer than this retrysafe, or a store that cannot be reached;"
    ),
)
@store_option(schemes=KEY_STORES)
@click.option(
    "--schema",
    envvar=SCHEMA_ENV,
    type=SchemaName(),
    default="public",
    show_default=True,
    callback=remember_schema,
    help="PostgreSQL schema holding retrysafe's tables.",
)
@json_option
def migrate(store: str, schema: str, as_json: bool) -> None:
    """Create or upgrade the store's schema and record its version.

    sqlite and postgresql: creates missing tables (and indexes and triggers), upgrades an
    older schema, and does nothing when the schema is current; a schema written by a newer
    retrysafe is refused (exit 1). redis: no schema, nothing to migrate.
    """
    from retrysafe.stores import open_store
    from retrysafe.stores._url_check import redact_url

    scheme = store.split("://", 1)[0].lower()
    report: MigrateReport
    with errors(store, {"schema": "--schema"}):
        if canonical_scheme(store) in ("sqlite", "postgresql"):
            report = _sql(store, schema)
        else:
            # Nothing to create, but connect once so a wrong host or password is an error.
            open_store(store).close()
            report = MigrateReport(
                redact_url(store),
                None,
                scheme,
                "not-applicable",
                None,
                None,
                f"{scheme} store: no schema, nothing to migrate",
            )
    out: Any = asdict(report)
    click.echo(json.dumps(out) if as_json else report.message)
