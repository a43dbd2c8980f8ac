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
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource

from retrysafe._exceptions import InvalidKeyError
from retrysafe.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    KEY_STORES,
    STORE_ENV,
    StoreURL,
    StrParamType,
    canonical_scheme,
    clip,
    epilog,
    errors,
    fail,
    json_option,
    opened_store,
    print_table,
)
from retrysafe.cli._migrate import SchemaName
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
from retrysafe.stores._base import ENTRY_STATES, KeyAdmin, KeyEntry

__all__ = ["keys"]

_LIMIT = click.IntRange(min=1, max=1_000_000)
_FLAGS = {"store": "--store", "schema": "--schema", "prefix": "--prefix", "limit": "--limit"}
_DEFAULT_PREFIX = "retrysafe:"
_MEANING = (
    "evicting a key makes the store forget it: the next request with this key runs the "
    "handler again, so its effect happens again"
)


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
        return super().problem(url)


class KeyHash(StrParamType):
    """A key hash as ``keys list`` shows it, or its start: 1–64 hex digits."""

    name = "hash"
    _HEX = re.compile(r"[0-9a-fA-F]{1,64}")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or self._HEX.fullmatch(value) is None:
            self.fail(
                f"{clip(repr(value), 80)} is not a key hash (1–64 hex digits, e.g. the first "
                "12 that `keys list` shows)",
                param,
                ctx,
            )
        return value.lower()


class KeyPrefix(StrParamType):
    """A Redis key prefix: at most 200 characters, none of them a control character."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or len(value) > 200 or not value.isprintable():
            self.fail(
                f"{clip(repr(value), 80)} is not a key prefix (at most 200 printable "
                f"characters, like the default {_DEFAULT_PREFIX!r})",
                param,
                ctx,
            )
        return value


def _store_options(fn: Any) -> Any:
    """``--store`` (a key store), ``--schema`` (PostgreSQL) and ``--prefix`` (Redis): the
    options that name where the middleware keeps its keys."""
    fn = click.option(
        "--prefix",
        type=KeyPrefix(),
        default=None,
        metavar="TEXT",
        help=f"Redis key prefix the store was opened with (default {_DEFAULT_PREFIX!r}).",
    )(fn)
    fn = click.option(
        "--schema",
        type=SchemaName(),
        default=None,
        help="PostgreSQL schema holding retrysafe's tables (default public).",
    )(fn)
    kind = KeyStoreURL()
    return click.option(
        "--store",
        envvar=STORE_ENV,
        default="sqlite:///retrysafe.db",
        show_default=True,
        metavar="URL",
        type=kind,
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
        help="The Authorization value of the key's requests, exactly as sent (the default "
        "scope is its SHA-256); env RETRYSAFE_AUTHORIZATION keeps it out of `ps` and history.",
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
    if scope is not None:
        how, owner = "in the given --scope", scope
    elif authorization is not None:
        if any(c in authorization for c in "\r\n\0"):
            fail("--authorization: a header value cannot contain CR, LF or NUL", EXIT_USAGE)
        # The middleware hashes the header's bytes read as latin-1; a terminal sends UTF-8.
        wire = authorization.encode("utf-8", "surrogateescape").decode("latin-1")
        how, owner = "for the given --authorization", scope_from_authorization(
            {"authorization": wire}
        )
    else:
        how, owner = "without a scope (requests without Authorization)", ""
    return _Target(key_hash(owner, parsed), f"{clip(parsed, 80)!r} {how}", by_key=True)


def _not_found(target: _Target, where: str) -> str:
    if not target.by_key:
        return f"no key {target.shown} in {where}"
    return (
        f"no key {target.shown} in {where}: the scope is part of a key's identity (the store "
        "keeps SHA-256 of scope and key), so give it as the middleware derives it: "
        "--authorization with the request's Authorization value exactly, or --scope with "
        "what your scope function returns; or the key was never recorded, was released by "
        "a 5xx, or was purged"
    )


def _resolve(admin: KeyAdmin, target: _Target, where: str, now: float) -> KeyEntry:
    """The one record ``target`` names (exit 1 when none, or when a hash prefix matches
    several)."""
    found = admin.find_keys(target.lookup, now=now, limit=2)
    if not found:
        fail(_not_found(target, where), EXIT_FAILED)
    if len(found) > 1:
        fail(
            f"--hash: prefix {target.lookup!r} is ambiguous: it matches "
            f"{', '.join(e.key_hash[:16] for e in found)} and maybe more; give more digits",
            EXIT_FAILED,
        )
    return found[0]


# ---------------------------------------------------------------------- the store
@contextmanager
def _key_admin(
    url: str, *, write: bool, schema: str | None, prefix: str | None
) -> Iterator[tuple[KeyAdmin, str]]:
    """The store ``url`` names and how to show it, opened as every command opens stores (it
    must exist; SQLite read-only for a reader; no schema created). Store errors inside become
    one line (exit 1)."""
    from retrysafe import stores
    from retrysafe.stores._url_check import redact_url

    scheme = canonical_scheme(url)
    if schema is not None and scheme != "postgresql":
        fail("--schema: only a postgresql:// store has a schema", EXIT_USAGE)
    if prefix is not None and scheme not in ("redis", "redis+cluster"):
        fail("--prefix: only a redis:// store has a key prefix", EXIT_USAGE)
    with errors(url, _FLAGS):
        if scheme == "postgresql":
            opened: Any = closing(
                stores.open_store(url, schema=schema or "public", create=False)
            )
        elif scheme in ("redis", "redis+cluster"):
            opened = closing(stores.open_store(url, prefix=prefix or _DEFAULT_PREFIX))
        else:
            opened = opened_store(url, write=write)
        with opened as store:
            if not isinstance(store, KeyAdmin):  # pragma: no cover - every store offers it
                fail(f"--store: {redact_url(url)} cannot list its keys", EXIT_USAGE)
            yield store, redact_url(url)


# ---------------------------------------------------------------------- output
def _emit(data: Any) -> None:
    click.echo(json.dumps(data, sort_keys=True))


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


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


def _next_attempt(entry: KeyEntry, now: float) -> tuple[str, str]:
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
    nxt, _ = _next_attempt(entry, now)
    out: dict[str, Any] = {
        "key_hash": entry.key_hash,
        "state": entry.state,
        "fingerprint": entry.fingerprint,
        "fencing_token": entry.fencing_token,
        "created_at": entry.created_at,
        "lease_expires_at": entry.lease_expires_at,
        "expires_at": entry.expires_at,
        "status": entry.status,
        "headers": [list(p) for p in entry.headers],
        "body_size": entry.body_size,
        "replayable": entry.replayable,
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

    table = Table(title=title)
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
            _next_attempt(e, now)[0],
        )
    return table


def _show_table(entry: KeyEntry, now: float) -> Any:
    from rich.table import Table

    table = Table(title=f"key {entry.key_hash}", show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    lease = f"{_when(entry.lease_expires_at)} ({_relative(entry.lease_expires_at, now)})"
    rows = [
        ("state", entry.state),
        ("next attempt", _next_attempt(entry, now)[1]),
        ("fingerprint", entry.fingerprint or "(none: released)"),
        ("fencing token", str(entry.fencing_token)),
        (
            "created",
            _when(entry.created_at) if entry.created_at is not None else "(not recorded: "
            "claimed before this store recorded claim times)",
        ),
        ("lease until", lease if entry.state == "running" else "(not running)"),
        ("expires", f"{_when(entry.expires_at)} ({_relative(entry.expires_at, now)})"),
        ("status", "" if entry.status is None else str(entry.status)),
        ("body size", _size(entry.body_size)),
        ("replayable", "yes" if entry.replayable else "no (the answer exceeded the limit)"),
    ]
    for name, value in [*rows, *((f"header {k}", v) for k, v in entry.headers)]:
        table.add_row(name, value)
    return table


# ---------------------------------------------------------------------- commands
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
    help="Only keys in this state (repeatable): running, completed, released (evicted or "
    "released after a 5xx; not kept on Redis) or expired (retention ended).",
)
@click.option("--limit", type=_LIMIT, default=100, show_default=True, help="Most keys.")
@click.option(
    "--after",
    "after",
    type=KeyHash(),
    default=None,
    metavar="HASH",
    help="Continue after this key (the last hash of the previous page).",
)
@json_option
def keys_list(
    store: str,
    schema: str | None,
    prefix: str | None,
    states: tuple[str, ...],
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """List stored keys, newest claim first: their hash (never the key or its scope), state,
    times, stored status and what the next attempt with the key would get."""
    now = time.time()
    with _key_admin(store, write=False, schema=schema, prefix=prefix) as (admin, where):
        start = None
        if after is not None:
            start = _resolve(admin, _Target(after, f"with hash {after!r}"), where, now)
        found = admin.list_keys(now=now, limit=limit, states=states or None, after=start)
    more = found[-1].key_hash if len(found) == limit else None
    if as_json:
        _emit({"store": where, "keys": [_entry_dict(e, now) for e in found], "next": more})
        return
    print_table(_keys_table(found, f"keys in {where} ({len(found)}, newest first)", now))
    if more is not None:
        click.echo(f"more keys: continue with --after {more[:16]}")


@keys.command("show", epilog=epilog("(no such key, or a hash prefix of several);"))
@_store_options
@_key_options
@click.option("--body", "with_body", is_flag=True, help="Also print the stored body.")
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
        _emit({"store": where, **_entry_dict(entry, now, body=with_body)})
        return
    print_table(_show_table(entry, now))
    if with_body and entry.body is not None:
        try:
            text = entry.body.decode("utf-8")
        except UnicodeDecodeError:
            click.echo(f"body: {len(entry.body)} bytes, not UTF-8 (--json gives body_base64)")
        else:
            click.echo(text)


@keys.command(
    "evict",
    epilog=epilog(
        "(no such key; a running key without --force; the key changed meanwhile; the "
        "question answered no);"
    ),
)
@_store_options
@_key_options
@click.option("--yes", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@click.option(
    "--force",
    is_flag=True,
    help="Evict a running key too (its handler may still be running: a retry would run the "
    "effect a second time alongside it).",
)
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
    that answered 4xx). Asks first (or --yes); refuses a running key unless --force."""
    target = _target(key, authorization, scope, hash_prefix)
    if not yes and not sys.stdin.isatty():
        fail(
            "--yes: stdin is not a terminal, so evict cannot ask; pass --yes to evict "
            "without asking (nothing was changed)",
            EXIT_USAGE,
        )
    now = time.time()
    with _key_admin(store, write=True, schema=schema, prefix=prefix) as (admin, where):
        entry = _resolve(admin, target, where, now)
        short = entry.key_hash[:16]
        if entry.state == "released":
            message = (
                f"key {short} is released already: the next request with it runs the handler"
            )
            _report(as_json, where, entry, evicted=False, message=message)
            return
        if entry.state == "running" and not force:
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
            fail(
                f"key {short} changed while evicting it (claimed again or taken over): "
                "nothing was evicted; look at it again with `retrysafe keys show`",
                EXIT_FAILED,
            )
    message = (
        f"evicted key {short} ({entry.state}): the next request with this key runs the "
        "handler again, and its effect happens again"
    )
    _report(as_json, where, entry, evicted=True, message=message)


def _report(as_json: bool, where: str, entry: KeyEntry, *, evicted: bool, message: str) -> None:
    if as_json:
        _emit(
            {
                "store": where,
                "key_hash": entry.key_hash,
                "state": entry.state,
                "evicted": evicted,
                "message": message,
            }
        )
    else:
        click.echo(message)
