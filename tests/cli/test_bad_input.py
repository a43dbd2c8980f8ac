"""Bad input to every option of the outbox, webhooks, agents and migrate commands: an empty
string, NaN, inf, a negative number and a 10 MB string, and every ``--store`` given an unknown
scheme, a directory, a path in a missing directory and a file that is not a database. Each is
exit 2 with one ``retrysafe: error:`` line naming the option; nothing is created or changed.

A value that is valid for an option (``-1`` is JSON, ``NaN`` a fine event type or idempotency
key, an empty description is a description) is left out of that option's cases, by name, in
:data:`VALID`.
"""

from __future__ import annotations

import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from retrysafe import Outbox
from retrysafe.cli import cli

BIG = "x" * (10 * 1024 * 1024)
VALUES = {"empty": "", "nan": "NaN", "inf": "inf", "negative": "-1", "10MB": BIG}
V = "\0value"  # where the bad value goes in a command line (arguments after "--", so that
# "-1" reaches the argument instead of being read as an option)
EP = "\0endpoint"  # the id of the store's endpoint
OURS = ("agents", "dlq", "jobs", "migrate", "reconcile", "webhooks", "worker")


@dataclass(frozen=True)
class Case:
    """``args`` (with :data:`V`) and the name the error line must give (``--flag`` or the
    argument's metavar); ``valid`` are the :data:`VALUES` this option accepts."""

    args: tuple[str, ...]
    name: str
    valid: frozenset[str] = frozenset()


def case(*args: str, name: str, valid: tuple[str, ...] = ()) -> Case:
    return Case(args, name, frozenset(valid))


_URL = "http://example.test/x"
_HOOK = "http://127.0.0.1:9/x"
# Free text, ids and JSON accept these; each exception is named here.
TEXT = ("empty", "nan", "inf", "negative")  # a description, a reason: any short text
TOKEN = ("nan", "inf", "negative")  # visible ASCII: keys, event ids/types, run ids

CASES = [
    # jobs submit
    case("jobs", "submit", "--", V, name="URL"),
    case("jobs", "submit", _URL, "--data", V, name="--data", valid=("negative",)),  # -1: JSON
    case("jobs", "submit", _URL, "--method", V, name="--method", valid=("nan", "inf")),
    case("jobs", "submit", _URL, "--header", V, name="--header"),
    case("jobs", "submit", _URL, "--key", V, name="--key", valid=TOKEN),
    case("jobs", "submit", _URL, "--deadline", V, name="--deadline"),
    case("jobs", "submit", _URL, "--max-body", V, name="--max-body"),
    # jobs list | show | retry | cancel
    case("jobs", "list", "--state", V, name="--state"),
    case("jobs", "list", "--limit", V, name="--limit"),
    case("jobs", "show", "--", V, name="JOB_ID"),
    case("jobs", "retry", "--", V, name="JOB_ID"),
    case("jobs", "cancel", "--", V, name="JOB_ID"),
    # worker
    *[
        case("worker", "--until-idle", flag, V, name=flag)
        for flag in (
            "--concurrency",
            "--max-per-destination",
            "--attempts",
            "--timeout",
            "--wait-initial",
            "--wait-max",
            "--lease",
            "--heartbeat",
            "--max-run-time",
            "--processes",
            "--metrics",
        )
    ],
    # reconcile
    case("reconcile", "--timeout", V, name="--timeout"),
    case("reconcile", "--limit", V, name="--limit"),
    case("reconcile", "--concurrency", V, name="--concurrency"),
    case("reconcile", "--", V, name="JOB_IDS"),
    # dlq
    case("dlq", "list", "--limit", V, name="--limit"),
    case("dlq", "replay", "--", V, name="JOB_IDS"),
    case("dlq", "purge", "--yes", "--older-than", V, name="--older-than"),
    case("dlq", "purge", "--yes", "--state", V, name="--state"),
    # webhooks endpoints
    case("webhooks", "endpoints", "add", "--allow-private", "--", V, name="URL"),
    *[
        case("webhooks", "endpoints", "add", _HOOK, "--allow-private", flag, V, name=flag, valid=ok)
        for flag, ok in (
            ("--secret", ()),
            ("--event-type", TOKEN),
            ("--description", TEXT),
            ("--schedule", ()),
            ("--rate-limit", ()),
        )
    ],
    case("webhooks", "endpoints", "show", "--", V, name="ENDPOINT_ID"),
    case("webhooks", "endpoints", "update", "--description", "d", "--", V, name="ENDPOINT_ID"),
    *[
        case("webhooks", "endpoints", "update", EP, flag, V, name=flag, valid=ok)
        for flag, ok in (
            ("--url", ()),
            ("--secret", ()),
            ("--event-type", TOKEN),
            ("--description", TEXT),
            ("--schedule", ()),
            ("--rate-limit", ()),
        )
    ],
    case("webhooks", "endpoints", "disable", "--", V, name="ENDPOINT_ID"),
    case("webhooks", "endpoints", "disable", EP, "--reason", V, name="--reason", valid=TEXT),
    case("webhooks", "endpoints", "enable", "--", V, name="ENDPOINT_ID"),
    case("webhooks", "endpoints", "delete", "--yes", "--", V, name="ENDPOINT_ID"),
    # webhooks send
    case("webhooks", "send", "--", V, "{}", name="EVENT_TYPE", valid=TOKEN),
    case("webhooks", "send", "--", "a.b", V, name="PAYLOAD", valid=("negative",)),  # -1: JSON
    case("webhooks", "send", "a.b", "{}", "--id", V, name="--id", valid=TOKEN),
    case("webhooks", "send", "a.b", "{}", "--max-payload", V, name="--max-payload"),
    # webhooks dlq
    case("webhooks", "dlq", "list", "--endpoint", V, name="--endpoint"),
    case("webhooks", "dlq", "list", "--event-type", V, name="--event-type", valid=TOKEN),
    case("webhooks", "dlq", "list", "--limit", V, name="--limit"),
    case("webhooks", "dlq", "show", "--", V, name="DELIVERY_ID"),
    case("webhooks", "dlq", "replay", "--", V, name="DELIVERY_IDS"),
    case("webhooks", "dlq", "replay", "--endpoint", V, name="--endpoint"),
    case("webhooks", "dlq", "replay", "--event-type", V, name="--event-type", valid=TOKEN),
    case("webhooks", "dlq", "purge", "--yes", "--endpoint", V, name="--endpoint"),
    case("webhooks", "dlq", "purge", "--yes", "--event-type", V, name="--event-type", valid=TOKEN),
    case("webhooks", "dlq", "purge", "--yes", "--older-than", V, name="--older-than"),
    # webhooks worker
    case("webhooks", "worker", "--until-idle", "--concurrency", V, name="--concurrency"),
    case(
        "webhooks",
        "worker",
        "--until-idle",
        "--max-per-destination",
        V,
        name="--max-per-destination",
    ),
    *[
        case("webhooks", "worker", "--until-idle", flag, V, name=flag)
        for flag in ("--lease", "--heartbeat", "--max-run-time", "--processes", "--metrics")
    ],
    # migrate, agents
    case("migrate", "--schema", V, name="--schema", valid=("nan", "inf")),  # identifiers
    case("agents", "runs", "--limit", V, name="--limit"),
    case("agents", "calls", "--", V, name="RUN_ID", valid=TOKEN),
]

#: Every leaf command of ours: (path, the arguments it needs besides --store).
COMMANDS = {
    ("jobs", "submit"): (_URL,),
    ("jobs", "list"): (),
    ("jobs", "show"): ("ab",),
    ("jobs", "retry"): ("ab",),
    ("jobs", "cancel"): ("ab",),
    ("worker",): ("--until-idle",),
    ("reconcile",): (),
    ("dlq", "list"): (),
    ("dlq", "replay"): ("--all",),
    ("dlq", "purge"): ("--yes",),
    ("webhooks", "endpoints", "add"): (_HOOK, "--allow-private"),
    ("webhooks", "endpoints", "list"): (),
    ("webhooks", "endpoints", "show"): ("ep_0",),
    ("webhooks", "endpoints", "update"): ("ep_0", "--description", "d"),
    ("webhooks", "endpoints", "disable"): ("ep_0",),
    ("webhooks", "endpoints", "enable"): ("ep_0",),
    ("webhooks", "endpoints", "delete"): ("ep_0", "--yes"),
    ("webhooks", "send"): ("a.b", "{}"),
    ("webhooks", "dlq", "list"): (),
    ("webhooks", "dlq", "show"): ("ab",),
    ("webhooks", "dlq", "replay"): ("--all",),
    ("webhooks", "dlq", "purge"): ("--yes",),
    ("webhooks", "worker"): ("--until-idle",),
    ("migrate",): (),
    ("agents", "runs"): (),
    ("agents", "calls"): ("run-1",),
}

#: ``--schema`` (PostgreSQL) on every command that opens an outbox, webhook or agent store, as
#: on ``migrate``: an identifier, so "nan" and "inf" are valid names.
CASES += [
    case(*path, *args, "--schema", V, name="--schema", valid=("nan", "inf"))
    for path, args in COMMANDS.items()
    if path != ("migrate",)
]


def leaf_commands(
    group: click.Group = cli, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], click.Command]:
    """Our commands by path (``("webhooks", "dlq", "list")``), read from the CLI itself."""
    ctx = click.Context(group)
    found: dict[tuple[str, ...], click.Command] = {}
    for name in group.list_commands(ctx):
        if not path and name not in OURS:
            continue
        command = group.get_command(ctx, name)
        assert command is not None
        if isinstance(command, click.Group):
            found.update(leaf_commands(command, (*path, name)))
        else:
            leaf = (*path, name)
            found[leaf] = command
    return found


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A store with a job and an endpoint (its id), to copy for each test."""
    from retrysafe.webhooks import Webhooks

    path = tmp_path_factory.mktemp("template") / "store.db"
    with Outbox(f"sqlite:///{path}") as outbox:
        outbox.submit(_URL, json={})
    with Webhooks(f"sqlite:///{path}", allow_private=True) as hooks:
        endpoint = hooks.add_endpoint(_HOOK).id
    return path, endpoint


def _dump(path: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _files(directory: Path) -> dict[str, bytes]:
    """The directory's files and their contents (the store's WAL index and log aside: opening
    a store may create them)."""
    return {
        p.name: p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(directory.iterdir())
        if not p.name.endswith(("-wal", "-shm"))
    }


def _invoke(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.delenv("RETRYSAFE_STORE", raising=False)
    result = CliRunner().invoke(cli, args)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stderr


def _one_line_naming(err: str, name: str) -> None:
    assert err.count("\n") == 1 and err.endswith("\n"), err[:500]
    assert err.startswith("retrysafe: error: "), err[:500]
    assert name in err, err[:500]
    assert len(err) < 1000, len(err)


def _id(c: Case, value: str) -> str:
    """``jobs submit --deadline=nan``: the command's words, the option and the value."""
    words: list[str] = []
    for a in c.args:
        if not a.isalpha():
            break
        words.append(a)
    return f"{' '.join(words)} {c.name}={value}"


@pytest.mark.parametrize(
    ("args", "name", "value"),
    [
        pytest.param(c.args, c.name, VALUES[v], id=_id(c, v))
        for c in CASES
        for v in VALUES
        if v not in c.valid
    ],
)
def test_a_bad_value_exits_2_with_one_line_and_changes_nothing(
    template: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    name: str,
    value: str,
) -> None:
    """Each option given an empty string, NaN, inf, -1 or 10 MB: exit 2, one line naming the
    option, the store unchanged and nothing created."""
    source, endpoint = template
    store = tmp_path / "store.db"
    shutil.copy(source, store)
    before, files = _dump(store), _files(tmp_path)
    line = [value if a == V else endpoint if a == EP else a for a in args]
    at = line.index("--") if "--" in line else len(line)
    line[at:at] = ["--store", f"sqlite:///{store}"]
    monkeypatch.chdir(tmp_path)
    code, err = _invoke(line, monkeypatch)
    assert code == 2, err[:500]
    _one_line_naming(err, name)
    assert _dump(store) == before
    assert _files(tmp_path) == files


def _bad_stores(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "notes.db").write_text("not a database\n")
    return {
        "unknown-scheme": "mysql://localhost/app",
        "no-scheme": "store.db",
        "directory": f"sqlite:///{tmp_path / 'a-directory'}",
        "missing-directory": f"sqlite:///{tmp_path / 'nowhere' / 'store.db'}",
        "not-a-database": f"sqlite:///{tmp_path / 'notes.db'}",
        "empty": "",
        "nan": "NaN",
        "10MB": BIG,
        "key-store-only": "redis://127.0.0.1:6379/0",
        "memory": "memory://",
    }


_STORE_KINDS = (
    "unknown-scheme",
    "no-scheme",
    "directory",
    "missing-directory",
    "not-a-database",
    "empty",
    "nan",
    "10MB",
    "key-store-only",
    "memory",
)


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        pytest.param(command, kind, id=f"{' '.join(command)}-{kind}")
        for command in COMMANDS
        for kind in _STORE_KINDS
        # migrate accepts redis:// (nothing to migrate there: it connects and says so)
        if not (command == ("migrate",) and kind == "key-store-only")
    ],
)
def test_a_bad_store_exits_2_with_one_line_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...], kind: str
) -> None:
    """Every --store given an unknown scheme, a directory, a path in a missing directory, a
    file that is not a database (and an empty string, NaN, 10 MB, a store of a kind the
    command cannot use): exit 2, one line naming --store, the directory unchanged."""
    stores = _bad_stores(tmp_path)
    files = _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, err = _invoke([*command, *COMMANDS[command], "--store", stores[kind]], monkeypatch)
    assert code == 2, err[:500]
    _one_line_naming(err, "--store")
    assert _files(tmp_path) == files


def test_the_cases_cover_every_option_of_every_command() -> None:
    """Each value-taking option and argument of our commands (every command, listed from the
    CLI) has a case above, and --store is tried on each command: a new option without bad
    input cases fails here."""
    commands = leaf_commands()
    assert set(commands) == set(COMMANDS)
    covered = {(c.args[: len(p)], c.name) for c in CASES for p in commands if c.args[: len(p)] == p}
    missing = []
    for path, command in commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and (param.is_flag or param.name == "store"):
                continue
            if param.name in ("help", "as_json"):
                continue
            name = (
                next(o for o in param.opts if o.startswith("--"))
                if isinstance(param, click.Option)
                else param.human_readable_name
            )
            if (path, name) not in covered:
                missing.append((" ".join(path), name))
    assert missing == []


_UNPRINTABLE_URLS = {
    "escape": "https://a.example/\x1b]0;pwned\x07\x1b[2Jx",
    "control": "https://a.example/p\x01x",
    "zero-width": "https://a.example/\u200bx",
    "not-utf8": "https://a.example/\udcff",  # what Python makes of an argv byte 0xFF
}


@pytest.mark.parametrize(
    "args",
    [("jobs", "submit", "--", V), ("webhooks", "endpoints", "add", "--allow-private", "--", V)],
    ids=["jobs submit", "webhooks endpoints add"],
)
@pytest.mark.parametrize("kind", list(_UNPRINTABLE_URLS))
def test_a_url_no_request_can_carry_exits_2_and_prints_no_raw_control_character(
    template: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    kind: str,
) -> None:
    """A URL with a control or format character, or bytes that are not UTF-8: exit 2, one
    line naming URL with the character escaped (a stored ESC used to reach the terminal of
    every `jobs list`), the store unchanged (fresh-user pass: a traceback for bytes that are
    not UTF-8, and jobs that could never be sent for the rest)."""
    source, _ = template
    store = tmp_path / "store.db"
    shutil.copy(source, store)
    before = _dump(store)
    line = [_UNPRINTABLE_URLS[kind] if a == V else a for a in args]
    at = line.index("--")
    line[at:at] = ["--store", f"sqlite:///{store}"]
    code, err = _invoke(line, monkeypatch)
    assert code == 2, err[:500]
    _one_line_naming(err, "URL")
    assert "U+" in err
    assert not any(c in err for c in "\x1b\x07\x01\u200b\udcff")
    assert _dump(store) == before


def test_data_that_is_not_utf8_says_so(
    template: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-d` with a byte that is not UTF-8 (Python reads it as U+DCFF) used to be reported
    as "a lone surrogate is not UTF-8 text" (fresh-user pass): it names the cause now."""
    source, _ = template
    store = tmp_path / "store.db"
    shutil.copy(source, store)
    before = _dump(store)
    line = ["jobs", "submit", "--store", f"sqlite:///{store}", _URL, "-d", '{"a": "\udcff"}']
    code, err = _invoke(line, monkeypatch)
    assert code == 2, err[:500]
    _one_line_naming(err, "--data")
    assert "not UTF-8" in err and "surrogate" not in err
    assert _dump(store) == before


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["jobs", "submit", "{store}", _URL, "-d", "{json}"], "--data"),
        (["webhooks", "send", "{store}", "a.b", "{json}"], "PAYLOAD"),
    ],
)
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"a": 1, "a": 2}', "names a member twice"),
        ('[{"x": {"b": 1, "b": 1}}]', "names a member twice"),
        ("1E400", "the number 1E400 is too large for a float"),
        ('{"a": [-1e999]}', "the number -1e999 is too large for a float"),
    ],
)
def test_json_that_names_a_member_twice_or_a_number_no_float_holds_is_refused(
    template: tuple[Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
    flag: str,
    text: str,
    why: str,
) -> None:
    """JSON whose object names a member twice (at any depth): a parser keeps the last value
    and the first vanished without a word (a fresh user's check); a number no float holds
    (1E400), which was read as infinity and reported as "inf is not valid JSON". Now exit
    2, one line naming the argument and the cause, nothing recorded."""
    source, _ = template
    store = tmp_path / "store.db"
    shutil.copy(source, store)
    before = _dump(store)
    line = [
        part.replace("{json}", text) if part == "{json}" else part
        for part in command
        if part != "{store}"
    ]
    line[2:2] = ["--store", f"sqlite:///{store}"]
    code, err = _invoke(line, monkeypatch)
    assert code == 2, err[:500]
    _one_line_naming(err, flag)
    assert why in err
    assert _dump(store) == before


def test_a_long_bad_value_is_counted_in_its_own_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh-user pass: a 100-character --schema was reported as "(102 characters)", the
    quotes of its repr counted too. Every quoted bad value now counts its own characters;
    a short one is shown whole."""
    from retrysafe.cli._common import shown_value

    assert shown_value("a" * 100).count("(100 characters)") == 1
    assert shown_value("abc") == "'abc'" and shown_value(5) == "5"
    Outbox(f"sqlite:///{tmp_path / 's.db'}").close()
    store = ["--store", f"sqlite:///{tmp_path / 's.db'}"]
    code, err = _invoke(["jobs", "show", "z" * 100, *store], monkeypatch)
    assert code == 2 and "(100 characters)" in err, err
