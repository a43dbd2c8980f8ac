"""URL checks shared by the store opener and the stores themselves (no driver imports)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from retrysafe._exceptions import ConfigurationError

__all__ = ["check_postgres_url", "redact_url"]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def check_postgres_url(url: str) -> None:
    """Refuse a PostgreSQL URL that names no database.

    libpq would fall back to defaults (the OS user's database on localhost), and the schema
    would be created somewhere nobody asked for.

    Raises:
        ConfigurationError: no database in the path and no ``dbname=`` parameter.
    """
    if "://" not in url:
        return  # a libpq key=value string: it names its own dbname or fails on its own
    parts = urlsplit(url)
    if parts.path.strip("/") or "dbname=" in parts.query:
        return
    raise ConfigurationError(
        f"PostgreSQL URL {redact_url(url)!r} names no database; expected "
        "postgresql://user@host:5432/dbname",
        option="store",
    )
