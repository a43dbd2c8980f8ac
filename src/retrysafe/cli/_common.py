"""Pieces every subcommand shares: the one command-line convention (exit codes, error lines,
``--json``, tables), the ``--store`` option and the opening of stores, listen addresses.

The convention (docs/cli.md):

* exit **0** done; **1** the operation failed or left work undone (a store that cannot be
  reached, an unknown id, jobs still UNKNOWN); **2** usage or bad input, nothing changed;
  **130** / **143** stopped by SIGINT / SIGTERM;
* an error is one line on stderr, ``retrysafe: error: <option>: <what>``, naming the option
  when one is to blame (:func:`fail`, :func:`errors`; click's own usage errors are printed the
  same way by the ``retrysafe`` group);
* commands that report a result take ``--json`` (:func:`json_option`);
* ``--store`` lists exactly the schemes the command supports and refuses any other, a
  directory, a missing directory and a file that is not a SQLite database before anything is
  opened (:func:`store_option`); a command never creates a store, except ``retrysafe migrate``
  (:func:`opened_store`) and ``retrysafe gateway`` (which, like the middleware, creates its key
  store on first start);
* tables use the terminal's width, and are not wrapped when output is not a terminal
  (:func:`print_table`).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import shlex
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, overload

import click

from retrysafe._exceptions import (
    ConfigurationError,
    DestinationRefusedError,
    InvalidKeyError,
    PayloadError,
    RetrysafeError,
    SchemaError,
    StoreUnavailableError,
    SubmitOutcomeUnknownError,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "EXIT_USAGE",
    "KEY_STORES",
    "SQL_STORES",
    "STORE_ENV",
    "FloatParamType",
    "Number",
    "ProgressStream",
    "SchemaName",
    "StoreOption",
    "StoreURL",
    "StrParamType",
    "canonical_scheme",
    "check_port_free",
    "clip",
    "epilog",
    "errors",
    "exit_code_of",
    "fail",
    "json_option",
    "metrics_option",
    "no_store_message",
    "opened_store",
    "parse_listen",
    "plain_cell",
    "plain_table",
    "print_table",
    "progress_console",
    "results_console",
    "serving_metrics",
    "stdout_may_close",
    "store_option",
    "visible_text",
]

_F = TypeVar("_F", bound=Callable[..., Any])

if TYPE_CHECKING:  # click >= 8.2 types its ParamType by value; 8.1 cannot be subscripted
    StrParamType = click.ParamType[str]
    FloatParamType = click.ParamType[float]
else:
    StrParamType = FloatParamType = click.ParamType

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGINT = 130  # 128 + SIGINT, as shells report it
EXIT_SIGTERM = 143  # 128 + SIGTERM

STORE_ENV = "RETRYSAFE_STORE"
#: The environment variable of ``--schema`` (the PostgreSQL schema of the outbox commands).
SCHEMA_ENV = "RETRYSAFE_SCHEMA"
DEFAULT_STORE = "sqlite:///retrysafe.db"

#: The stores the outbox, webhooks and agent runs live on.
SQL_STORES = ("sqlite", "postgresql")
#: The stores that hold idempotency keys (the middleware, the gateway).
KEY_STORES = ("sqlite", "postgresql", "redis", "redis+cluster")

# canonical scheme -> (the schemes a URL may spell it with, an example for help and errors)
_SCHEMES: dict[str, tuple[tuple[str, ...], str]] = {
    "sqlite": (("sqlite",), "sqlite:///path.db"),
    "postgresql": (("postgresql", "postgres"), "postgresql://user@host/db"),
    "redis": (("redis", "rediss"), "redis://host:6379/0"),
    "redis+cluster": (("redis+cluster", "rediss+cluster"), "redis+cluster://host:7000,host:7001"),
    "memory": (("memory",), "memory://"),
}
_SQLITE_MAGIC = b"SQLite format 3\x00"
#: The longest error line printed: a 10 MB value is shown by its two ends.
_MAX_MESSAGE = 600


def epilog(*lines: str) -> str:
    """The ``--help`` epilog of a command: its exit statuses (the convention, plus ``lines``
    that say what 1 means for it)."""
    extra = "".join(f" {_meaning(line)}" for line in lines)
    return (
        "Exit status: 0 done; 1 failed or left work undone;"
        f"{extra} 2 usage or bad input (nothing changed); 130 / 143 stopped by SIGINT / "
        "SIGTERM. See docs/cli.md."
    )


def _meaning(line: str) -> str:
    """What 1 means for one command, as a clause of the epilog: ``(no such job);`` reads
    ``here: no such job;`` (a bare parenthesis after a semicolon reads as a stray)."""
    text = line.strip().rstrip(";").strip()
    if text.startswith("(") and text.endswith(")"):
        text = "here: " + text[1:-1]
    return text + ";"


def clip(text: str, limit: int = _MAX_MESSAGE) -> str:
    """``text``, or its two ends around ``… (N characters) …`` when longer than ``limit``."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 4
    return f"{text[:head]}… ({len(text)} characters) …{text[-tail:]}"


def shown_value(value: object, limit: int = 60) -> str:
    """A bad value for an error line, quoted (``repr``): its two ends when long, counted in
    characters of the value itself (``clip(repr(value))`` counted the quotes too)."""
    return repr(clip(value, limit)) if isinstance(value, str) else clip(repr(value), limit)


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``retrysafe: error: <message>`` (one line) on stderr and exit ``code``; a
    stderr that cannot be written (a closed pipe) loses the line, never the exit status."""
    line = " ".join(clip(message).splitlines())
    with suppress(OSError, ValueError):  # BrokenPipeError; ValueError: the stream is closed
        click.echo(f"retrysafe: error: {line}", err=True)
    raise SystemExit(code)


def _finite_number(text: str) -> float:
    """A JSON number with a fraction or exponent as a float; one no float holds (``1E400``,
    which Python reads as infinity and no JSON encoder writes back) is refused."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {clip(text, 40)} is too large for a float")
    return value


def read_json_argument(value: str, name: str) -> Any:
    """A JSON argument (``name`` in the error lines: ``PAYLOAD``, ``--data``) as a value: the
    text itself, the file after ``@``, or stdin for ``-`` and ``@-`` (curl's ``-d @-``; a
    file named ``-`` is ``@./-``). UTF-8 JSON text only; anything else (a file that cannot
    be read, bytes that are not UTF-8, text that is not JSON, an object that names a member
    twice, whose first value JSON parsers drop) exits 2 with one line."""
    from retrysafe.core._fingerprint import _DuplicateMemberError, _no_duplicate_members

    if value in ("-", "@-"):
        if sys.stdin is None:  # started with stdin closed (`<&-`)
            fail(f"{name}: - reads stdin, and stdin is closed", 2)
        where, raw = "stdin", sys.stdin.buffer.read()
    elif value.startswith("@"):
        where = value[1:]
        if not where:
            fail(f"{name}: @ needs a file name (@body.json; - reads stdin)", 2)
        try:
            with open(where, "rb") as f:
                raw = f.read()
        except (OSError, ValueError) as exc:
            fail(
                f"{name}: cannot read {clip(where, 200)}: {getattr(exc, 'strerror', None) or exc}",
                2,
            )
    else:
        # Command-line bytes that are not UTF-8 arrive as lone surrogates: back to bytes.
        where, raw = "the argument", value.encode("utf-8", "surrogatepass")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(f"{name}: {where} is not UTF-8 text (byte {exc.start})", 2)
    try:
        return json.loads(
            text, object_pairs_hook=_no_duplicate_members, parse_float=_finite_number
        )
    except _DuplicateMemberError:
        fail(f"{name}: {where} names a member twice in one object (which value is meant?)", 2)
    except ValueError as exc:
        fail(f"{name}: {where} is not JSON: {exc}", 2)
    except RecursionError:
        fail(f"{name}: nested too deeply", 2)


def exit_code_of(exc: RetrysafeError) -> int:
    """2 for bad input (a value that can never work: :class:`ConfigurationError`,
    :class:`InvalidKeyError`, :class:`PayloadError`, a refused webhook destination), 1 for
    everything that failed while doing the work (store, not found, a host that does not
    resolve)."""
    if isinstance(exc, DestinationRefusedError):
        return EXIT_FAILED if exc.reason == "unresolved" else EXIT_USAGE
    if isinstance(exc, ConfigurationError | InvalidKeyError | PayloadError):
        return EXIT_USAGE
    return EXIT_FAILED


def _flag_of(exc: RetrysafeError, flags: Mapping[str, str]) -> str | None:
    """The command-line option to blame for ``exc`` (``flags`` maps the library's option
    names, ``"payload"`` and ``"key"`` to the command's flags)."""
    if isinstance(exc, ConfigurationError):
        return flags.get(exc.option or "") or ("--store" if exc.option == "store" else None)
    if isinstance(exc, PayloadError):
        return flags.get("payload")
    if isinstance(exc, InvalidKeyError):
        return flags.get("key")
    if isinstance(exc, DestinationRefusedError):
        return flags.get("url")
    return None


@contextmanager
def errors(store: str | None = None, flags: Mapping[str, str] | None = None) -> Iterator[None]:
    """Turn a retrysafe error into one ``retrysafe: error: …`` line and its exit code
    (:func:`exit_code_of`); bad input names the option (``flags``, see :func:`_flag_of`).
    A write refused by a store that can only be read says so. The drivers' own log lines
    (psycopg's pool discarding a broken connection) are kept off stderr meanwhile: the one
    error line says what failed (a worker routes them to its JSON lines itself)."""
    try:
        with driver_lines_to(logging.NullHandler()):
            yield
    except StoreUnavailableError as exc:
        if store is not None and _is_read_only(store, exc):
            fail(
                f"the store {_sqlite_file(store) or store} is read-only: commands that only "
                "read (list, show) can use it, this command needs to write"
            )
        fail(str(exc))
    except RetrysafeError as exc:
        code = exit_code_of(exc)
        flag = _flag_of(exc, flags or {}) if code == EXIT_USAGE else None
        message = str(exc)
        if isinstance(exc, SchemaError) and store is not None:
            # On the command line, the command to run (not the Python way too).
            from retrysafe.stores._schema import MIGRATE_HINT
            from retrysafe.stores._url_check import redact_url

            command = f"retrysafe migrate --store {shlex.quote(redact_url(store))}"
            ctx = click.get_current_context(silent=True)
            schema = None if ctx is None else ctx.meta.get(_SCHEMA_META)
            if schema is not None:
                command += f" --schema {schema}"
            if _sqlite_file(store) == ":memory:":
                # Each process's in-memory database is its own and starts empty: no
                # migrate could fill the one this command opens.
                message = message.replace(
                    MIGRATE_HINT,
                    "an in-memory SQLite database (:memory:) is empty and private to one "
                    "process; give a file, e.g. sqlite:///outbox.db, created once with "
                    "`retrysafe migrate`",
                )
            message = message.replace(MIGRATE_HINT, f"run `{command}`")
        fail(f"{flag}: {message}" if flag else message, code)


def check_can_ask(yes: bool, action: str) -> None:
    """A command that asks before it deletes: without ``--yes`` and without a terminal on
    stdin (a script, a pipe, stdin closed) it refuses at once (exit 2, nothing changed) instead of
    prompting where no answer can come. ``action``: what it does, e.g. ``"purge"``."""
    if not yes and (sys.stdin is None or not sys.stdin.isatty()):  # None: stdin closed
        fail(
            f"--yes: stdin is not a terminal, so {action} cannot ask; pass --yes to {action} "
            "without asking (nothing was changed)",
            EXIT_USAGE,
        )


@contextmanager
def rerun_with(flag: str) -> Iterator[None]:
    """A submission whose write got no answer (:class:`SubmitOutcomeUnknownError`): one
    error line naming ``flag`` and the value to run the command again with, so that a rerun
    returns what was stored instead of recording it again under a fresh key."""
    try:
        yield
    except SubmitOutcomeUnknownError as exc:
        fail(
            f"{exc.__cause__ or exc}; it may have been recorded all the same: run this command "
            f"again with {flag} {shlex.quote(exc.key)} (that returns what was stored or "
            "records it once; without it, it could be recorded twice)"
        )


@contextmanager
def limit_hint(python_hint: str, option: str) -> Iterator[None]:
    """Inside, a :class:`PayloadError` over a limit names the command line's ``option`` to
    raise it (``--max-body BYTES raises it``) instead of ``python_hint``, the API's way."""
    try:
        yield
    except PayloadError as exc:
        if python_hint not in str(exc):
            raise
        message = str(exc).replace(python_hint, f"{option} BYTES raises it")
        raise PayloadError(message, path=exc.path) from None


def json_option(fn: _F) -> _F:
    """``--json``: the result as JSON on stdout, for scripts."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


# ---------------------------------------------------------------------- --store
def canonical_scheme(url: str) -> str | None:
    """``"sqlite"``, ``"postgresql"``, ``"redis"``, ``"redis+cluster"`` or ``"memory"`` for a
    URL of that kind (any spelling), else None."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    for name, (spellings, _) in _SCHEMES.items():
        if scheme in spellings:
            return name
    return None


def _sqlite_file(url: str) -> str | None:
    """The file of a well-formed ``sqlite://`` URL, else None."""
    if canonical_scheme(url) != "sqlite":
        return None
    from retrysafe.stores._sqlite import sqlite_path_from_url

    try:
        return sqlite_path_from_url(url)
    except RetrysafeError:
        return None


def _shown(url: str) -> str:
    """``url`` for an error line: no password, at most 200 characters."""
    from retrysafe.client._jobs import shown_url

    return shown_url(url)


def _is_read_only(store: str, exc: StoreUnavailableError) -> bool:
    """Did a write fail because the store can be read but not written?"""
    low = str(exc).lower()
    if "readonly" in low or "read-only" in low:
        return True
    path = _sqlite_file(store)
    if path is None or "unable to open" not in low or not Path(path).expanduser().is_file():
        return False
    from retrysafe.stores import SQLiteStore

    try:
        SQLiteStore(path, readonly=True).close()
    except RetrysafeError:
        return False
    return True


class StoreURL(StrParamType):
    """A store URL of one of ``schemes``, checked before anything is opened: an unknown or
    unsupported scheme, and for SQLite a directory, a missing directory or a file that is not
    a SQLite database, are usage errors (exit 2) naming ``--store``."""

    name = "url"

    def __init__(self, schemes: Sequence[str]) -> None:
        self.schemes = tuple(schemes)

    def examples(self) -> str:
        shown = [_SCHEMES[s][1] for s in self.schemes]
        return ", ".join(shown[:-1]) + f" or {shown[-1]}" if len(shown) > 1 else shown[0]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            self.fail(f"{value!r} is not a store URL", param, ctx)
        # Say where a bad URL came from when it may be the environment's (click records a
        # value's source only once the value is converted).
        where = f" (the value of ${STORE_ENV})" if os.environ.get(STORE_ENV) == value else ""
        problem = self.problem(value)
        if problem is not None:
            self.fail(problem + where, param, ctx)
        return value

    def problem(self, url: str) -> str | None:
        """What is wrong with ``url`` for this command, or None."""
        scheme = canonical_scheme(url)
        if scheme is None:
            if "://" not in url:
                hint = f"; for a SQLite file: sqlite:///{url}" if url.endswith(".db") else ""
                return f"{clip(url, 200)!r} is not a store URL (e.g. {self.examples()}){hint}"
            given = url.split("://", 1)[0]
            return (
                f"unknown store scheme {clip(given, 60)!r} in {_shown(url)!r}; this command "
                f"supports {self.examples()}"
            )
        if scheme not in self.schemes:
            holds = "keeps idempotency keys only" if scheme != "memory" else "forgets everything"
            return (
                f"a {scheme}:// store {holds}; this command needs {self.examples()} "
                f"(got {_shown(url)!r})"
            )
        if scheme == "sqlite":
            return _sqlite_problem(url)
        return None


def _sqlite_problem(url: str) -> str | None:
    """Why ``sqlite:///…`` cannot name a store file (None: it can, existing or not)."""
    from retrysafe.stores._sqlite import sqlite_path_from_url

    try:
        path = sqlite_path_from_url(url)
    except ConfigurationError as exc:
        return clip(str(exc), 300)
    if path == ":memory:":
        return None
    shown = clip(path, 200)
    if "\x00" in path:
        return f"{shown!r} contains a NUL character"
    file = Path(path).expanduser()
    try:
        if file.is_dir():
            return f"{shown} is a directory, not a SQLite file"
        if not file.resolve().parent.is_dir():
            return f"directory {clip(str(file.resolve().parent), 200)} does not exist"
        if file.exists() and not file.is_file():
            return f"{shown} is not a regular file"
        if file.is_file() and file.stat().st_size > 0:
            try:
                with open(file, "rb") as f:
                    head = f.read(len(_SQLITE_MAGIC))
            except OSError:
                return None  # unreadable: the store says why when it opens it
            if head != _SQLITE_MAGIC:
                return f"{shown} is not a SQLite database"
    except OSError as exc:  # a name too long, a component that is a file, a loop
        return f"cannot use {shown}: {exc.strerror or exc}"
    return None


class SchemaName(StrParamType):
    """A PostgreSQL schema name retrysafe accepts: a plain lower-case identifier (letters,
    digits, _; PostgreSQL folds an unquoted name to lower case, so ``App`` would be read as
    ``app`` but created as ``"App"``)."""

    name = "schema"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from retrysafe.stores._url_check import SCHEMA_NAME, reserved_schema

        if not isinstance(value, str) or SCHEMA_NAME.fullmatch(value) is None:
            upper = isinstance(value, str) and SCHEMA_NAME.fullmatch(value.lower()) is not None
            self.fail(
                f"{shown_value(value, 60)} is not a plain identifier (1–63 lower-case letters, "
                "digits or _, not starting with a digit)"
                + (f"; PostgreSQL folds unquoted names: use {value.lower()!r}" if upper else ""),
                param,
                ctx,
            )
        reserved = reserved_schema(value)
        if reserved is not None:
            self.fail(f"{value!r}: {reserved}", param, ctx)
        return value


#: Where :func:`store_option`'s ``--schema`` leaves its value for :func:`opened_store`.
_SCHEMA_META = "retrysafe.schema"


def _remember_schema(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.meta[_SCHEMA_META] = value


def remember_schema(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The callback of a command's own ``--schema`` (``migrate``, ``ui``): a schema other
    than public is named in the ``retrysafe migrate`` command its errors suggest."""
    if value != "public":
        _remember_schema(ctx, param, value)
    return value


@overload
def store_option(fn: _F) -> _F: ...
@overload
def store_option(
    *, schemes: Sequence[str] | None = None, with_schema: bool = False
) -> Callable[[_F], _F]: ...
def store_option(
    fn: _F | None = None, *, schemes: Sequence[str] | None = None, with_schema: bool = False
) -> Any:
    """``--store URL`` (env ``RETRYSAFE_STORE``, default ``sqlite:///retrysafe.db``).

    ``@store_option(schemes=SQL_STORES)`` lists exactly those schemes in the help and checks
    the URL when the command line is parsed (:class:`StoreURL`). A bare ``@store_option``
    keeps the plain text option of the key-store commands (its help lists every key store);
    the command checks the URL itself. ``with_schema`` adds ``--schema NAME`` (env
    ``RETRYSAFE_SCHEMA``), the PostgreSQL schema :func:`opened_store` opens.
    """

    def decorate(f: _F) -> _F:
        if with_schema:
            f = click.option(
                "--schema",
                envvar=SCHEMA_ENV,
                type=SchemaName(),
                default=None,
                expose_value=False,
                callback=_remember_schema,
                help="PostgreSQL schema holding retrysafe's tables (default public).",
            )(f)
        if schemes is None:
            kind: Any = None
            text = (
                "Store URL: sqlite:///path.db, postgresql://user@host/db, "
                "redis://host:6379/0 or redis+cluster://host:7000,host:7001 (see "
                "docs/stores.md)."
            )
        else:
            kind = StoreURL(schemes)
            text = f"Store URL: {kind.examples()} (see docs/stores.md)."
        return click.option(
            "--store",
            envvar=STORE_ENV,
            default=DEFAULT_STORE,
            show_default=True,
            metavar="URL",
            type=kind,
            cls=StoreOption,
            help=text,
        )(f)

    return decorate if fn is None else decorate(fn)


class StoreOption(click.Option):
    """``--store``, whose ``RETRYSAFE_STORE=`` (set, but empty) is a mistake, not a request
    for the default store: click reads an empty variable as unset, and the command then said
    there was no store at ``retrysafe.db``, which nobody had named."""

    def value_from_envvar(self, ctx: click.Context) -> Any:
        if os.environ.get(STORE_ENV) == "":
            raise click.BadParameter(
                f"{STORE_ENV} is set but empty: give it a store URL, unset it, or pass --store",
                ctx=ctx,
                param=self,
            )
        return super().value_from_envvar(ctx)


def no_store_message(url: str, path: str) -> str:
    return (
        f"--store: no store at {clip(path, 200)} (create it with `retrysafe migrate --store "
        f"{clip(url, 200)}`, or pass the right --store)"
    )


@contextmanager
def opened_store(url: str, *, write: bool) -> Iterator[Any]:
    """The store ``url`` names, for a command that only reads (``write=False``: a SQLite file
    is opened read-only) or that changes it; either way it must exist: a SQLite file that does
    not exist is refused (exit 2, with the hint to run ``retrysafe migrate``) and a database
    without retrysafe's tables is a SchemaError naming ``retrysafe migrate`` (exit 1). It never
    creates one (``retrysafe migrate`` does; the gateway, like the middleware, creates its key
    store itself).

    Call it inside :func:`errors` (store errors become error lines).
    """
    from retrysafe import stores

    scheme = canonical_scheme(url)
    options: dict[str, Any] = {}
    ctx = click.get_current_context(silent=True)
    schema = None if ctx is None else ctx.meta.get(_SCHEMA_META)
    if schema is not None:
        if scheme != "postgresql":
            fail(
                f"--schema (or {SCHEMA_ENV}): only a postgresql:// store has a schema",
                EXIT_USAGE,
            )
        options["schema"] = schema
    if scheme == "sqlite":
        path = _sqlite_file(url)
        if path is not None and path != ":memory:" and not Path(path).expanduser().exists():
            fail(no_store_message(url, path), EXIT_USAGE)
        options = {"create": False} if write else {"readonly": True}
    elif scheme == "postgresql":
        options["create"] = False
    # A warning while opening (an index or trigger dropped by hand) is one line, the CLI's
    # own, unless the command logs already (a worker's log lines: it is one of them).
    logs = logging.getLogger("retrysafe").hasHandlers()
    with nullcontext() if logs else warning_lines():
        store = stores.open_store(url, **options)
    try:
        yield store
    finally:
        store.close()


# ---------------------------------------------------------------------- number options
class Number(FloatParamType):
    """A finite float in ``(0, high]`` (``[0, high]`` with ``zero``; ``[low, high]`` with a
    ``low`` above 0): NaN, infinities, negative numbers and absurdly large ones are usage
    errors, not values, and the message states the range that holds."""

    name = "float"

    def __init__(
        self, *, zero: bool = False, low: float = 0.0, high: float = 1e9, unit: str = "seconds"
    ) -> None:
        self.zero = zero
        self.low = low
        self.high = high
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(str(value).strip())
            except ValueError:
                self.fail(f"{shown_value(value, 60)} is not a number", param, ctx)
        if self.low > 0:
            bounds = f"{self.low:g} ≤ x ≤ {self.high:g}"
        else:
            bounds = f"0 {'≤' if self.zero else '<'} x ≤ {self.high:g}"
        if not math.isfinite(number):
            self.fail(
                f"{value!r} is not a finite number (the range is {bounds} {self.unit})", param, ctx
            )
        if number < max(0.0, self.low) or (number == 0 and not self.zero) or number > self.high:
            self.fail(f"{number:g} is not in the range {bounds} ({self.unit})", param, ctx)
        return number


# ---------------------------------------------------------------------- tables
def print_table(*renderables: Any) -> None:
    """Print rich tables on stdout: fitted to the terminal (or ``$COLUMNS``) when there is
    one, at their natural width when output goes to a pipe or a file (never wrapped at 80
    columns)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        wide = console.options.update_width(1_000_000)
        width = max(console.measure(r, options=wide).maximum for r in renderables)
        console = Console(width=max(width, 20))
    for r in renderables:
        console.print(r)


# ---------------------------------------------------------------------- stored text shown
def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


#: Lines a command's writing thread holds for a reader that is behind (about 4 MB of a
#: worker's attempt lines); later ones are dropped (and counted where the command says so).
LINES_BACKLOG = 10_000
#: Seconds a stopping worker's last lines wait for a reader that is behind, then are dropped
#: (a child's, then the command's summary: within the 5-s stop of docs/cli.md).
LAST_LINES_WAIT = 2.0


class _WarningLines(logging.Handler):
    """retrysafe's log warnings as the CLI's own lines: ``retrysafe: warning: …`` on stderr
    (or through ``echo``), one line each, control characters escaped (a destination's name,
    an error's words)."""

    def __init__(self, level: int, echo: Callable[[str], None] | None = None) -> None:
        super().__init__(level)
        self.echo = echo

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = "retrysafe: warning: " + visible_text(" ".join(record.getMessage().split()))
            if self.echo is None:
                click.echo(line, err=True)
            else:
                self.echo(line)
        except Exception:  # a closed stderr: the warning is dropped, the command goes on
            self.handleError(record)


class _WarningsLater(logging.Handler):
    """retrysafe's warnings as ``retrysafe: warning: …`` lines on stderr
    (:class:`_WarningLines`), written by a thread of their own: an event loop only queues
    them, so a terminal that does not take them (Ctrl-S, a stalled ``screen``) never blocks
    it. Up to :data:`LINES_BACKLOG` wait, later ones are
    dropped; :meth:`close` lets the thread write what waits, for at most
    :data:`LAST_LINES_WAIT` seconds."""

    def __init__(self, echo: Callable[[str], None] | None = None) -> None:
        super().__init__(logging.WARNING)
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(LINES_BACKLOG)
        self._lines = _WarningLines(logging.WARNING, echo)
        self._thread = threading.Thread(target=self._write, name="retrysafe-warnings")
        self._thread.daemon = True
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None  # formatted here, once
        except Exception:  # arguments that do not fit the message: logging's own report
            self.handleError(record)
            return
        with suppress(queue.Full):
            self._queue.put_nowait(record)

    def close(self) -> None:
        with suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(LAST_LINES_WAIT)
        super().close()

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            self._lines.handle(record)


@contextmanager
def warning_lines(echo: Callable[[str], None] | None = None) -> Iterator[None]:
    """While the block runs, the ``retrysafe`` logger's warnings (a destination that stopped
    answering, a store that went away) are the CLI's ``retrysafe: warning:`` lines instead of
    Python's bare last-resort lines (commands that print no log lines of their own), written
    by a thread (:class:`_WarningsLater`): an event loop that logs never waits for the
    terminal. Those still waiting when the block ends are written first (within
    :data:`LAST_LINES_WAIT` seconds). ``echo`` writes each line instead of stderr (above a
    live display)."""
    log = logging.getLogger("retrysafe")
    handler = _WarningsLater(echo)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()


def visible_text(text: str, *, keep: str = "") -> str:
    """``text`` with every character a terminal would act on or not show — control
    characters (ESC, BEL, CR, …) and the other non-printable ones (``str.isprintable``) —
    written as an escape (``\\x1b``, ``\\u200b``), except those in ``keep``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def plain_cell(text: str) -> Any:
    """Stored text (or text naming a store) for a table: a rich ``Text``, so ``[…]`` is never
    read as markup, with its control characters shown escaped."""
    from rich.text import Text

    return Text(visible_text(text))


def plain_table(**options: Any) -> Any:
    """A rich ``Table`` whose ``str`` cells are :func:`plain_cell`: a table of stored values
    (an idempotency key of ``[/]`` is a valid key, and stopped `jobs list` with a markup
    error; one of ``[bold]`` restyled the row). A ``str`` title is plain too."""
    from rich.table import Table

    class _Plain(Table):
        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            cells = [plain_cell(r) if isinstance(r, str) else r for r in renderables]
            super().add_row(*cells, **kwargs)

    title = options.pop("title", None)
    return _Plain(title=plain_cell(title) if isinstance(title, str) else title, **options)


# ---------------------------------------------------------------------- listen addresses
def parse_listen(value: str, *, option: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → ``(host, port)``; a usage error names the option."""
    host, sep, port_text = value.rpartition(":")
    if (
        not sep
        or not host
        or not (port_text.isascii() and port_text.isdigit())
        or not 0 < int(port_text) < 65536
        or any(c.isspace() or c in "/?#@" for c in host)
        or not _host_shaped(host)
    ):
        raise click.BadParameter(
            f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080, or [::1]:8080 for IPv6)",
            param_hint=option,
        )
    return host.strip("[]"), int(port_text)


def _host_shaped(host: str) -> bool:
    """A name or an IPv4 address, or an IPv6 address in brackets, whole: ``[::1`` or
    ``::1`` (whose last ``:`` reads as the port's) would be bound as a host no interface
    has (exit 1, "Name or service not known", not a usage error)."""
    if host.startswith("["):
        inner = host[1:-1]
        return host.endswith("]") and bool(inner) and not any(c in "[]" for c in inner)
    return not any(c in "[]:" for c in host)


def check_port_free(
    host: str, port: int, *, option: str | None = None, code: int = EXIT_FAILED
) -> None:
    """Exit ``code`` with a clear message (naming ``option`` when given) when ``host:port``
    cannot be bound (in use, bad address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"{option}: " if option else ""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            _cannot_listen(f"{where}cannot listen on {host}:{port}", exc, code)


def _cannot_listen(what: str, exc: OSError, code: int) -> NoReturn:
    """Exit ``code`` with ``what`` and why the address could not be bound."""
    if exc.errno == errno.EADDRINUSE:
        fail(f"{what}: the port is already in use", code)
    fail(f"{what}: {exc.strerror or exc}", code)


# ---------------------------------------------------------------------- --metrics
def metrics_option(fn: _F) -> _F:
    """``--metrics HOST:PORT``: serve Prometheus metrics while the command runs."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            parse_listen(value, option="--metrics")  # before anything is opened
        return value

    return click.option(
        "--metrics",
        "metrics_address",
        metavar="HOST:PORT",
        default=None,
        callback=check,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics while running (needs "
        "pip install 'retrysafe[metrics]'; keep it on loopback or a private network).",
    )(fn)


@contextmanager
def serving_metrics(address: str | None, store: Any, *, log: bool = False) -> Iterator[Any]:
    """Serve ``/metrics`` on ``address`` for the duration of the block and yield the
    :class:`~retrysafe.observability.Prometheus` to pass as ``telemetry=`` (None without an
    address). Its registry is the command's own, with the process, platform and garbage
    collector metrics of prometheus-client beside retrysafe's, and a
    :class:`~retrysafe.observability.StoreCollector` reading ``store`` (an opened store, not
    closed here) at each scrape.

    Says where on stderr (``log``: as a JSON log line on ``retrysafe.metrics``, for a
    command whose stderr is JSON lines). Exits 2 with one line: an unparsable address,
    prometheus-client missing, a port in use or an address that is not this machine's
    (nothing is left running).
    """
    if address is None:
        yield None
        return
    host, port = parse_listen(address, option="--metrics")
    try:
        import prometheus_client as prom
    except ImportError:
        fail(
            "--metrics: prometheus-client is not installed: pip install 'retrysafe[metrics]'",
            EXIT_USAGE,
        )
    from retrysafe.observability import Prometheus, serve_metrics

    registry = prom.CollectorRegistry()
    prom.ProcessCollector(registry=registry)
    prom.PlatformCollector(registry=registry)
    prom.GCCollector(registry=registry)
    metrics = Prometheus(registry)
    try:
        server = serve_metrics(host, port, metrics=metrics, store=store)
    except OSError as exc:
        _cannot_listen(f"--metrics: cannot listen on {address}", exc, EXIT_USAGE)
    if log:  # a command whose stderr is JSON lines (the gateway)
        import logging

        logging.getLogger("retrysafe.metrics").info(
            "metrics listening", extra={"metrics": server.url}
        )
    else:
        click.echo(f"retrysafe: metrics at {server.url}", err=True)
    try:
        yield metrics
    finally:
        server.close()


class ProgressStream:
    """stderr for progress and notes of a long run (``proof``, ``demo``): once it cannot be
    written (a closed pipe: ``2>&1 | head``), what is written is dropped and the run goes on
    to its results and its exit status."""

    def __init__(self, stream: Any) -> None:
        self._stream: Any = stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                self._stream.write(text)
            except (BrokenPipeError, ValueError, OSError):  # ValueError: closed
                self._stream = None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._stream = None

    def isatty(self) -> bool:
        return self._stream is not None and bool(self._stream.isatty())

    def fileno(self) -> int:
        if self._stream is None:
            raise OSError("progress stream closed")
        return int(self._stream.fileno())


#: The loggers of the store drivers: their own lines (psycopg's pool discarding a broken
#: connection) reach stderr through the root logger unless a command takes them.
DRIVER_LOGGERS = ("psycopg", "psycopg_pool", "redis")


@contextmanager
def driver_lines_to(handler: logging.Handler) -> Iterator[None]:
    """Send the drivers' own log lines (:data:`DRIVER_LOGGERS`, warnings and up) to
    ``handler`` only while inside, not to stderr by way of the root logger: a command's one
    error line says what failed (``keys``: a ``NullHandler``), a worker's JSON lines carry
    them (``--processes`` would print each one per process). Restored afterwards."""
    saved = []
    for name in DRIVER_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate


@contextmanager
def stdout_may_close() -> Iterator[None]:
    """Write results on stdout in this block; should its reader leave (``| head -1``), the
    rest is dropped without a traceback (stdout is pointed at the null device, so nothing
    fails at exit either) and the command goes on to exit by its own status. Started with
    stdout closed (``>&-``), there is nowhere to write: the results are dropped. A stdout that
    cannot take them (a full disk, ``>/dev/full``) exits 1 with one line."""
    if sys.stdout is None:  # Python's stand-in for a closed descriptor 1
        yield
        return
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_to_null()
    except OSError as exc:
        stdout_to_null()  # what is still buffered would fail again at exit
        fail(f"cannot write the results to stdout: {exc.strerror or exc}", EXIT_FAILED)


def stdout_to_null() -> None:
    """Point descriptor 1 at the null device: what is still buffered for stdout, and what
    is written later, goes nowhere instead of failing again (at exit too)."""
    with suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


def results_console() -> Any:
    """A rich ``Console`` on stdout for :func:`stdout_may_close`: a closed pipe raises
    ``BrokenPipeError`` there, instead of rich's own exit 1 (which means "failed" here)."""
    from rich.console import Console

    class _Results(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return _Results()


def progress_console() -> Any:
    """The rich ``Console`` for a long run's progress and notes: on stderr through
    :class:`ProgressStream`, and, when stderr is not a terminal (a log, CI), one line per
    note, never wrapped at 80 columns."""
    from typing import IO, cast

    from rich.console import Console

    stream = cast("IO[str]", ProgressStream(sys.stderr))  # the file methods rich uses
    console = Console(file=stream)
    if not console.is_terminal:
        console = Console(file=stream, width=1_000_000)
    return console
