from __future__ import annotations

from django.db import models


class Charge(models.Model):
    """One effect: a row per time the view ran."""

    key: models.CharField[str, str] = models.CharField(max_length=255, db_index=True)
    amount: models.IntegerField[int, int] = models.IntegerField()

    class Meta:
        app_label = "shop"
