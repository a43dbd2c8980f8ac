"""The schema rule, once for both SQL dialects: read the version and the missing tables, refuse
or migrate, and say what was done.

The layout of every feature is one versioned unit per dialect (``sql/schema.<dialect>.sql``);
its tables are the ``CREATE TABLE IF NOT EXISTS`` names of that file, so a table dropped by hand
is found and re-created like a missing feature's; a column a later version adds to an existing
table is in :data:`ADDED_COLUMNS`, and an upgrade adds it where it is missing. A connector reads
the state (:class:`State`), calls :func:`schema_check` (refuse, or "migrate needed"), and
migrates under its dialect's lock, re-reading the state there so that of two processes migrating
at once one creates and the other finds nothing to do (:func:`schema_action` says which).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from retrysafe._exceptions import SchemaError

logger = logging.getLogger("retrysafe.stores")

__all__ = [
    "ADDED_COLUMNS",
    "MIGRATE_HINT",
    "SCHEMA_VERSION",
    "Migration",
    "State",
    "indexes",
    "migrate",
    "parse_version",
    "schema_action",
    "schema_check",
    "tables",
]

#: What a store without a usable schema says to do: the command first, then the Python way
#: (``retrysafe keys`` names its own migrate command in place of the first).
MIGRATE_HINT = "run `retrysafe migrate --store URL`; from Python, open the store with create=True"

#: The schema version this release writes and understands.
#:
#: 1. keys, outbox, webhooks, agent runs;
#: 2. ``idempotency_keys.created_at``: when the record's claim was made (``retrysafe keys``
#:    lists keys newest first); NULL for records claimed before the upgrade;
#: 3. SQLite: ``outbox_attempts`` keyed by the job's creation time first, so that a batch's
#:    attempt records share pages (the table is rebuilt on upgrade: ``REBUILT_TABLES`` in
#:    ``stores/_sqlite.py``); PostgreSQL's layout is unchanged.
#: 4. SQLite: ``outbox_bodies``, a job body over 3.5 KiB written once instead of with every
#:    update of its row (jobs written earlier keep theirs in the row); PostgreSQL's layout is
#:    unchanged (it keeps a large unchanged value out of the rewritten row already: TOAST).
SCHEMA_VERSION = 4

#: Columns added to a table after the table was first released: ``(table, column, block)``.
#: A table created by the current layout has them already; upgrading adds each one the table
#: lacks: PostgreSQL in its layout script (``ADD COLUMN IF NOT EXISTS``), SQLite by running
#: ``block`` of ``sql/schema.sqlite.sql`` when the table has no such column.
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("idempotency_keys", "created_at", "add_keys_created_at"),
)

_TABLE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)", re.IGNORECASE)
_INDEX_OR_TRIGGER = re.compile(
    r"CREATE (?:UNIQUE INDEX|INDEX|TRIGGER) IF NOT EXISTS (\w+)", re.IGNORECASE
)


def tables(*scripts: str) -> tuple[str, ...]:
    """The table names the schema scripts create, in order."""
    return tuple(name for script in scripts for name in _TABLE.findall(script))


def indexes(*scripts: str) -> tuple[str, ...]:
    """The index and trigger names the schema scripts create, in order. One dropped by hand
    (a trigger that deletes a job's attempts with it, an index a claim walks) makes the
    schema not current, so a migration re-creates it (the scripts' ``IF NOT EXISTS`` leave
    the rest alone)."""
    return tuple(name for script in scripts for name in _INDEX_OR_TRIGGER.findall(script))


def parse_version(raw: object, where: str) -> int:
    """The stored ``schema_version`` as an int.

    Raises:
        SchemaError: it is not a whole number (edited by hand, or not retrysafe's table).
    """
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()):  # "³" and "٣" are digits to isdigit()
        raise SchemaError(
            f"{where} has an unreadable schema version {raw!r} in retrysafe_meta (expected a "
            f"whole number up to {SCHEMA_VERSION}); fix or remove that row, then "
            f"{MIGRATE_HINT}",
            store=where,
        )
    return int(text)


@dataclass(frozen=True, slots=True)
class State:
    """The schema as the database holds it: ``version`` (None: no retrysafe schema) and what
    of the current layout is missing: ``missing``, the tables (by name) and the tables of an
    earlier layout or without a column (as ``table.column``), without which the statements
    fail; ``unindexed``, the indexes and triggers (:func:`indexes`), without which they
    run slower or a purge leaves a job's attempts behind."""

    version: int | None
    missing: tuple[str, ...]
    unindexed: tuple[str, ...] = ()

    @property
    def current(self) -> bool:
        return self.version == SCHEMA_VERSION and not self.missing and not self.unindexed

    @property
    def usable(self) -> bool:
        """Whether the statements can run on it (the indexes and triggers aside)."""
        return self.version == SCHEMA_VERSION and not self.missing


@dataclass(frozen=True, slots=True)
class Migration:
    """What opening the store did: ``action`` is ``"created"``, ``"upgraded"`` or ``"none"``;
    ``from_version`` the version found (None: no schema); ``added`` the tables it created in a
    schema that had a version already."""

    action: str
    from_version: int | None
    added: tuple[str, ...] = ()


#: The usable-but-incomplete schemas already warned of in this process (see schema_check).
_WARNED: set[tuple[str, int | None, tuple[str, ...]]] = set()


def schema_check(state: State, where: str, *, create: bool) -> bool:
    """Whether the store must migrate (False: the schema is current).

    Raises:
        SchemaError: the schema is newer than this release (always), or it is missing, older
            or lacks tables and ``create`` is False; the message names the version or the
            tables and says to run ``retrysafe migrate``.
    """
    if state.version is not None and state.version > SCHEMA_VERSION:
        raise SchemaError(
            f"{where} has schema version {state.version}; this retrysafe understands up to "
            f"{SCHEMA_VERSION}. Upgrade retrysafe (`pip install -U retrysafe`), then "
            f"{MIGRATE_HINT}.",
            store=where,
        )
    if state.current:
        return False
    if create:
        return True
    if state.usable:  # a read-only copy without an index is still read
        said = (where, state.version, state.unindexed)
        if said not in _WARNED:  # once per process (a command may open a store twice)
            _WARNED.add(said)
            logger.warning(
                "%s has schema version %s without %s (%s)",
                where,
                state.version,
                ", ".join(state.unindexed),
                MIGRATE_HINT,
            )
        return False
    if state.version is None:
        what = "no retrysafe schema"
    elif state.version < SCHEMA_VERSION:
        what = f"an older schema (version {state.version}; this retrysafe writes {SCHEMA_VERSION})"
    else:
        what = f"schema version {state.version} without " + ", ".join(
            state.missing + state.unindexed
        )
    raise SchemaError(f"{where} has {what} ({MIGRATE_HINT})", store=where)


def migrate(
    where: str,
    *,
    create: bool,
    read: Callable[[], State],
    locked: Callable[[], AbstractContextManager[object]],
    apply: Callable[[], None],
) -> Migration:
    """The migration conversation, for both dialects: read the state; if it is not current
    (and :func:`schema_check` allows), take the dialect's lock (``locked()``: SQLite's ``BEGIN
    IMMEDIATE``, PostgreSQL's advisory lock in a transaction), read it again there — another
    process may have migrated meanwhile — and ``apply()`` the layout's script (every statement
    ``IF NOT EXISTS``) unless it became current.

    Returns:
        What was done (exactly one of concurrent migrations reports ``"created"``).

    Raises:
        SchemaError: as :func:`schema_check`.
    """
    state = read()
    if not schema_check(state, where, create=create):
        return Migration("none", state.version)
    with locked():
        state = read()
        schema_check(state, where, create=True)
        if not state.current:
            apply()
    return schema_action(state)


def schema_action(before: State) -> Migration:
    """What a migration that found ``before`` (under the lock) did."""
    if before.current:
        return Migration("none", before.version)
    if before.version is None:
        return Migration("created", None)
    added = before.missing + before.unindexed if before.version == SCHEMA_VERSION else ()
    return Migration("upgraded", before.version, added)
