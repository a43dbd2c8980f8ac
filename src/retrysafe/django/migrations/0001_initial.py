"""retrysafe's tables (idempotency keys; outbox, webhooks and agent runs beside them), in the
layout ``retrysafe migrate`` writes, created on the migrating connection's database."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from retrysafe.django.migrations import apply_layout


def _drop(apps: Any, schema_editor: Any) -> None:
    from retrysafe.django._store import drop_schema

    drop_schema(schema_editor.connection)


class Migration(migrations.Migration):
    initial = True
    operations = [migrations.RunPython(apply_layout, _drop)]  # noqa: RUF012 (Django reads it)
