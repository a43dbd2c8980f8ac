from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    operations = [  # noqa: RUF012 (Django reads it)
        migrations.CreateModel(
            name="Charge",
            fields=[
                ("id", models.AutoField(primary_key=True, serialize=False)),
                ("key", models.CharField(db_index=True, max_length=255)),
                ("amount", models.IntegerField()),
            ],
        )
    ]
