"""retrysafe's schema version 4: on SQLite a job body over 3.5 KiB is kept in
``outbox_bodies``, written once (``sql/schema.sqlite.sql``); on PostgreSQL only the version
changes. The same upgrade ``retrysafe migrate`` makes."""

from __future__ import annotations

from django.db import migrations

from retrysafe.django.migrations import apply_layout


class Migration(migrations.Migration):
    dependencies = [("retrysafe", "0002_schema_version_3")]  # noqa: RUF012 (Django reads it)
    # Reversed, the tables keep the newer layout: 0001's reverse drops them all.
    operations = [migrations.RunPython(apply_layout, migrations.RunPython.noop)]  # noqa: RUF012
