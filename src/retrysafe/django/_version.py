"""Which Django versions this integration supports, checked at import."""

from __future__ import annotations

from importlib import metadata

from retrysafe._exceptions import ConfigurationError

__all__ = ["SUPPORTED", "check_django"]

#: ``(lowest, first unsupported)`` major.minor: Django 4.2 (psycopg 3, async middleware as
#: used here) up to the 6.x series.
SUPPORTED = ((4, 2), (7, 0))
_RANGE = ">=4.2,<7"


def _installed() -> str:
    return metadata.version("django")


def check_django() -> None:
    """Check the installed Django against the supported range.

    Raises:
        ImportError: Django is not installed (the message names the extra).
        ConfigurationError: its version is outside the range (the message names both), as the
            agent framework adapters refuse theirs.
    """
    try:
        found = _installed()
    except metadata.PackageNotFoundError as exc:
        raise ImportError(
            f"retrysafe.django needs Django {_RANGE}: pip install 'retrysafe[django]'"
        ) from exc
    parts = found.split(".")
    try:
        version = (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0))
    except (IndexError, ValueError):
        raise ConfigurationError(
            f"retrysafe.django cannot read the installed Django version {found!r}; "
            f"supported: Django {_RANGE}",
            option="django",
        ) from None
    low, high = SUPPORTED
    if not low <= version < high:
        raise ConfigurationError(
            f"retrysafe.django supports Django {_RANGE}; found Django {found} "
            "(pip install 'retrysafe[django]' installs a supported one)",
            option="django",
        )
