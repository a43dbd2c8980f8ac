"""The ``RETRYSAFE`` setting: read and checked once, at startup (Django's app loading or the
middleware's construction), so a mistake is an ``ImproperlyConfigured`` before any request.

    RETRYSAFE = {
        "STORE": "django",             # Django's own database ("django:<alias>" for another),
                                       # or a store URL: sqlite:///keys.db, postgresql://…, redis://…
        "METHODS": ["POST", "PATCH"],  # protected methods
        "KEY_REQUIRED": False,         # True, or path regexes (re.fullmatch), or "pkg.mod.fn"
        "SCOPE": None,                 # "pkg.mod.fn" or a callable fn(request) -> str
        "LEASE": 10.0,                 # seconds; and every other IdempotencyConfig option
        "TRANSACTIONAL": False,        # the view's writes and the key's completion commit together
    }
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.module_loading import import_string

from retrysafe._exceptions import ConfigurationError, RetrysafeError
from retrysafe.server._config import IdempotencyConfig

__all__ = ["DjangoSettings", "load_settings"]

SETTING = "RETRYSAFE"

#: ``RETRYSAFE`` names of the IdempotencyConfig options, and their field names.
_CONFIG_NAMES = {
    f.name.upper(): f.name
    for f in fields(IdempotencyConfig)
    if f.name not in ("protected_methods", "key_required", "scope", "clock", "telemetry")
}
_OWN = ("STORE", "METHODS", "KEY_REQUIRED", "SCOPE", "TRANSACTIONAL", "TELEMETRY")
NAMES = (*_OWN, *sorted(_CONFIG_NAMES))

#: Option → what its value must be (checked here: IdempotencyConfig checks ranges).
_DURATIONS = ("LEASE", "HEARTBEAT", "MAX_RUN_TIME", "RETENTION", "IN_PROGRESS_WAIT")
_INTS = ("MAX_BODY_SIZE", "MAX_REPLAY_SIZE", "KEY_REUSED_STATUS")
_BOOLS = ("STORE_SERVER_ERRORS", "FAIL_OPEN", "TRANSACTIONAL")

Scope = Callable[[HttpRequest], str]


@dataclass(frozen=True)
class DjangoSettings:
    """The checked ``RETRYSAFE`` setting.

    Attributes:
        store: ``("django", alias)`` for Django's database, else ``("url", URL)``.
        config: the engine's :class:`~retrysafe.server.IdempotencyConfig`.
        scope: ``fn(request) -> str`` naming who owns a key, or None for the config's
            header-based scope (the Authorization header's SHA-256, SPEC §2).
        transactional: run each claimed request's view inside ``transaction.atomic()`` and
            complete the key in that transaction.
    """

    store: tuple[str, str]
    config: IdempotencyConfig
    scope: Scope | None
    transactional: bool


def _bad(name: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{SETTING}[{name!r}]: {message}")


def _callable(name: str, value: object, what: str) -> Callable[..., Any]:
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise _bad(name, f"cannot import {value!r}: {exc}") from exc
    if not callable(value):
        raise _bad(name, f"must be a dotted path or a callable {what}, got {value!r}")
    return value


def _store(value: object, *, transactional: bool) -> tuple[str, str]:
    """Check ``STORE`` without connecting to anything: an alias of ``DATABASES`` on SQLite or
    PostgreSQL, or a well-formed store URL (a SQLite file whose directory exists)."""
    if not isinstance(value, str) or not value.strip():
        raise _bad(
            "STORE",
            f"must be 'django', 'django:<alias>' or a store URL (sqlite:///keys.db, "
            f"postgresql://…, redis://…), got {value!r}",
        )
    if value == "django" or value.startswith("django:"):
        alias = "default" if value == "django" else value[len("django:") :]
        if not alias:
            raise _bad("STORE", "'django:' needs a database alias, e.g. 'django:default'")
        _django_database(alias)
        return ("django", alias)
    if "://" not in value:
        raise _bad(
            "STORE",
            f"{value!r} is neither 'django', 'django:<alias>' nor a store URL "
            "(sqlite:///keys.db, postgresql://…, redis://…)",
        )
    if transactional:
        raise _bad(
            "TRANSACTIONAL",
            "needs STORE 'django' (or 'django:<alias>'), so the key completes in the view's "
            f"own transaction; got {value.split('://')[0]}://…",
        )
    _check_url(value)
    return ("url", value)


def _django_database(alias: str) -> None:
    from django.conf import settings

    databases = getattr(settings, "DATABASES", {}) or {}
    if alias not in databases:
        raise _bad(
            "STORE",
            f"DATABASES has no database {alias!r} (configured: "
            f"{', '.join(sorted(databases)) or 'none'})",
        )
    engine = str(databases[alias].get("ENGINE", ""))
    if not engine.endswith(("sqlite3", "postgresql", "postgis")):
        raise _bad(
            "STORE",
            f"database {alias!r} is {engine or 'not configured'}; the key store on Django's "
            "database supports SQLite (django.db.backends.sqlite3) and PostgreSQL "
            "(django.db.backends.postgresql, psycopg 3); give a store URL for others",
        )


def _check_url(url: str) -> None:
    """A store URL's shape (the drivers connect later): the scheme, a SQLite file's
    directory, a PostgreSQL database name, a Redis database number."""
    from pathlib import Path

    from retrysafe.stores._sqlite import sqlite_path_from_url
    from retrysafe.stores._url_check import (
        CLUSTER_SCHEMES,
        check_postgres_url,
        check_redis_url,
        parse_cluster_url,
        redact_url,
    )

    scheme = url.split("://", 1)[0].lower()
    try:
        if scheme == "sqlite":
            parent = Path(sqlite_path_from_url(url)).expanduser().resolve().parent
            if not parent.is_dir():
                raise ConfigurationError(f"directory {str(parent)!r} does not exist")
        elif scheme in ("postgresql", "postgres"):
            check_postgres_url(url)
        elif scheme in ("redis", "rediss"):
            check_redis_url(url)
        elif scheme in CLUSTER_SCHEMES:
            parse_cluster_url(url)
        elif scheme == "memory":
            raise ConfigurationError(
                "memory:// forgets every key when the process restarts and is not shared "
                "between worker processes, so retries would run again (tests only, SPEC "
                "§9); use 'django' or a SQLite, PostgreSQL or Redis URL"
            )
        else:
            raise ConfigurationError(
                f"{redact_url(url)!r} is not a store URL retrysafe knows (sqlite:///…, "
                "postgresql://…, redis://…, redis+cluster://…)"
            )
    except ConfigurationError as exc:
        raise _bad("STORE", str(exc)) from exc


def _key_required(value: object) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)):
        patterns = []
        for item in value:
            if not isinstance(item, str):
                raise _bad("KEY_REQUIRED", f"patterns must be strings, got {item!r}")
            try:
                patterns.append(re.compile(item))
            except re.error as exc:
                raise _bad("KEY_REQUIRED", f"{item!r} is not a regular expression: {exc}") from exc

        def required(method: str, path: str) -> bool:
            return any(p.fullmatch(path) for p in patterns)

        return required
    return _callable("KEY_REQUIRED", value, "fn(method, path) -> bool, a bool or path regexes")


def load_settings(raw: object) -> DjangoSettings:
    """Check the ``RETRYSAFE`` setting (a dict; missing: every default, Django's database).

    Raises:
        ImproperlyConfigured: not a dict, an unknown option (with the nearest name), a value
            of the wrong type, or one the middleware's configuration refuses (the message
            names the option).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"{SETTING} must be a dict of options, got {raw!r}")
    unknown = [k for k in raw if k not in NAMES]
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(str(name).upper(), NAMES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ImproperlyConfigured(
            f"{SETTING}: unknown option {name!r}{hint}; options are {', '.join(NAMES)}"
        )
    for name in _BOOLS:
        if name in raw and not isinstance(raw[name], bool):
            raise _bad(name, f"must be True or False, got {raw[name]!r}")
    for name in _DURATIONS:
        value = raw.get(name)
        if name in raw and not (
            (value is None and name == "HEARTBEAT")
            or isinstance(value, timedelta)
            or (isinstance(value, (int, float)) and not isinstance(value, bool))
        ):
            raise _bad(name, f"must be seconds (a number) or a timedelta, got {value!r}")
    for name in _INTS:
        if name in raw and (isinstance(raw[name], bool) or not isinstance(raw[name], int)):
            raise _bad(name, f"must be an integer, got {raw[name]!r}")
    options: dict[str, Any] = {
        field: raw[name] for name, field in _CONFIG_NAMES.items() if name in raw
    }
    if "METHODS" in raw:
        methods = raw["METHODS"]
        if not isinstance(methods, (list, tuple, set, frozenset)) or not all(
            isinstance(m, str) for m in methods
        ):
            raise _bad("METHODS", f"must be a list of method names, got {methods!r}")
        options["protected_methods"] = methods
    if "KEY_REQUIRED" in raw:
        options["key_required"] = _key_required(raw["KEY_REQUIRED"])
    if raw.get("TELEMETRY") is not None:
        options["telemetry"] = raw["TELEMETRY"]
    scope = None
    if raw.get("SCOPE") is not None:
        scope = _callable("SCOPE", raw["SCOPE"], "fn(request) -> str")
    try:
        config = IdempotencyConfig(**options)
    except ConfigurationError as exc:
        option = (exc.option or "").upper()
        name = "METHODS" if option == "PROTECTED_METHODS" else option
        raise _bad(name or "?", str(exc)) from exc
    except (RetrysafeError, TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{SETTING}: {exc}") from exc
    transactional = bool(raw.get("TRANSACTIONAL", False))
    return DjangoSettings(
        store=_store(raw.get("STORE", "django"), transactional=transactional),
        config=config,
        scope=scope,
        transactional=transactional,
    )
