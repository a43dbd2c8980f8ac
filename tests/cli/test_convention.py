"""One convention for every command (docs/cli.md): the exit statuses in each ``--help``,
``--json`` wherever a result is reported, ``--store`` listing exactly the schemes the command
supports, and no command creating a store (``retrysafe migrate`` aside)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from retrysafe.cli import cli

from .test_bad_input import COMMANDS, leaf_commands

EXIT_STATUS = (
    "Exit status: 0 done; 1 failed or left work undone;",
    "2 usage or bad input (nothing changed); 130 / 143 stopped by SIGINT / SIGTERM.",
)


def _help(*path: str) -> str:
    result = CliRunner().invoke(cli, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _every_command(group: click.Group = cli, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every group and command of the command line by path, read from the CLI itself."""
    found = [path]
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            found += _every_command(command, (*path, name))
        else:
            found.append((*path, name))
    return found


@pytest.mark.parametrize("path", _every_command(), ids=" ".join)
def test_every_help_states_the_exit_statuses(path: tuple[str, ...]) -> None:
    """`--help` of every group and of each command ends with the exit statuses of
    docs/cli.md (`chaos --help` did not: a fresh user's check)."""
    text = _help(*path)
    assert all(part in text for part in EXIT_STATUS), text[-400:]


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_command_has_json(path: tuple[str, ...]) -> None:
    """Every command reports its result as JSON with --json (for scripts)."""
    names = {p.name for p in leaf_commands()[path].params}
    assert "as_json" in names


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_store_help_lists_exactly_the_schemes_the_command_supports(
    path: tuple[str, ...],
) -> None:
    """The outbox, webhooks and agents commands keep their tables on SQLite or PostgreSQL:
    their --store help names those two and no key store; migrate also names Redis (nothing to
    migrate there)."""
    text = _help(*path)
    assert "--store URL Store URL: sqlite:///path.db" in text
    assert "postgresql://user@host/db" in text
    if path == ("migrate",):
        assert "redis://host:6379/0" in text and "redis+cluster://" in text
    else:
        assert "redis" not in text and "memory" not in text


@pytest.fixture
def pg_store(pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The PostgreSQL URL, opened by the CLI in the test's empty schema."""
    from retrysafe.stores import open_store

    def open_in_schema(url: str, **options: Any) -> Any:
        if url == pg_url:
            options.setdefault("schema", pg_schema)
        return open_store(url, **options)

    monkeypatch.setattr("retrysafe.stores.open_store", open_in_schema)
    return pg_url


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "submit", "http://example.test/x"),
        ("worker", "--until-idle"),
        ("reconcile",),
        ("dlq", "replay", "--all"),
        ("dlq", "purge", "--yes"),
        ("webhooks", "endpoints", "add", "http://127.0.0.1:9/x", "--allow-private"),
        ("webhooks", "send", "a.b", "{}"),
        ("webhooks", "dlq", "purge", "--yes"),
        ("webhooks", "worker", "--until-idle"),
    ],
    ids=" ".join,
)
def test_changing_commands_never_create_postgres_tables(
    pg_store: str, pg_schema: str, args: tuple[str, ...]
) -> None:
    """A command that changes a store, on a PostgreSQL database without retrysafe's tables:
    one error line naming `retrysafe migrate` (exit 1), and no table is created."""
    import psycopg

    result = CliRunner().invoke(cli, [*args, "--store", pg_store])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("retrysafe: error: ") and result.stderr.count("\n") == 1
    assert "retrysafe migrate" in result.stderr
    with psycopg.connect(pg_store) as conn:
        row = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (pg_schema,)
        ).fetchone()
    assert row == (0,)


@pytest.mark.parametrize(
    "args",
    [
        ["proof", "--store", "bogus", "--out", "out"],
        ["jobs", "list", "--store", "postgresql://u@127.0.0.1:5432/db?sslmode=bogus"],
    ],
    ids=["proof", "jobs-list"],
)
def test_an_error_to_a_closed_stderr_keeps_its_exit_status(args: list[str], tmp_path: Path) -> None:
    """``retrysafe … 2>&1 | head -0``: the error line cannot be written (EPIPE); the command
    still exits 2 for bad input, with no traceback in its place."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "retrysafe", *args],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=write, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stdout) == (2, b"")


@pytest.mark.parametrize("args", [["jobs", "list"], ["webhooks", "endpoints", "list"]])
def test_a_store_without_the_schema_names_the_migrate_command_to_run(
    args: list[str], tmp_path: Path
) -> None:
    """On the command line the hint is the command itself, for this store; the Python
    option (create=True) is for the API's messages."""
    empty = tmp_path / "empty.db"
    empty.touch()
    url = f"sqlite:///{empty}"
    result = CliRunner().invoke(cli, [*args, "--store", url])
    assert result.exit_code == 1, result.output
    assert f"run `retrysafe migrate --store {url}`" in result.output
    assert "create=True" not in result.output


def test_outbox_commands_take_a_postgresql_schema(pg_url: str, pg_schema: str) -> None:
    """``--schema`` (or RETRYSAFE_SCHEMA) on the outbox, DLQ, webhook and agent commands
    opens that schema, as ``migrate``, ``keys`` and ``ui`` do: without it a store outside
    ``public`` could not be used from the command line (a URL's search_path is overridden)."""
    import json

    runner = CliRunner()
    made = runner.invoke(cli, ["migrate", "--store", pg_url, "--schema", pg_schema])
    assert made.exit_code == 0, made.output
    submitted = runner.invoke(
        cli, ["jobs", "submit", "--store", pg_url, "--schema", pg_schema, "http://127.0.0.1:9/x"]
    )
    assert submitted.exit_code == 0, submitted.output
    listed = runner.invoke(
        cli, ["jobs", "list", "--store", pg_url, "--json"], env={"RETRYSAFE_SCHEMA": pg_schema}
    )
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout)["counts"]["pending"] == 1
    for args in (["dlq", "list"], ["webhooks", "endpoints", "list"], ["agents", "runs"]):
        result = runner.invoke(cli, [*args, "--store", pg_url, "--schema", pg_schema])
        assert result.exit_code == 0, (args, result.output)


def test_a_schema_for_a_sqlite_store_is_bad_input(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'o.db'}"
    assert CliRunner().invoke(cli, ["migrate", "--store", store]).exit_code == 0
    result = CliRunner().invoke(cli, ["jobs", "list", "--store", store, "--schema", "x"])
    assert result.exit_code == 2
    assert "only a postgresql:// store has a schema" in result.stderr


def test_the_schema_env_var_is_one_for_every_command_and_the_hint_names_it(
    pg_url: str, pg_schema: str
) -> None:
    """RETRYSAFE_SCHEMA is read by ``migrate`` (and ``keys``, ``ui``) as by the outbox
    commands; a command on a schema without tables says to migrate *that* schema (the hint
    without ``--schema`` migrated ``public``)."""
    import json

    runner = CliRunner()
    env = {"RETRYSAFE_SCHEMA": pg_schema}
    missing = runner.invoke(cli, ["jobs", "list", "--store", pg_url], env=env)
    assert missing.exit_code == 1
    assert f"--schema {pg_schema}`" in missing.stderr
    made = runner.invoke(cli, ["migrate", "--store", pg_url, "--json"], env=env)
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["schema"] == pg_schema
    assert runner.invoke(cli, ["jobs", "list", "--store", pg_url], env=env).exit_code == 0


@pytest.mark.parametrize(
    "args", [["worker", "--until-idle"], ["jobs", "list"], ["keys", "list"], ["migrate"]]
)
def test_an_empty_store_variable_is_said_not_taken_for_the_default(
    tmp_path: Path, args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh user's check: ``RETRYSAFE_STORE=`` (set, but empty) quietly meant the default
    store, and the command said there was no store at ``retrysafe.db``, which nobody had
    named (``migrate`` would have made one). Now it says the variable is empty (exit 2); a
    ``--store`` given on the command line still wins over it."""
    monkeypatch.chdir(tmp_path)  # a regression makes retrysafe.db here, not in the checkout
    runner = CliRunner()
    env = {"RETRYSAFE_STORE": ""}
    result = runner.invoke(cli, args, env=env)
    assert result.exit_code == 2, result.output
    assert "RETRYSAFE_STORE is set but empty" in result.stderr
    store = f"sqlite:///{tmp_path / 'given.db'}"
    made = runner.invoke(cli, ["migrate", "--store", store], env=env)
    assert made.exit_code == 0, made.output


@pytest.mark.parametrize("args", [["migrate"], ["jobs", "list"], ["keys", "list"]])
def test_an_upper_case_schema_is_refused_with_the_name_to_use(
    pg_url: str, args: list[str]
) -> None:
    """PostgreSQL reads ``App`` as ``app`` but would create ``"App"``: refused, exit 2."""
    result = CliRunner().invoke(cli, [*args, "--store", pg_url, "--schema", "F13D_Up"])
    assert result.exit_code == 2
    assert "use 'f13d_up'" in result.stderr


def test_after_sigterm_an_unrecorded_attempt_is_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job whose attempt could not be recorded (the store locked past its lease) is neither
    finished nor released: the last line says so instead of "finished or released"."""
    from retrysafe.cli._client import Served, finish
    from retrysafe.client import WorkerStats

    for lost, said in ((0, "finished or released (pending, same key)\n"), (1, "1 not recorded")):
        stats = WorkerStats()
        stats.lease_lost = lost
        with pytest.raises(SystemExit) as stop:
            finish(Served(stats, 143), until_idle=False, what="jobs")
        assert stop.value.code == 143
        assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [("SIGINT", 130, "retrysafe: interrupted"), ("SIGTERM", 143, "retrysafe: stopped by SIGTERM")],
)
def test_a_signal_while_a_command_loads_ends_the_run_after_the_load(
    tmp_path: Path, sig: str, code: int, line: str
) -> None:
    """SIGINT or SIGTERM arriving while a command's modules are imported is held until the
    import is done (raised inside an import, Ctrl-C can crash a C extension's set-up or be
    swallowed by an import lock; SIGTERM killed the process with no word), then ends the
    run as such a signal does: one line, exit 130 or 143, no traceback, the command not
    run."""
    (tmp_path / "slow_command.py").write_text(
        "import os, signal, click\n"
        f"os.kill(os.getpid(), signal.{sig})\n"
        "import json, decimal, fractions  # more loading after the signal\n"
        "print('loaded', flush=True)\n"
        "@click.command()\n"
        "def slow() -> None:\n"
        "    print('ran')\n"
    )
    code_ = (
        "import sys; from retrysafe import cli; "
        "cli._COMMANDS['slow'] = 'slow_command:slow'; cli.main(['slow'])"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", code_], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == code, (out.returncode, out.stderr)
    assert out.stdout.split() == ["loaded"]
    assert line in out.stderr and "Traceback" not in out.stderr


def test_warning_lines_are_written_by_a_thread_and_all_before_the_block_ends() -> None:
    """retrysafe's warnings during a command are `retrysafe: warning: …` lines, one each,
    control characters escaped, written by a thread of their own (an event loop that logs
    never waits for the terminal: Ctrl-S stopped a worker), every one before the block
    ends; on a terminal the worker hands them to its live display (``echo``), which draws
    them above its counts (a fresh user's check: written after the counts line, the next
    redraw erased them)."""
    import logging
    import threading

    from retrysafe.cli._common import warning_lines

    seen: list[tuple[str, str]] = []
    log = logging.getLogger("retrysafe.client")
    with warning_lines(lambda line: seen.append((threading.current_thread().name, line))):
        for n in range(50):
            log.warning("store unavailable \x1b[31m%d", n)
        log.info("not a warning")
    assert [line for _, line in seen] == [
        f"retrysafe: warning: store unavailable \\x1b[31m{n}" for n in range(50)
    ]
    assert {name for name, _ in seen} == {"retrysafe-warnings"}
    handlers = logging.getLogger("retrysafe").handlers
    assert all(type(h).__name__ != "_WarningsLater" for h in handlers)  # removed at the end



@pytest.mark.parametrize("width", [40, 80, 200])
def test_the_command_list_summarises_each_command_as_its_own_help_does(width: int) -> None:
    """``retrysafe --help`` lists the commands from their stored summaries (so that it loads
    none of them): each line is what the command's own help gives at that width."""
    import importlib

    import click

    from retrysafe.cli import _COMMANDS, _SUMMARIES

    assert sorted(_SUMMARIES) == sorted(_COMMANDS)
    limit = width - 6 - max(map(len, _COMMANDS))
    for name, ref in _COMMANDS.items():
        module, _, attr = ref.partition(":")
        own = getattr(importlib.import_module(module), attr).get_short_help_str(limit)
        assert click.Command(name, help=_SUMMARIES[name]).get_short_help_str(limit) == own


def test_the_top_level_help_loads_no_command() -> None:
    """``retrysafe --help`` (and ``retrysafe`` alone) lists every command without importing
    one: the agents and proof commands import httpx and more, 0.3 s of a 0.55-s help."""
    code = (
        "import sys\n"
        "from retrysafe import cli\n"
        "try:\n"
        "    cli.main(sys.argv[1:])\n"
        "finally:\n"
        "    loaded = sorted(m for m in sys.modules if m.startswith('retrysafe.cli._'))\n"
        "    print('loaded:', *[m for m in loaded if m != 'retrysafe.cli._common'])\n"
    )
    for args in (["--help"], []):
        out = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.rstrip().endswith("loaded:"), out.stdout[-300:]
        for name in ("agents", "proof", "worker", "webhooks"):
            assert f"\n  {name} " in out.stdout + out.stderr, (name, out.stdout, out.stderr)


@pytest.mark.parametrize("closed", [False, True], ids=["devnull", "closed"])
@pytest.mark.parametrize(
    "args",
    [
        ("dlq", "purge"),
        ("webhooks", "dlq", "purge"),
        ("webhooks", "endpoints", "delete", "ep_0123abcd"),
        ("keys", "evict", "some-key"),
    ],
)
def test_a_delete_without_yes_off_a_terminal_refuses_at_once(
    tmp_path: Path, args: tuple[str, ...], closed: bool
) -> None:
    """Every command that asks before deleting refuses at once without ``--yes`` when stdin
    is no terminal (exit 2, nothing opened or changed), as ``keys evict`` did: three of them
    printed the question on stderr, then ``aborted`` with exit 1 (a fresh user's script,
    ``dlq purge --json``), and with stdin closed (``<&-``) all four ended in a traceback."""
    store = tmp_path / "s.db"
    command = [sys.executable, "-m", "retrysafe", *args, "--store", f"sqlite:///{store}", "--json"]
    if closed:
        command = ["sh", "-c", 'exec "$@" <&-', "sh", *command]
    stdin = None if closed else subprocess.DEVNULL
    out = subprocess.run(command, capture_output=True, text=True, stdin=stdin, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("retrysafe: error: --yes: stdin is not a terminal"), out.stderr
    assert out.stdout == "" and not store.exists()
