"""retrysafe's schema version 3: on SQLite the outbox's attempts are rebuilt keyed by their
job's creation time (see ``retrysafe.stores._sqlite.REBUILT_TABLES``); on PostgreSQL only the
version changes. The same upgrade ``retrysafe migrate`` makes."""

from __future__ import annotations

from django.db import migrations

from retrysafe.django.migrations import apply_layout


class Migration(migrations.Migration):
    dependencies = [("retrysafe", "0001_initial")]  # noqa: RUF012 (Django reads it)
    # Reversed, the tables keep the newer layout: 0001's reverse drops them all.
    operations = [migrations.RunPython(apply_layout, migrations.RunPython.noop)]  # noqa: RUF012
