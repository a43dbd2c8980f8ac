"""Which Django versions this integration supports, checked at import."""

from __future__ import annotations

from retrysafe._versions import require, specifier

__all__ = ["SUPPORTED", "check_django"]

#: ``(lowest, first unsupported)`` major.minor: Django 4.2 (psycopg 3, async middleware as
#: used here) up to the 6.x series.
LOWEST, BEYOND = (4, 2), (7, 0)
SUPPORTED = specifier(LOWEST, BEYOND)


def check_django() -> str:
    """The installed Django's version, once checked against :data:`SUPPORTED`.

    Raises:
        ImportError: Django is not installed (the message names the extra).
        ConfigurationError: its version is outside the range (the message names both).
    """
    return require(
        "django",
        label="Django",
        user="retrysafe.django",
        lowest=LOWEST,
        beyond=BEYOND,
        extra="django",
    )
