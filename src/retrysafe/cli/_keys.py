"""``retrysafe keys list | show | evict``: the idempotency keys a store holds, for the person
on call (SPEC §10): "what did we store for this key?", "are we replaying or re-running?".

A store keeps only ``core.key_hash(scope, key)``, so a key is named the way the middleware names
it: the key as the client sent it (the ``Idempotency-Key`` value, quoted or bare) and its scope,
given as the middleware derives it — ``--authorization VALUE`` (the request's Authorization
value, hashed exactly as the default scope :func:`~retrysafe.core.scope_from_authorization`
hashes it), ``--scope TEXT`` (what an application's own scope function returns), or neither (a
request without Authorization). Or by ``--hash``: a key hash, or a unique start of one, as
``keys list`` shows them. Neither the scope nor the credential is stored or printed.

The store primitives are :class:`~retrysafe.stores._base.KeyAdmin`'s (every key store of the
package: SQLite, PostgreSQL, Redis and Redis Cluster). ``memory://`` lives inside the process
that opened it, so this command, a process of its own, refuses it. Errors are one line and the
exit codes are docs/cli.md's (:mod:`retrysafe.cli._common`).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import re
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource

from retrysafe._exceptions import ConfigurationError, InvalidKeyError, StoreError
from retrysafe.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    KEY_STORES,
    SCHEMA_ENV,
    STORE_ENV,
    SchemaName,
    StoreOption,
    StoreURL,
    StrParamType,
    canonical_scheme,
    check_can_ask,
    clip,
    epilog,
    errors,
    fail,
    json_option,
    opened_store,
    plain_cell,
    print_table,
    shown_value,
    visible_text,
)
from retrysafe.core import (
    Claim,
    InProgress,
    KeyRecord,
    KeyState,
    Replay,
    ReplayUnavailable,
    StoredResponse,
    TakeOver,
    decide,
    key_hash,
    parse_key,
    scope_from_authorization,
)
from retrysafe.stores._base import ENTRY_STATES, KeyAdmin, KeyEntry, KeyPosition
from retrysafe.stores._schema import MIGRATE_HINT

__all__ = ["KeyAdminSource", "key_lookup", "keys", "next_attempt"]

_LIMIT = click.IntRange(min=1, max=1_000_000)
_FLAGS = {"store": "--store", "schema": "--schema", "prefix": "--prefix", "limit": "--limit"}
_DEFAULT_PREFIX = "retrysafe:"
_MEANING = (
    "evicting a key makes the store forget it: the next request with this key runs the "
    "handler again, so its effect happens again"
)
#: The most candidates an ambiguous --hash names.
_CANDIDATES = 10


class KeyStoreURL(StoreURL):
    """``--store`` of the ``keys`` commands: a key store (:data:`KEY_STORES`); ``memory://``
    is refused with the reason (its keys live in the process that opened it)."""

    def __init__(self) -> None:
        super().__init__(KEY_STORES)

    def problem(self, url: str) -> str | None:
        if canonical_scheme(url) == "memory":
            return (
                "memory:// keeps its keys inside the process that opened it (tests only): "
                "`retrysafe keys` runs in a process of its own and can never see them; give "
                f"the store the middleware uses ({self.examples()})"
            )
        problem = super().problem(url)
        if problem is None and canonical_scheme(url) == "redis":
            from retrysafe.stores._url_check import check_redis_url

            try:  # a path that is not /N would silently be database 0
                check_redis_url(url)
            except ConfigurationError as exc:
                return str(exc)
        return problem


def _shown_value(value: Any) -> str:
    """A bad value for an error line (:func:`shown_value`, up to 80 characters)."""
    return shown_value(value, 80)


class KeyHash(StrParamType):
    """A key hash as ``keys list`` shows it, or its start: 1–64 hex digits."""

    name = "hash"
    _HEX = re.compile(r"[0-9a-fA-F]{1,64}")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or self._HEX.fullmatch(value) is None:
            self.fail(
                f"{_shown_value(value)} is not a key hash (1–64 hex digits, e.g. the first "
                "16 that `keys list` shows)",
                param,
                ctx,
            )
        return value.lower()


class PageCursor(StrParamType):
    """``--after``: where the previous page of ``keys list`` ended, as it printed it
    (``next`` in JSON): ``CREATED:HASH``, the last key's claim time in Unix seconds (0 when
    unknown) and its whole key hash. It names a place in the order, not a key, so it still
    works when that key was evicted, expired or purged since."""

    name = "cursor"
    _FORM = re.compile(r"([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?):([0-9a-fA-F]{64})")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, KeyPosition):
            return value
        found = self._FORM.fullmatch(value) if isinstance(value, str) else None
        created = float(found.group(1)) if found else math.nan
        if found is None or not math.isfinite(created):
            self.fail(
                f"{_shown_value(value)} is not a page cursor: give the `--after` value the "
                "previous page printed (`next` in --json), CREATED:HASH — the last key's "
                "claim time in Unix seconds and its whole 64-digit hash",
                param,
                ctx,
            )
        return KeyPosition(created, found.group(2).lower())


def cursor_of(entry: KeyEntry) -> str:
    """The ``--after`` cursor that continues after ``entry`` (:class:`PageCursor`)."""
    created = 0.0 if entry.created_at is None else entry.created_at
    return f"{created!r}:{entry.key_hash}"


class KeyPrefix(StrParamType):
    """A Redis key prefix: at most 200 characters, none of them a control character."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or not value or len(value) > 200 or not value.isprintable():
            self.fail(
                f"{_shown_value(value)} is not a key prefix (1 to 200 printable "
                f"characters, like the default {_DEFAULT_PREFIX!r}; an empty one would mix "
                "retrysafe's keys with every other key of the database)",
                param,
                ctx,
            )
        return value


def scoping_options(fn: Any) -> Any:
    """``--schema`` (PostgreSQL) and ``--prefix`` (Redis): where in its store the middleware
    keeps its keys (the ``keys`` commands and the gateway; :func:`check_scoping`)."""
    fn = click.option(
        "--prefix",
        type=KeyPrefix(),
        default=None,
        metavar="TEXT",
        help=f"Redis key prefix of the keys (default {_DEFAULT_PREFIX!r}).",
    )(fn)
    return click.option(
        "--schema",
        envvar=SCHEMA_ENV,
        type=SchemaName(),
        default=None,
        help="PostgreSQL schema holding retrysafe's tables (default public).",
    )(fn)


def check_scoping(
    url: str, schema: str | None, prefix: str | None
) -> tuple[str | None, str | None]:
    """The canonical scheme of ``url`` (None: not a store URL) and the schema to use; exits
    2 when ``--schema`` or ``--prefix`` was given for a store that has none. A schema from
    ``RETRYSAFE_SCHEMA`` (set for the outbox commands, say) is ignored for such a store."""
    scheme = canonical_scheme(url)
    if schema is not None and scheme != "postgresql":
        ctx = click.get_current_context(silent=True)
        from_env = ctx is not None and (
            ctx.get_parameter_source("schema") is ParameterSource.ENVIRONMENT
        )
        if not from_env:
            fail("--schema: only a postgresql:// store has a schema", EXIT_USAGE)
        schema = None
    if prefix is not None and scheme not in ("redis", "redis+cluster"):
        fail("--prefix: only a redis:// store has a key prefix", EXIT_USAGE)
    return scheme, schema


def _store_options(fn: Any) -> Any:
    """``--store`` (a key store), ``--schema`` (PostgreSQL) and ``--prefix`` (Redis): the
    options that name where the middleware keeps its keys."""
    fn = scoping_options(fn)
    kind = KeyStoreURL()
    return click.option(
        "--store",
        envvar=STORE_ENV,
        default="sqlite:///retrysafe.db",
        show_default=True,
        metavar="URL",
        type=kind,
        cls=StoreOption,
        help=f"Store URL: {kind.examples()} (see docs/stores.md).",
    )(fn)


def _key_options(fn: Any) -> Any:
    """KEY and how its scope is given, or ``--hash`` instead."""
    fn = click.option(
        "--hash",
        "hash_prefix",
        type=KeyHash(),
        default=None,
        help="The key hash (or a unique start of it) that `keys list` shows, instead of KEY.",
    )(fn)
    fn = click.option(
        "--scope",
        default=None,
        metavar="TEXT",
        help="The key's scope as your own scope function returns it.",
    )(fn)
    fn = click.option(
        "--authorization",
        envvar="RETRYSAFE_AUTHORIZATION",
        default=None,
        metavar="VALUE",
        help="The Authorization value of the key's requests, as sent (spaces and tabs around "
        "it are dropped, as HTTP drops them; the default scope is its SHA-256); env "
        "RETRYSAFE_AUTHORIZATION keeps it out of `ps` and history.",
    )(fn)
    return click.argument("key", required=False)(fn)


# ---------------------------------------------------------------------- naming a key
@dataclass(frozen=True)
class _Target:
    """The key a command names: the hash (or hash prefix) to look up, how to name it in a
    message, and whether it was named by KEY (then the scope is part of what was given)."""

    lookup: str
    shown: str
    by_key: bool = False


def _target(
    key: str | None,
    authorization: str | None,
    scope: str | None,
    hash_prefix: str | None,
) -> _Target:
    """What KEY / --authorization / --scope / --hash name; usage errors (exit 2) when they
    contradict each other or KEY is malformed. Nothing is opened before this."""
    ctx = click.get_current_context()
    from_env = ctx.get_parameter_source("authorization") is ParameterSource.ENVIRONMENT
    if hash_prefix is not None:
        if key is not None:
            fail("--hash: give KEY or --hash, not both", EXIT_USAGE)
        if scope is not None or (authorization is not None and not from_env):
            fail(
                "--hash: a hash already includes the scope; drop --scope and --authorization",
                EXIT_USAGE,
            )
        return _Target(hash_prefix, f"with hash {hash_prefix!r}")
    if key is None:
        fail(
            "KEY: name the key (the Idempotency-Key value, with --authorization or --scope as "
            "the middleware derives its scope) or pass --hash from `keys list`",
            EXIT_USAGE,
        )
    try:
        parsed = parse_key(key)
    except InvalidKeyError as exc:
        fail(f"KEY: {exc}", EXIT_USAGE)
    if from_env and scope is not None:
        authorization = None  # an explicit --scope wins over $RETRYSAFE_AUTHORIZATION
    if authorization is not None and scope is not None:
        fail("--scope: give --authorization or --scope, not both", EXIT_USAGE)
    try:
        hashed, how = key_lookup(parsed, authorization=authorization, scope=scope)
    except ValueError as exc:
        fail(f"--authorization: {exc}", EXIT_USAGE)
    return _Target(hashed, f"{clip(parsed, 80)!r} {how}", by_key=True)


def key_lookup(
    key: str, *, authorization: str | None = None, scope: str | None = None
) -> tuple[str, str]:
    """``(key hash, how the scope was given)`` of a parsed idempotency key, its scope derived
    as the middleware derives it: ``scope`` as an application's scope function returns it,
    or the request's ``authorization`` value hashed as the default scope
    :func:`~retrysafe.core.scope_from_authorization` hashes it, or neither (a request
    without Authorization). The one rule of ``retrysafe keys`` and the console's keys page.

    Raises:
        ValueError: ``authorization`` contains CR, LF or NUL (no header value can).
    """
    if scope is not None:
        return key_hash(scope, key), "in the given scope"
    if authorization is not None:
        if any(c in authorization for c in "\r\n\0"):
            raise ValueError("a header value cannot contain CR, LF or NUL")
        # HTTP drops the optional whitespace around a field value (RFC 9110 §5.5): the
        # middleware never sees it, so neither is it part of the scope here.
        authorization = authorization.strip(" \t")
        # The middleware hashes the header's bytes read as latin-1; a terminal sends UTF-8.
        wire = authorization.encode("utf-8", "surrogateescape").decode("latin-1")
        owner = scope_from_authorization({"authorization": wire})
        return key_hash(owner, key), "for the given Authorization"
    return key_hash("", key), "without a scope (requests without Authorization)"


@dataclass(frozen=True)
class _Where:
    """The store a command looks at, as every line of ``keys`` names it: the URL without its
    password, and the PostgreSQL schema or the Redis key prefix the keys are under (a wrong
    one finds nothing, so it is always said)."""

    url: str
    schema: str | None = None
    prefix: str | None = None

    def __str__(self) -> str:
        if self.schema is not None:
            return f"{self.url} (schema {self.schema!r})"
        if self.prefix is not None:
            return f"{self.url} (prefix {self.prefix!r})"
        return self.url

    def fields(self) -> dict[str, Any]:
        """The store in --json output: ``store``, and ``schema`` or ``prefix``."""
        out: dict[str, Any] = {"store": self.url}
        if self.schema is not None:
            out["schema"] = self.schema
        if self.prefix is not None:
            out["prefix"] = self.prefix
        return out

    def elsewhere(self) -> str:
        """What a not-found line adds: where else the keys may be ("" for SQLite)."""
        if self.schema is not None:
            return (
                f"the middleware's tables may be in another schema than {self.schema!r} "
                "(give it with --schema)"
            )
        if self.prefix is not None:
            return (
                f"the middleware's store may use another key prefix than {self.prefix!r} "
                "(give it with --prefix)"
            )
        return ""

    def why_absent(self) -> str:
        """Why a key the store once held can be absent from it now."""
        if self.prefix is not None:  # Redis forgets a released record at once
            return "the key was never recorded, was released after a 5xx, or its retention ended"
        return "the key was never recorded, or was purged after its retention ended"

    def migrate_command(self) -> str:
        """The `retrysafe migrate` command line for this store."""
        command = f"retrysafe migrate --store {shlex.quote(self.url)}"
        if self.schema is not None and self.schema != "public":
            command += f" --schema {self.schema}"
        return command

    def restate(self, exc: StoreError) -> str:
        """``exc``'s message as a ``keys`` line: the store named as :meth:`__str__` names it
        (a store names itself its own way: ``PostgreSQL store at host:port/db``), and the
        real ``retrysafe migrate`` command instead of the library's advice (``--store URL``,
        ``create=True``)."""
        message = str(exc)
        address = exc.store.partition("://")[2]
        heads = [exc.store]
        if address:
            heads += [
                f"PostgreSQL store {address} (schema {self.schema!r})",
                f"PostgreSQL store at {address}",
                f"PostgreSQL store {address}",
                f"Redis Cluster store at {address}",
                f"Redis store at {address}",
                f"SQLite store {exc.store}",
            ]
        for head in heads:
            if head and message.startswith(head):
                message = f"{self}{message[len(head) :]}"
                break
        message = message.replace(MIGRATE_HINT, f"run `{self.migrate_command()}`")
        return message


def _not_found(target: _Target, where: _Where) -> str:
    elsewhere = where.elsewhere()
    if not target.by_key:
        also = f"{elsewhere}, or " if elsewhere else ""
        return f"no key {target.shown} in {where}: {also}{where.why_absent()}"
    return (
        f"no key {target.shown} in {where}: the scope is part of a key's identity (the store "
        "keeps SHA-256 of scope and key), so give it as the middleware derives it: "
        "--authorization with the request's Authorization value exactly, or --scope with "
        f"what your scope function returns; {elsewhere + '; ' if elsewhere else ''}or "
        f"{where.why_absent()}"
    )


def _resolve(admin: KeyAdmin, target: _Target, where: _Where, now: float) -> KeyEntry:
    """The one record ``target`` names (exit 1 when none, or when a hash prefix matches
    several: the line names up to :data:`_CANDIDATES` of them)."""
    found = admin.find_keys(target.lookup, now=now, limit=_CANDIDATES + 1)
    if not found:
        fail(_not_found(target, where), EXIT_FAILED)
    if len(found) > 1:
        shown = ", ".join(e.key_hash[:16] for e in found[:_CANDIDATES])
        more = f" and more (it names the first {_CANDIDATES})" if len(found) > _CANDIDATES else ""
        count = f"more than {_CANDIDATES}" if more else str(len(found))
        fail(
            f"--hash: prefix {target.lookup!r} is ambiguous: it matches {count} keys: "
            f"{shown}{more}; give more digits",
            EXIT_FAILED,
        )
    return found[0]


# ---------------------------------------------------------------------- the store
@contextmanager
def _restated(where: _Where) -> Iterator[None]:
    """Store errors inside name the store as ``where`` does (:meth:`_Where.restate`)."""
    try:
        yield
    except StoreError as exc:
        exc.args = (where.restate(exc),)
        raise


@dataclass(frozen=True)
class KeyAdminSource:
    """A key store the caller opened (``manage.py retrysafe_keys``: Django's database), passed
    as the click context's object: the ``keys`` commands use it when ``--store`` is not given.

    Attributes:
        store: the store (a :class:`~retrysafe.stores.KeyAdmin`).
        name: how every line names it, e.g. ``django:default (sqlite /srv/db.sqlite3)``.
    """

    store: KeyAdmin
    name: str


@contextmanager
def _key_admin(
    url: str, *, write: bool, schema: str | None, prefix: str | None
) -> Iterator[tuple[KeyAdmin, _Where]]:
    """The store ``url`` names and how to show it, opened as every command opens stores (it
    must exist; SQLite read-only for a reader; no schema created). Store errors inside become
    one line (exit 1), with no driver log lines before it."""
    from retrysafe import stores
    from retrysafe.stores._url_check import redact_url

    ctx = click.get_current_context()
    source = ctx.find_object(KeyAdminSource)
    if source is not None and ctx.get_parameter_source("store") is ParameterSource.DEFAULT:
        where = _Where(source.name)
        with errors(None, _FLAGS), _restated(where):
            yield source.store, where
        return
    scheme, schema = check_scoping(url, schema, prefix)
    if scheme == "postgresql":
        where = _Where(redact_url(url), schema=schema or "public")
    elif scheme in ("redis", "redis+cluster"):
        where = _Where(redact_url(url), prefix=prefix or _DEFAULT_PREFIX)
    else:
        where = _Where(redact_url(url))
    with errors(url, _FLAGS), _restated(where):
        if where.schema is not None:
            opened: Any = closing(stores.open_store(url, schema=where.schema, create=False))
        elif where.prefix is not None:
            opened = closing(stores.open_store(url, prefix=where.prefix))
        else:
            opened = opened_store(url, write=write)
        with opened as store:
            if not isinstance(store, KeyAdmin):  # pragma: no cover - every store offers it
                fail(f"--store: {where} cannot list its keys", EXIT_USAGE)
            yield store, where


# ---------------------------------------------------------------------- output
def _emit(data: Any) -> None:
    click.echo(json.dumps(data, sort_keys=True))


def _when(ts: float | None) -> str:
    """Local time with its UTC offset, to the second: ``2026-12-01 14:03:12+01:00``."""
    if ts is None:
        return ""
    if not math.isfinite(ts):
        return "never"
    try:
        moment = dt.datetime.fromtimestamp(ts, dt.timezone.utc).astimezone()
    except (OverflowError, OSError, ValueError):
        return f"{ts:g} (Unix seconds)"
    return moment.isoformat(sep=" ", timespec="seconds")


def _relative(ts: float, now: float) -> str:
    """``in 12s`` / ``in 5m`` / ``2h 1m ago`` / ``in 1d 3h``."""
    if not math.isfinite(ts):
        return "never"
    delta = ts - now
    left = abs(round(delta))
    if left < 60:
        text = f"{left}s"
    else:
        units = ((left // 86400, "d"), (left % 86400 // 3600, "h"), (left % 3600 // 60, "m"))
        text = " ".join(f"{n}{unit}" for n, unit in units if n)
    return f"in {text}" if delta >= 0 else f"{text} ago"


def next_attempt(entry: KeyEntry, now: float) -> tuple[str, str]:
    """What a repeat of the request that claimed ``entry`` would get now (SPEC §3, by
    :func:`retrysafe.core.decide`): a short name and a sentence."""
    record = None
    if entry.state in ("running", "completed"):
        response = None
        if entry.state == "completed" and entry.status is not None:
            response = StoredResponse(entry.status, entry.headers, b"", entry.replayable)
        record = KeyRecord(
            entry.key_hash,
            entry.fingerprint,
            KeyState(entry.state),
            entry.fencing_token,
            entry.lease_expires_at,
            entry.expires_at,
            response,
        )
    decision = decide(record, entry.fingerprint, now)
    if isinstance(decision, Replay):
        return "replay", f"replays the stored {decision.response.status} (the handler does not run)"
    if isinstance(decision, ReplayUnavailable):
        return "replay-unavailable", (
            "gets a replay-unavailable problem: the answer was too large to keep (the handler "
            "does not run)"
        )
    if isinstance(decision, InProgress):
        return "in-progress", (
            f"gets 409 request-in-progress (a handler holds the lease, "
            f"{_relative(entry.lease_expires_at, now)})"
        )
    if isinstance(decision, TakeOver):
        return "take-over", (
            "takes the key over and runs the handler (the lease ended: the first attempt's "
            "process stopped renewing it)"
        )
    assert isinstance(decision, Claim)
    return "run", "runs the handler (the store holds nothing that answers for this key)"


def _entry_dict(entry: KeyEntry, now: float, *, body: bool = False) -> dict[str, Any]:
    """A record in --json output: what the store holds, as stored (times in Unix seconds);
    ``lease_expires_at`` only while it is running (null otherwise: a finished record's last
    lease means nothing), ``replayable`` only once an answer is stored (else null)."""
    nxt, _ = next_attempt(entry, now)
    answered = entry.status is not None
    out: dict[str, Any] = {
        "key_hash": entry.key_hash,
        "state": entry.state,
        "fingerprint": entry.fingerprint,
        "fencing_token": entry.fencing_token,
        "created_at": entry.created_at,
        "lease_expires_at": entry.lease_expires_at if entry.state == "running" else None,
        "expires_at": entry.expires_at,
        "status": entry.status,
        "headers": [list(p) for p in entry.headers],
        "body_size": entry.body_size,
        "replayable": entry.replayable if answered else None,
        "next_attempt": nxt,
    }
    if body:
        raw = entry.body
        out["body_base64"] = None if raw is None else base64.b64encode(raw).decode("ascii")
        try:
            out["body"] = None if raw is None else raw.decode("utf-8")
        except UnicodeDecodeError:
            out["body"] = None  # binary: body_base64 has it
    return out


def _size(n: int | None) -> str:
    return "" if n is None else f"{n} B"


def _keys_table(entries: list[KeyEntry], title: str, now: float) -> Any:
    from rich.table import Table

    table = Table(title=plain_cell(title))
    table.add_column("key hash", no_wrap=True, min_width=16)
    table.add_column("state", no_wrap=True)
    for col in ("created", "expires", "status", "body", "token", "next attempt"):
        table.add_column(col, overflow="fold")
    for e in entries:
        table.add_row(
            e.key_hash[:16],
            e.state,
            _when(e.created_at),
            _when(e.expires_at),
            "" if e.status is None else str(e.status),
            _size(e.body_size),
            str(e.fencing_token),
            next_attempt(e, now)[0],
        )
    return table


def _show_table(entry: KeyEntry, now: float) -> Any:
    from rich.table import Table

    table = Table(title=f"key {entry.key_hash}", show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    lease = f"{_when(entry.lease_expires_at)} ({_relative(entry.lease_expires_at, now)})"
    if entry.status is None:
        replayable = "-"
    else:
        replayable = "yes" if entry.replayable else "no (the answer exceeded the limit)"
    rows = [
        ("state", entry.state),
        ("next attempt", next_attempt(entry, now)[1]),
        ("fingerprint", entry.fingerprint or "(none: released)"),
        ("fencing token", str(entry.fencing_token)),
        (
            "created",
            _when(entry.created_at)
            if entry.created_at is not None
            else "(not recorded: claimed before this store recorded claim times)",
        ),
        ("lease until", lease if entry.state == "running" else "(not running)"),
        ("expires", f"{_when(entry.expires_at)} ({_relative(entry.expires_at, now)})"),
        ("status", "" if entry.status is None else str(entry.status)),
        ("body size", _size(entry.body_size)),
        ("replayable", replayable),
    ]
    for name, value in [*rows, *((f"header {k}", v) for k, v in entry.headers)]:
        table.add_row(plain_cell(name), plain_cell(value))
    return table


def _print_body(body: bytes) -> None:
    """``keys show --body`` after the table: to a pipe or a file the stored bytes exactly; on
    a terminal the text with its control characters shown escaped (a stored ``ESC ]0;…``
    would retitle the terminal, colour codes would recolour it), saying so."""
    sys.stdout.flush()
    if not sys.stdout.isatty():
        binary = click.get_binary_stream("stdout")
        binary.write(body)
        binary.flush()
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        click.echo(f"body: {len(body)} bytes, not UTF-8 (--json gives body_base64)")
        return
    shown = visible_text(text, keep="\n\t")
    if shown != text:
        click.echo(
            f"body: {len(body)} bytes, control characters shown escaped (as \\x1b); "
            "--json (body_base64) or a pipe gives the bytes as stored:"
        )
    click.echo(shown)


# ---------------------------------------------------------------------- commands
_FORCE_HELP = (
    "Evict a running key whose lease is live too. Its handler keeps running but can no "
    "longer record anything (its lease renewals and its completion are fenced off): its own "
    "client gets 409 request-in-progress instead of the answer, and the next request with "
    "the key (that client's retry, or one sent while the handler still runs) runs the "
    "handler again, so the effect can happen twice (with server.transaction() the fenced "
    "handler's writes are rolled back instead). A running key whose lease ended (its "
    "process died) needs no --force."
)


@click.group("keys", epilog=epilog())
def keys() -> None:
    """Inspect and evict the idempotency keys the middleware stored (sqlite, postgresql,
    redis). Keys are stored as SHA-256 of scope and key: name one by KEY and its scope
    (--authorization or --scope, as the middleware derives it), or by --hash."""


@keys.command("list", epilog=epilog())
@_store_options
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(ENTRY_STATES),
    help="Only keys in this state (repeatable): running, completed, released (evicted, or "
    "released after a 5xx; Redis keeps only evicted ones) or expired (retention ended).",
)
@click.option("--limit", type=_LIMIT, default=100, show_default=True, help="Most keys.")
@click.option(
    "--after",
    "after",
    type=PageCursor(),
    default=None,
    metavar="CURSOR",
    help="Continue where the previous page ended: the cursor it printed (`next` in --json), "
    "CREATED:HASH; it still works when that key is gone since.",
)
@json_option
def keys_list(
    store: str,
    schema: str | None,
    prefix: str | None,
    states: tuple[str, ...],
    limit: int,
    after: KeyPosition | None,
    as_json: bool,
) -> None:
    """List stored keys, newest claim first: their hash (never the key or its scope), state,
    times, stored status and what the next attempt with the key would get."""
    now = time.time()
    with _key_admin(store, write=False, schema=schema, prefix=prefix) as (admin, where):
        found = admin.list_keys(now=now, limit=limit, states=states or None, after=after)
    more = cursor_of(found[-1]) if len(found) == limit else None
    if as_json:
        _emit({**where.fields(), "keys": [_entry_dict(e, now) for e in found], "next": more})
        return
    print_table(_keys_table(found, f"keys in {where} ({len(found)}, newest first)", now))
    if more is not None:
        click.echo(f"more keys: continue with --after {more}")
    elif not found and not states and after is None and where.elsewhere():
        click.echo(f"no keys in {where}: {where.elsewhere()}")


@keys.command(
    "show", epilog=epilog("for show: no such key, or a hash prefix that matches several;")
)
@_store_options
@_key_options
@click.option(
    "--body",
    "with_body",
    is_flag=True,
    help="Also print the stored body: to a pipe as stored, on a terminal with control "
    "characters shown escaped.",
)
@json_option
def keys_show(
    store: str,
    schema: str | None,
    prefix: str | None,
    key: str | None,
    authorization: str | None,
    scope: str | None,
    hash_prefix: str | None,
    with_body: bool,
    as_json: bool,
) -> None:
    """Show one stored key: state, fingerprint, stored status and headers, body size, lease,
    fencing token, created and expiry times, and what its next attempt would get (the body
    only with --body)."""
    target = _target(key, authorization, scope, hash_prefix)
    now = time.time()
    with _key_admin(store, write=False, schema=schema, prefix=prefix) as (admin, where):
        entry = _resolve(admin, target, where, now)
    if as_json:
        _emit({**where.fields(), **_entry_dict(entry, now, body=with_body)})
        return
    print_table(_show_table(entry, now))
    if with_body and entry.body is not None:
        _print_body(entry.body)


@keys.command(
    "evict",
    epilog=epilog(
        "for evict: no such key, a running key whose lease is live without --force, the "
        "key changed meanwhile, or the question answered no;"
    ),
)
@_store_options
@_key_options
@click.option("--yes", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@click.option("--force", is_flag=True, help=_FORCE_HELP)
@json_option
def keys_evict(
    store: str,
    schema: str | None,
    prefix: str | None,
    key: str | None,
    authorization: str | None,
    scope: str | None,
    hash_prefix: str | None,
    yes: bool,
    force: bool,
    as_json: bool,
) -> None:
    """Forget one stored key, so that the next request with it runs the handler again — its
    effect happens again (use it when the stored answer is wrong, e.g. after fixing a bug
    that answered 4xx). Asks first (or --yes); refuses a running key whose lease is live
    unless --force. A key released already is nothing to evict (exit 0)."""
    target = _target(key, authorization, scope, hash_prefix)
    check_can_ask(yes, "evict")
    now = time.time()
    with _key_admin(store, write=True, schema=schema, prefix=prefix) as (admin, where):
        entry = _resolve(admin, target, where, now)
        short = entry.key_hash[:16]
        if entry.state == "released":
            message = _nothing_to_evict(short)
            _report(as_json, where, entry.key_hash, "released", evicted=False, message=message)
            return
        held = entry.state == "running" and next_attempt(entry, now)[0] == "in-progress"
        if held and not force:
            lease = _relative(entry.lease_expires_at, now)
            fail(
                f"key {short} is running (a handler holds its lease, {lease}): evicting it "
                "would let a retry run the effect alongside that handler; wait for it to "
                "finish, or pass --force",
                EXIT_FAILED,
            )
        if not yes:
            click.echo(f"{_MEANING}.", err=True)
            if not click.confirm(f"Evict key {short} ({entry.state})?", err=True):
                fail("not evicted (answered no); nothing was changed", EXIT_FAILED)
        if not admin.evict(entry.key_hash, entry.fencing_token):
            now_held = admin.find_keys(entry.key_hash, now=time.time(), limit=1)
            current = now_held[0] if now_held else None
            if current is not None and current.state not in ("released", "expired"):
                fail(
                    f"key {short} changed while evicting it (claimed again or taken over): "
                    "nothing was evicted; look at it again with `retrysafe keys show`",
                    EXIT_FAILED,
                )
            # Another evictor (or the owner's release, a purge) was first: nothing is left.
            state = None if current is None else current.state
            message = _nothing_to_evict(short, state)
            _report(as_json, where, entry.key_hash, state, evicted=False, message=message)
            return
    if held:
        what = (
            "; the handler still running under it can no longer record its answer, so its "
            "client gets 409 request-in-progress"
        )
    elif entry.state == "running":
        what = "; its lease had ended, so no handler held it"
    else:
        what = ""
    message = (
        f"evicted key {short} ({entry.state}){what}: the next request with this key runs "
        "the handler again, and its effect happens again"
    )
    _report(as_json, where, entry.key_hash, entry.state, evicted=True, message=message)


def _nothing_to_evict(short: str, state: str | None = "released") -> str:
    """The line of an evict that finds nothing left to forget (exit 0): the key is
    released already (evicted, or released after a 5xx), its retention ended, or it is gone
    (purged)."""
    if state == "released":
        now = f"key {short} is released already"
    elif state == "expired":
        now = f"the retention of key {short} ended meanwhile"
    else:
        now = f"key {short} is gone meanwhile (purged, or its retention ended)"
    return f"{now}: nothing to evict; the next request with it runs the handler"


def _report(
    as_json: bool,
    where: _Where,
    key_hash: str,
    state: str | None,
    *,
    evicted: bool,
    message: str,
) -> None:
    """The result of evict: its line, or with --json the store, the key hash, the state the
    key was evicted in (or, when nothing was evicted, has now: null when it is gone),
    whether it was evicted, and the line."""
    if as_json:
        _emit(
            {
                **where.fields(),
                "key_hash": key_hash,
                "state": state,
                "evicted": evicted,
                "message": message,
            }
        )
    else:
        click.echo(message)
