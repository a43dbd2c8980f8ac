"""The ``retrysafe.django`` app's migrations: each applies retrysafe's schema layout
(:func:`retrysafe.django._store.create_schema`, what ``retrysafe migrate`` does)."""

from __future__ import annotations

from typing import Any


def apply_layout(apps: Any, schema_editor: Any) -> None:
    """Create or upgrade retrysafe's tables on the migrating connection (imported here, not at
    the migration's import: Django loads every migration module to plan)."""
    from retrysafe.django._store import create_schema

    create_schema(schema_editor.connection)
