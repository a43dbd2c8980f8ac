"""``retrysafe keys list | show | evict`` (issue 14, SPEC §10) on SQLite, PostgreSQL and Redis:
a key is named as the middleware names it (the key and its scope, or its hash), every bad input
of the issue is one clear line with the exit code of docs/cli.md, and, end to end, evicting a
completed key makes the next request with it run the handler again. The second half holds what
a fresh user found (issue 14's follow-up): stored text shown literally, paging past a key that
went away, evicting twice, a lease that ended, the store's namespace in every line."""

from __future__ import annotations

import json
import os
import select
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from retrysafe._serving import ServerThread
from retrysafe.cli import cli
from retrysafe.core import StoredResponse, key_hash, scope_from_authorization
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore, open_store
from retrysafe.stores._base import KeyAdmin, KeyEntry

FP = "f" * 64
AUTH = "Bearer tenant-one-secret"
RESP = StoredResponse(
    201, (("content-type", "application/json"), ("location", "/posts/7")), b'{"id": 7}'
)
EXIT_STATUS = "Exit status: 0 done; 1 failed or left work undone;"


@dataclass
class Spec:
    """A store the CLI is pointed at: ``args`` (``--store`` and its namespace option) and a
    Python store on the same namespace, as the middleware would open it."""

    kind: str
    url: str
    args: list[str]
    options: dict[str, Any] = field(default_factory=dict)

    def open(self, **extra: Any) -> Any:
        return open_store(self.url, **{**self.options, **extra})

    def open_on_our_clock(self) -> Any:
        """The store on the caller's clock (PostgreSQL and Redis read their server's clock by
        default and would ignore a ``now`` in the past)."""
        return self.open() if self.kind == "sqlite" else self.open(clock="caller")


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> Spec:
    """An empty key store of each kind, its schema created (`retrysafe migrate` or the
    middleware's first open)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'keys.db'}"
        SQLiteStore(tmp_path / "keys.db").close()
        return Spec("sqlite", url, ["--store", url])
    if request.param == "postgres":
        url, schema = request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema")
        open_store(url, schema=schema).close()
        return Spec("postgres", url, ["--store", url, "--schema", schema], {"schema": schema})
    url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    return Spec("redis", url, ["--store", url, "--prefix", prefix], {"prefix": prefix})


@pytest.fixture
def sqlite_spec(tmp_path: Path) -> Spec:
    """An empty SQLite key store (for the checks that do not depend on the store)."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    SQLiteStore(tmp_path / "keys.db").close()
    return Spec("sqlite", url, ["--store", url])


def keys(*args: str) -> tuple[int, str, str]:
    """Run ``retrysafe keys ARGS`` (stdin: empty, not a terminal; tables 250 columns wide)."""
    result = CliRunner().invoke(cli, ["keys", *args], env={"COLUMNS": "250"})
    return result.exit_code, result.stdout, result.stderr


def one_error_line(err: str) -> str:
    """``err`` is exactly one ``retrysafe: error:`` line; its text."""
    assert err.startswith("retrysafe: error: ") and err.count("\n") == 1, err
    return err


def hash_of(key: str, authorization: str | None = AUTH) -> str:
    scope = scope_from_authorization({"authorization": authorization} if authorization else {})
    return key_hash(scope, key)


def seed(
    spec: Spec,
    key: str,
    *,
    completed: bool = True,
    authorization: str | None = AUTH,
    response: StoredResponse = RESP,
    ago: float = 0.0,
    lease: float = 600,
    retention: float = 3600,
) -> str:
    """Claim ``key`` (as the middleware does for a request with ``authorization``) ``ago``
    seconds ago and, if ``completed``, store ``response`` for it; its key hash."""
    h = hash_of(key, authorization)
    now = time.time() - ago
    with spec.open_on_our_clock() as store:
        claimed, rec = store.claim(h, FP, now=now, lease=lease, retention=retention)
        assert claimed
        if completed:
            assert store.complete(h, rec.fencing_token, response, now=now, retention=retention)
    return h


def stored(spec: Spec, h: str) -> KeyEntry | None:
    """The record of key hash ``h`` as the store holds it now (None: absent)."""
    with spec.open() as store:
        assert isinstance(store, KeyAdmin)
        found = store.find_keys(h, now=time.time())
    return found[0] if found else None


# ---------------------------------------------------------------------- show
def test_show_names_a_key_by_key_and_authorization(spec: Spec) -> None:
    """`keys show KEY --authorization V --json`: state, fingerprint, stored status and
    headers, body size, lease, token, created and expiry times — and no body without --body."""
    before = time.time()
    h = seed(spec, "order-7")
    code, out, err = keys("show", "order-7", "--authorization", AUTH, *spec.args, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["key_hash"], shown["state"], shown["fingerprint"]) == (h, "completed", FP)
    assert (shown["status"], shown["headers"], shown["body_size"]) == (
        201,
        [list(p) for p in RESP.headers],
        len(RESP.body),
    )
    assert shown["fencing_token"] == 1 and shown["next_attempt"] == "replay"
    assert before - 5 <= shown["created_at"] <= time.time() + 5
    assert shown["expires_at"] - shown["created_at"] == pytest.approx(3600, abs=5)
    assert shown["lease_expires_at"] is None and shown["replayable"] is True
    assert "body" not in shown and "body_base64" not in shown
    running = seed(spec, "order-8", completed=False)
    code, out, err = keys("show", "--hash", running, *spec.args, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["lease_expires_at"] - shown["created_at"] == pytest.approx(600, abs=5)


def test_show_prints_the_body_only_with_body(spec: Spec) -> None:
    """--body adds the stored body (text and base64 in JSON, the text in the table)."""
    seed(spec, "order-7")
    shown_args = ("show", "order-7", "--authorization", AUTH, *spec.args)
    code, out, err = keys(*shown_args, "--json", "--body")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["body"], shown["body_base64"]) == ('{"id": 7}', "eyJpZCI6IDd9")
    code, table, err = keys(*shown_args)
    assert code == 0 and '{"id": 7}' not in table and "completed" in table
    code, table, err = keys(*shown_args, "--body")
    assert code == 0 and table.rstrip().endswith('{"id": 7}')


def test_show_by_scope_text_and_by_hash_prefix(sqlite_spec: Spec) -> None:
    """--scope takes a custom scope function's output; --hash takes the hash or a unique
    start of it; both find the same record."""
    h = key_hash("tenant-7", "k1")
    with sqlite_spec.open() as store:
        store.claim(h, FP, now=time.time(), lease=600, retention=3600)
    by_scope = keys("show", "k1", "--scope", "tenant-7", *sqlite_spec.args, "--json")
    by_hash = keys("show", "--hash", h[:12].upper(), *sqlite_spec.args, "--json")
    assert by_scope[0] == by_hash[0] == 0, (by_scope, by_hash)
    assert json.loads(by_scope[1])["key_hash"] == json.loads(by_hash[1])["key_hash"] == h
    assert json.loads(by_hash[1])["state"] == "running"


def test_a_quoted_key_is_the_key_the_middleware_parses(sqlite_spec: Spec) -> None:
    """KEY is read as the Idempotency-Key header is: '"k1"' (structured-field string) and
    'k1' (bare token) name the same key."""
    seed(sqlite_spec, "k1")
    code, out, err = keys("show", '"k1"', "--authorization", AUTH, *sqlite_spec.args, "--json")
    assert code == 0, err
    assert json.loads(out)["key_hash"] == hash_of("k1")


def test_show_never_prints_the_scope_or_the_credential(sqlite_spec: Spec) -> None:
    """Neither the Authorization value nor the scope derived from it appears in the output,
    table or JSON."""
    seed(sqlite_spec, "k1")
    scope = scope_from_authorization({"authorization": AUTH})
    for extra in ((), ("--json",)):
        code, out, err = keys("show", "k1", "--authorization", AUTH, *sqlite_spec.args, *extra)
        assert code == 0, err
        assert AUTH not in out + err and scope not in out + err and "tenant-one" not in out


def test_the_authorization_can_come_from_the_environment(sqlite_spec: Spec) -> None:
    """RETRYSAFE_AUTHORIZATION gives --authorization (kept out of `ps`); --hash and an
    explicit --scope take precedence over it."""
    h = seed(sqlite_spec, "k1")
    result = CliRunner().invoke(
        cli,
        ["keys", "show", "k1", *sqlite_spec.args, "--json"],
        env={"RETRYSAFE_AUTHORIZATION": AUTH},
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["key_hash"] == h
    by_hash = CliRunner().invoke(
        cli,
        ["keys", "show", "--hash", h, *sqlite_spec.args, "--json"],
        env={"RETRYSAFE_AUTHORIZATION": AUTH},
    )
    assert by_hash.exit_code == 0, by_hash.stderr
    other = key_hash("tenant-7", "k1")
    with sqlite_spec.open() as store:
        store.claim(other, FP, now=time.time(), lease=600, retention=3600)
    by_scope = CliRunner().invoke(
        cli,
        ["keys", "show", "k1", "--scope", "tenant-7", *sqlite_spec.args, "--json"],
        env={"RETRYSAFE_AUTHORIZATION": AUTH},
    )
    assert by_scope.exit_code == 0, by_scope.stderr
    assert json.loads(by_scope.stdout)["key_hash"] == other


# ---------------------------------------------------------------------- bad input
def test_a_key_that_does_not_exist_is_exit_1_in_one_line(spec: Spec) -> None:
    """show and evict of an unknown key: exit 1, one line naming the key and the store."""
    for command in (("show",), ("evict", "--yes")):
        code, out, err = keys(*command, "nope", "--authorization", AUTH, *spec.args)
        assert code == 1 and out == ""
        assert "no key 'nope'" in one_error_line(err)


def test_an_unknown_hash_is_exit_1(spec: Spec) -> None:
    """show --hash of a well-formed hash that names nothing: exit 1, one line."""
    code, _, err = keys("show", "--hash", "0" * 64, *spec.args)
    assert code == 1 and "no key with hash" in one_error_line(err)


@pytest.mark.parametrize(
    "key",
    ['"unterminated', "two words", "caf\u00e9", "x" * 256, "", '"   "', 'a"b'],
    ids=["unterminated", "space", "non-ascii", "256", "empty", "spaces", "bare-quote"],
)
def test_a_malformed_key_is_exit_2_and_opens_no_store(tmp_path: Path, key: str) -> None:
    """A key the middleware would answer 400 invalid-key for: exit 2 naming KEY, before any
    store is opened (the store named here does not exist, and is not created)."""
    url = f"sqlite:///{tmp_path / 'absent.db'}"
    for command in (("show",), ("evict", "--yes")):
        code, out, err = keys(*command, "--store", url, "--", key)
        assert code == 2 and out == ""
        assert one_error_line(err).startswith("retrysafe: error: KEY: invalid idempotency key")
    assert list(tmp_path.iterdir()) == []


def test_a_scope_that_does_not_match_is_not_found_and_says_why(spec: Spec) -> None:
    """The key exists under one Authorization; asked with another one, a custom --scope or
    none, it is not found (exit 1), and the line says the scope is part of the key's
    identity."""
    seed(spec, "order-7")
    for scope in (("--authorization", "Bearer someone-else"), ("--scope", "tenant-7"), ()):
        code, _, err = keys("show", "order-7", *scope, *spec.args)
        assert code == 1
        line = one_error_line(err)
        assert "no key 'order-7'" in line and "the scope is part of a key's identity" in line
        assert "--authorization" in line and "--scope" in line


def test_an_ambiguous_hash_prefix_is_exit_1_naming_candidates(spec: Spec) -> None:
    """Two stored keys whose hashes share a first digit: --hash of that digit is ambiguous
    (exit 1, one line naming both); one more digit picks one."""
    by_digit: dict[str, str] = {}
    i = 0
    while True:
        h = hash_of(f"k{i}")
        if h[0] in by_digit:
            first, second = by_digit[h[0]], f"k{i}"
            break
        by_digit[h[0]] = f"k{i}"
        i += 1
    a, b = seed(spec, first), seed(spec, second)
    code, _, err = keys("show", "--hash", a[0], *spec.args)
    assert code == 1
    line = one_error_line(err)
    assert "ambiguous" in line and a[:16] in line and b[:16] in line
    unique = next(n for n in range(1, 64) if a[:n] != b[:n])
    code, out, err = keys("show", "--hash", a[:unique], *spec.args, "--json")
    assert code == 0 and json.loads(out)["key_hash"] == a, err


@pytest.mark.parametrize(
    ("args", "blamed"),
    [
        (("show", "--hash", "xyz"), "--hash"),
        (("show", "--hash", "a" * 65), "--hash"),
        (("show", "--hash", ""), "--hash"),
        (("show", "k", "--hash", "ab"), "--hash"),
        (("show", "--hash", "ab", "--scope", "s"), "--hash"),
        (("show", "k", "--scope", "s", "--authorization", "a"), "--scope"),
        (("show", "k", "--authorization", "a\nb"), "--authorization"),
        (("show",), "KEY"),
        (("evict", "--yes"), "KEY"),
        (("list", "--limit", "0"), "--limit"),
        (("list", "--limit", "NaN"), "--limit"),
        (("list", "--limit", "-1"), "--limit"),
        (("list", "--state", "done"), "--state"),
        (("list", "--after", "zz"), "--after"),
        (("list", "--after", "a" * 16), "--after"),
        (("list", "--after", f"1.5:{'a' * 63}"), "--after"),
        (("list", "--after", f"nan:{'a' * 64}"), "--after"),
        (("list", "--after", f"-1:{'a' * 64}"), "--after"),
        (("list", "--schema", "public"), "--schema"),
        (("list", "--schema", "no-such name"), "--schema"),
        (("list", "--prefix", "app:"), "--prefix"),
        (("list", "--prefix", "x" * (10 * 1024 * 1024)), "--prefix"),
        (("list", "--prefix", "a\nb"), "--prefix"),
    ],
    ids=lambda v: " ".join(a[:20] for a in v) if isinstance(v, tuple) else v,
)
def test_bad_input_is_exit_2_naming_the_option(
    sqlite_spec: Spec, args: tuple[str, ...], blamed: str
) -> None:
    """Each bad value or contradiction: exit 2, one line naming the option or argument, the
    store untouched (--schema and --prefix belong to PostgreSQL and Redis)."""
    before = Path(sqlite_spec.url[len("sqlite:///") :]).read_bytes()
    code, out, err = keys(*args, *sqlite_spec.args)
    assert code == 2 and out == ""
    assert one_error_line(err).startswith(f"retrysafe: error: {blamed}"), err
    assert Path(sqlite_spec.url[len("sqlite:///") :]).read_bytes() == before


@pytest.mark.parametrize("store", ["memory://", "foo://x", "sqlite:///{tmp}", "{tmp}/k.db"])
def test_a_store_that_cannot_hold_keys_is_exit_2(tmp_path: Path, store: str) -> None:
    """memory:// (its keys live in the process that opened it: the line says so), an unknown
    scheme, a directory, a bare path: exit 2 naming --store, nothing created."""
    for command in (("list",), ("show", "k"), ("evict", "k", "--yes")):
        code, _, err = keys(*command, "--store", store.format(tmp=tmp_path))
        assert code == 2
        assert one_error_line(err).startswith("retrysafe: error: --store: ")
        if store == "memory://":
            assert "inside the process that opened it" in err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_sqlite_file_is_refused_naming_migrate(tmp_path: Path) -> None:
    """No keys command creates a store: a SQLite file that does not exist is exit 2 with the
    `retrysafe migrate` hint, and is not created."""
    url = f"sqlite:///{tmp_path / 'absent.db'}"
    code, _, err = keys("list", "--store", url)
    assert code == 2 and "retrysafe migrate" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_a_version_1_store_names_migrate(sqlite_spec: Spec) -> None:
    """A store written before created_at existed (schema version 1): every keys command exits
    1 naming `retrysafe migrate`; after migrate, keys list works."""
    path = sqlite_spec.url[len("sqlite:///") :]
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("ALTER TABLE idempotency_keys DROP COLUMN created_at")
        conn.execute("UPDATE retrysafe_meta SET value = '1' WHERE name = 'schema_version'")
    conn.close()
    for command in (("list",), ("show", "k"), ("evict", "k", "--yes")):
        code, _, err = keys(*command, *sqlite_spec.args)
        assert code == 1 and "retrysafe migrate" in one_error_line(err), err
    assert CliRunner().invoke(cli, ["migrate", *sqlite_spec.args]).exit_code == 0
    assert keys("list", *sqlite_spec.args)[0] == 0


@pytest.mark.parametrize(
    "store",
    ["postgresql://postgres@127.0.0.1:1/test", "redis://127.0.0.1:1/0"],
    ids=["postgres", "redis"],
)
def test_evict_on_a_store_that_is_down_is_exit_1_in_one_line(store: str) -> None:
    """A store that cannot be reached: evict (and list, show) exit 1 with one line saying
    so; nothing could be changed."""
    for command in (("evict", "k", "--yes"), ("evict", "--hash", "ab", "--yes"), ("list",)):
        code, out, err = keys(*command, "--store", store)
        assert code == 1 and out == ""
        assert "unavailable" in one_error_line(err).lower()


# ---------------------------------------------------------------------- evict
def test_evict_of_a_running_key_needs_force(spec: Spec) -> None:
    """A running key is refused (exit 1, one line naming --force) and stays; with --force it
    is evicted, and the line says what eviction means."""
    h = seed(spec, "busy", completed=False)
    code, out, err = keys("evict", "busy", "--authorization", AUTH, *spec.args, "--yes")
    assert code == 1 and out == ""
    assert "is running" in one_error_line(err) and "--force" in err
    entry = stored(spec, h)
    assert entry is not None and (entry.state, entry.fencing_token) == ("running", 1)
    code, out, err = keys(
        "evict", "busy", "--authorization", AUTH, *spec.args, "--yes", "--force", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert (report["evicted"], report["state"], report["key_hash"]) == (True, "running", h)
    assert "runs the handler again" in report["message"]
    gone = stored(spec, h)
    assert gone is None or gone.state == "released"


def test_evict_without_yes_on_a_non_tty_stdin_refuses_at_once(
    spec: Spec, tmp_path: Path
) -> None:
    """stdin a pipe that never closes and no --yes: evict refuses (exit 2, naming --yes)
    instead of waiting for an answer, and the key stays."""
    h = seed(spec, "order-7")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "keys", "evict", "order-7", "--authorization", AUTH,
         *spec.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        code = proc.wait(timeout=60)  # stdin stays open: a prompt would wait forever
    finally:
        proc.kill()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.close()
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert code == 2 and out == b""
    assert "--yes" in one_error_line(err.decode())
    entry = stored(spec, h)
    assert entry is not None and entry.state == "completed"


def _evict_on_a_terminal(spec: Spec, answer: bytes, cwd: Path) -> tuple[int, str]:
    """Run `keys evict` with a pseudo-terminal as stdin, answering ``answer``; the exit code
    and everything it wrote."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "keys", "evict", "order-7", "--authorization", AUTH,
         *spec.args],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "NO_COLOR": "1"},
        cwd=cwd,
    )
    os.close(slave)
    os.write(master, answer)  # the terminal holds the line until the prompt reads it
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        while select.select([master], [], [], 0)[0]:
            try:
                if not os.read(master, 4096):
                    break
            except OSError:
                break
        os.close(master)
    return proc.returncode, out.decode()


def test_evict_asks_on_a_terminal_and_no_changes_nothing(spec: Spec, tmp_path: Path) -> None:
    """On a terminal evict says what eviction means and asks: "n" exits 1 with the key kept,
    "y" evicts it."""
    h = seed(spec, "order-7")
    code, out = _evict_on_a_terminal(spec, b"n\n", tmp_path)
    assert code == 1, out
    assert "the next request with this key runs the handler again" in out
    assert "Evict key" in out and "not evicted" in out
    entry = stored(spec, h)
    assert entry is not None and entry.state == "completed"
    code, out = _evict_on_a_terminal(spec, b"y\n", tmp_path)
    assert code == 0, out
    assert "evicted key" in out
    gone = stored(spec, h)
    assert gone is None or gone.state == "released"


def test_evict_of_a_released_key_says_there_is_nothing_to_evict(sqlite_spec: Spec) -> None:
    """A tombstone (released after a 5xx, or evicted before) is found by its hash; evicting
    it again changes nothing and says the next request runs the handler anyway."""
    h = seed(sqlite_spec, "k1")
    assert keys("evict", "--hash", h, *sqlite_spec.args, "--yes")[0] == 0
    code, out, err = keys("evict", "--hash", h, *sqlite_spec.args, "--yes", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["evicted"], report["state"]) == (False, "released")


# ---------------------------------------------------------------------- list
def test_list_is_newest_first_with_filters_a_limit_and_pages(spec: Spec) -> None:
    """keys list --json: newest claim first; --state filters; --limit gives a page and the
    hash to continue --after; the next page holds the rest."""
    old = seed(spec, "old")
    running = seed(spec, "running", completed=False)
    code, out, err = keys("list", *spec.args, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [k["key_hash"] for k in listed["keys"]] == [running, old] and listed["next"] is None
    assert [k["next_attempt"] for k in listed["keys"]] == ["in-progress", "replay"]
    assert all("body" not in k for k in listed["keys"])
    code, out, err = keys("list", *spec.args, "--json", "--state", "completed")
    assert [k["key_hash"] for k in json.loads(out)["keys"]] == [old]
    code, out, err = keys("list", *spec.args, "--json", "--limit", "1")
    page = json.loads(out)
    assert [k["key_hash"] for k in page["keys"]] == [running]
    assert page["next"] == f"{page['keys'][0]['created_at']!r}:{running}"
    code, out, err = keys("list", *spec.args, "--json", "--limit", "1", "--after", page["next"])
    assert code == 0, err
    assert [k["key_hash"] for k in json.loads(out)["keys"]] == [old]


def test_list_table_shows_hashes_never_keys(sqlite_spec: Spec) -> None:
    """The table names each key by the start of its hash, with its state and next attempt."""
    h = seed(sqlite_spec, "order-7")
    code, out, err = keys("list", *sqlite_spec.args)
    assert code == 0, err
    assert h[:16] in out and "completed" in out and "replay" in out and "order-7" not in out


@pytest.mark.parametrize(
    "command", [("list",), ("show", "order-7"), ("evict", "order-7", "--yes")], ids=" ".join
)
def test_every_subcommand_reports_json(sqlite_spec: Spec, command: tuple[str, ...]) -> None:
    """--json on list, show and evict prints one JSON object on stdout, nothing else."""
    seed(sqlite_spec, "order-7")
    scope = () if command == ("list",) else ("--authorization", AUTH)
    code, out, err = keys(*command, *scope, *sqlite_spec.args, "--json")
    assert code == 0 and err == "", err
    assert out.count("\n") == 1 and isinstance(json.loads(out), dict)


@pytest.mark.parametrize("path", [(), ("list",), ("show",), ("evict",)], ids=" ".join)
def test_every_keys_help_states_the_exit_statuses(path: tuple[str, ...]) -> None:
    """`retrysafe keys … --help` ends with the exit statuses of docs/cli.md; evict's says
    what eviction means."""
    result = CliRunner().invoke(cli, ["keys", *path, "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and EXIT_STATUS in text
    if path == ("evict",):
        assert "the next request with it runs the handler again" in text and "--force" in text


# ---------------------------------------------------------------------- end to end
@pytest.fixture
def served(spec: Spec) -> Iterator[tuple[str, Any]]:
    """A real app behind the ASGI middleware on ``spec``'s store, on a loopback port: its URL
    and the effects its handler performed (a counter)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    effects = {"posts": 0}

    async def posts(request: Request) -> JSONResponse:
        effects["posts"] += 1
        return JSONResponse(
            {"n": effects["posts"], "body": (await request.body()).decode()},
            status_code=201,
            headers={"Location": f"/posts/{effects['posts']}"},
        )

    store = spec.open()
    app = Starlette(
        routes=[Route("/posts", posts, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    try:
        with ServerThread(app) as server:
            yield server.url, effects
    finally:
        store.close()


def test_end_to_end_evicting_a_completed_key_runs_the_handler_again(
    spec: Spec, served: tuple[str, Any]
) -> None:
    """A request with a key runs the handler; its repeat is replayed; `keys show` shows the
    stored 201; `keys evict` forgets it; the same request then runs the handler again
    (effect counter 2) and is stored again."""
    url, effects = served
    headers = {"Idempotency-Key": "post-1", "Authorization": AUTH}
    with httpx.Client(base_url=url, timeout=15) as client:
        first = client.post("/posts", json={"text": "hello"}, headers=headers)
        again = client.post("/posts", json={"text": "hello"}, headers=headers)
        assert (first.status_code, again.status_code) == (201, 201)
        assert again.headers["idempotent-replayed"] == "true" and effects["posts"] == 1

        code, out, err = keys("show", "post-1", "--authorization", AUTH, *spec.args, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert (shown["state"], shown["status"], shown["next_attempt"]) == (
            "completed",
            201,
            "replay",
        )
        assert ["location", "/posts/1"] in shown["headers"]
        assert shown["body_size"] == len(first.content)

        code, out, err = keys("evict", "post-1", "--authorization", AUTH, *spec.args, "--yes")
        assert code == 0, err
        assert "runs the handler again" in out

        third = client.post("/posts", json={"text": "hello"}, headers=headers)
        assert third.status_code == 201 and "idempotent-replayed" not in third.headers
        assert effects["posts"] == 2 and third.json()["n"] == 2
        code, out, err = keys("show", "post-1", "--authorization", AUTH, *spec.args, "--json")
        assert code == 0 and json.loads(out)["fencing_token"] > shown["fencing_token"], err


def test_end_to_end_a_non_ascii_authorization_is_hashed_as_the_middleware_hashes_it(
    spec: Spec, served: tuple[str, Any]
) -> None:
    """An Authorization value sent as UTF-8 bytes (read by the middleware as latin-1) is
    found by `keys show --authorization` given the same text in a UTF-8 terminal."""
    url, effects = served
    auth = "Bearer caf\u00e9-\u2603"
    headers = {b"Idempotency-Key": b"post-2", b"Authorization": auth.encode()}
    with httpx.Client(base_url=url, timeout=15) as client:
        assert client.post("/posts", content=b"{}", headers=headers).status_code == 201
    assert effects["posts"] == 1
    code, out, err = keys("show", "post-2", "--authorization", auth, *spec.args, "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == "completed"


# ---------------------------------------------------------------------- a fresh user's findings
def _terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``retrysafe ARGS`` with a pseudo-terminal as stdout (and stdin); the exit code and
    everything it wrote, as the terminal received it."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"},
        cwd=cwd,
    )
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end (EIO on Linux)
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", "replace")


HOSTILE = StoredResponse(
    200,
    (
        ("location", "/items?filter[/status]=open"),
        ("content-type", "text/[bold]x[/]"),
        ("x-note", "a\x1b[31mred\x1b[0m"),
    ),
    b'{"t": "\x1b]0;pwned\x07\x1b[31mred\x1b[0m"}\n',
)


def test_show_prints_stored_text_literally_never_as_rich_markup(sqlite_spec: Spec) -> None:
    """Stored header values are data: `[/status]` does not crash the table (MarkupError),
    `[bold]x[/]` is not eaten, and a control character is shown escaped, not sent."""
    seed(sqlite_spec, "k1", response=HOSTILE)
    code, out, err = keys("show", "k1", "--authorization", AUTH, *sqlite_spec.args)
    assert code == 0, err
    assert "/items?filter[/status]=open" in out and "text/[bold]x[/]" in out
    assert "a\\x1b[31mred\\x1b[0m" in out and "\x1b" not in out


def test_show_body_to_a_pipe_is_the_stored_bytes(sqlite_spec: Spec) -> None:
    """Not on a terminal, --body writes the body exactly as stored, control characters and
    all (nothing silently stripped); --json keeps it too."""
    seed(sqlite_spec, "k1", response=HOSTILE)
    args = ("show", "k1", "--authorization", AUTH, *sqlite_spec.args)
    result = CliRunner().invoke(cli, ["keys", *args, "--body"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.stderr
    assert result.stdout_bytes.endswith(HOSTILE.body)
    code, out, err = keys(*args, "--body", "--json")
    assert code == 0 and json.loads(out)["body"].encode() == HOSTILE.body, err


def test_show_body_on_a_terminal_shows_control_characters_escaped(
    sqlite_spec: Spec, tmp_path: Path
) -> None:
    """On a terminal a stored ESC ]0;… BEL (a title change) and colour codes are printed as
    visible escapes, never sent, and a line says so."""
    seed(sqlite_spec, "k1", response=HOSTILE)
    code, out = _terminal(
        ["keys", "show", "k1", "--authorization", AUTH, *sqlite_spec.args, "--body"], tmp_path
    )
    assert code == 0, out
    assert "\x1b]0;pwned" not in out and "\x07" not in out and "\x1b[31m" not in out
    assert '{"t": "\\x1b]0;pwned\\x07\\x1b[31mred\\x1b[0m"}' in out
    assert "control characters shown escaped" in out


def test_evicting_an_evicted_key_again_is_released_already(spec: Spec) -> None:
    """On every store (Redis too) a second evict of a key evicted moments ago, named by KEY,
    finds it released: exit 0, "released already", nothing evicted, no blame on the scope."""
    h = seed(spec, "order-7")
    evict = ("evict", "order-7", "--authorization", AUTH, *spec.args, "--yes")
    assert keys(*evict)[0] == 0
    code, out, err = keys(*evict)
    assert code == 0 and err == "", err
    assert "released already" in out and "nothing to evict" in out
    code, out, err = keys(*evict, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["evicted"], report["state"], report["key_hash"]) == (False, "released", h)
    code, out, err = keys("show", "--hash", h, *spec.args, "--json")
    assert code == 0 and json.loads(out)["state"] == "released", err


def test_the_loser_of_two_concurrent_evicts_exits_0(
    spec: Spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two evictors read the same record; the other one evicts it first (between this one's
    read and its evict): this one says released already and exits 0, it does not fail."""
    h = seed(spec, "order-7")
    with spec.open() as probe:
        cls = type(probe)
    original = cls.evict

    def the_other_evictor_first(self: Any, key_hash: str, fencing_token: int) -> bool:
        with spec.open() as other:
            assert original(other, key_hash, fencing_token)
        return bool(original(self, key_hash, fencing_token))

    monkeypatch.setattr(cls, "evict", the_other_evictor_first)
    code, out, err = keys("evict", "--hash", h, *spec.args, "--yes", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["evicted"], report["state"]) == (False, "released")
    assert "released already" in report["message"]


def test_a_page_continues_after_a_key_that_was_purged_since(spec: Spec) -> None:
    """The `next` cursor holds the place in the order, not the key: when the last key of a
    page is purged before the next page is asked for, --after still gives the rest."""
    old = seed(spec, "old", ago=300)
    gone = seed(spec, "gone", ago=200, retention=100)  # its retention ended 100 s ago
    new = seed(spec, "new")
    code, out, err = keys("list", *spec.args, "--json", "--limit", "2")
    assert code == 0, err
    page = json.loads(out)
    assert [k["key_hash"] for k in page["keys"]] == [new, gone] and page["next"]
    with spec.open_on_our_clock() as store:
        assert store.purge_keys(now=time.time()) >= 1
    assert stored(spec, gone) is None
    code, out, err = keys("list", *spec.args, "--json", "--after", page["next"])
    assert code == 0, err
    assert [k["key_hash"] for k in json.loads(out)["keys"]] == [old]


def test_the_table_says_how_to_continue_with_a_cursor(sqlite_spec: Spec) -> None:
    """The table's last line names the --after cursor, and passing it gives the next page."""
    first, second = seed(sqlite_spec, "a", ago=10), seed(sqlite_spec, "b")
    code, out, err = keys("list", *sqlite_spec.args, "--limit", "1")
    assert code == 0, err
    line = out.strip().splitlines()[-1]
    assert line.startswith("more keys: continue with --after ") and second in line
    cursor = line.rsplit(" ", 1)[1]
    code, out, err = keys("list", *sqlite_spec.args, "--json", "--after", cursor)
    assert code == 0 and [k["key_hash"] for k in json.loads(out)["keys"]] == [first], err


def test_a_malformed_cursor_says_what_a_cursor_is(sqlite_spec: Spec) -> None:
    """A key hash (the old form) or anything else where a cursor belongs: exit 2 naming
    --after and the CREATED:HASH form."""
    code, _, err = keys("list", *sqlite_spec.args, "--after", "ab" * 32)
    assert code == 2
    line = one_error_line(err)
    assert line.startswith("retrysafe: error: --after: ") and "CREATED:HASH" in line


def test_the_store_namespace_is_named_in_titles_json_and_not_found_lines(spec: Spec) -> None:
    """A wrong Redis --prefix or PostgreSQL --schema finds nothing, so every output names the
    one used: the list title, the JSON fields, and the not-found line points at the option."""
    seed(spec, "order-7")
    namespace = {"postgres": "schema", "redis": "prefix"}.get(spec.kind)
    code, table, err = keys("list", *spec.args)
    assert code == 0, err
    code, out, err = keys("list", *spec.args, "--json")
    listed = json.loads(out)
    code, _, missing = keys("show", "nope", *spec.args)
    code_hash, _, missing_hash = keys("show", "--hash", "0" * 64, *spec.args)
    assert (code, code_hash) == (1, 1)
    if namespace is None:
        assert set(listed) == {"store", "keys", "next"}
        assert "--schema" not in missing + missing_hash and "--prefix" not in missing
        return
    value = spec.args[spec.args.index(f"--{namespace}") + 1]
    assert f"({namespace} {value!r})" in table
    assert listed[namespace] == value and listed["store"] == spec.url
    for line in (missing, missing_hash):
        assert f"--{namespace}" in one_error_line(line) and repr(value) in line
    assert "scope" not in missing_hash


def test_an_empty_list_hints_at_the_namespace(spec: Spec) -> None:
    """An empty listing on PostgreSQL or Redis says which schema or prefix it looked in and
    which option changes it."""
    code, out, err = keys("list", *spec.args)
    assert code == 0, err
    if spec.kind == "sqlite":
        assert "--prefix" not in out and "--schema" not in out
    else:
        option = "--schema" if spec.kind == "postgres" else "--prefix"
        assert out.strip().splitlines()[-1].startswith("no keys in ") and option in out


def test_evict_of_a_running_key_whose_lease_ended_needs_no_force(spec: Spec) -> None:
    """A running key whose lease ended (its process died: the next attempt takes it over)
    is held by no live handler: evict forgets it without --force, and says so."""
    h = seed(spec, "stuck", completed=False, ago=120, lease=30)
    code, out, err = keys("show", "--hash", h, *spec.args, "--json")
    assert code == 0 and json.loads(out)["next_attempt"] == "take-over", err
    code, out, err = keys("evict", "--hash", h, *spec.args, "--yes", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["evicted"], report["state"]) == (True, "running")
    assert "lease had ended" in report["message"]
    gone = stored(spec, h)
    assert gone is None or gone.state == "released"


def test_evict_help_says_what_force_does_to_the_running_request() -> None:
    """evict --help says exactly what --force means for a request still running: its client
    gets 409 request-in-progress, and the next request runs the handler again."""
    result = CliRunner().invoke(cli, ["keys", "evict", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    assert "409 request-in-progress" in text and "runs the handler again" in text
    assert "whose lease ended" in text


def test_after_a_forced_evict_the_running_request_gets_409_and_a_retry_runs_again(
    sqlite_spec: Spec,
) -> None:
    """What evict --help says of --force, end to end: the request whose handler was running
    gets 409 request-in-progress when it finishes, and its retry runs the handler again."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import anyio
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    started, finish = threading.Event(), threading.Event()
    effects = {"posts": 0}

    async def posts(request: Request) -> JSONResponse:
        effects["posts"] += 1
        started.set()
        await anyio.to_thread.run_sync(finish.wait, 30)
        return JSONResponse({"n": effects["posts"]}, status_code=201)

    store = sqlite_spec.open()
    app = Starlette(
        routes=[Route("/posts", posts, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    headers = {"Idempotency-Key": "slow-1", "Authorization": AUTH}
    try:
        with (
            ServerThread(app) as server,
            ThreadPoolExecutor(1) as pool,
            httpx.Client(base_url=server.url, timeout=30) as client,
        ):
            first = pool.submit(client.post, "/posts", json={}, headers=headers)
            assert started.wait(30)
            code, out, err = keys(
                "evict", "slow-1", "--authorization", AUTH, *sqlite_spec.args, "--yes", "--force"
            )
            assert code == 0 and "409 request-in-progress" in out, err
            finish.set()
            answer = first.result(timeout=30)
            assert answer.status_code == 409
            assert answer.json()["type"].endswith("request-in-progress")
            retry = client.post("/posts", json={}, headers=headers)
            assert retry.status_code == 201 and effects["posts"] == 2
    finally:
        finish.set()
        store.close()


_STOP_POSTGRES_DURING_EVICT = """
import sys

import psycopg

from retrysafe.cli import main
from retrysafe.stores._postgres import PostgresStore

admin_url, app_name = sys.argv[1], sys.argv[2]
evict = PostgresStore.evict


def stopped_during_evict(self, *args, **kwargs):
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (app_name,),
        )
    return evict(self, *args, **kwargs)


PostgresStore.evict = stopped_during_evict
main(sys.argv[3:])
"""


def test_postgres_stopping_during_evict_prints_one_line(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """The server closes every connection of the store while evict runs: stderr holds one
    error line, no psycopg pool log lines before or after it, and exit 1."""
    import uuid

    name = f"rs-test-{uuid.uuid4().hex[:12]}"
    url = f"{pg_url}?application_name={name}"
    spec = Spec("postgres", url, ["--store", url, "--schema", pg_schema], {"schema": pg_schema})
    open_store(url, schema=pg_schema).close()
    h = seed(spec, "order-7")
    proc = subprocess.run(
        [sys.executable, "-c", _STOP_POSTGRES_DURING_EVICT, pg_url, name,
         "keys", "evict", "--hash", h, *spec.args, "--yes"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    assert "unavailable" in one_error_line(proc.stderr)


def test_an_unmigrated_store_names_the_real_migrate_command(
    sqlite_spec: Spec, pg_url: str, pg_schema: str
) -> None:
    """A store without (current) tables: the line gives the `retrysafe migrate` command to
    run for this store — its URL without the password, its --schema — and no Python advice;
    the PostgreSQL store is named as the list title names it."""
    path = sqlite_spec.url[len("sqlite:///") :]
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("ALTER TABLE idempotency_keys DROP COLUMN created_at")
        conn.execute("UPDATE retrysafe_meta SET value = '1' WHERE name = 'schema_version'")
    conn.close()
    code, _, err = keys("list", *sqlite_spec.args)
    assert code == 1
    line = one_error_line(err)
    assert f"`retrysafe migrate --store {sqlite_spec.url}`" in line
    assert "create=True" not in line and "--store URL" not in line
    secret = pg_url.replace("postgres@", "postgres:s3cret@", 1)
    shown = secret.replace(":s3cret@", ":***@")
    code, _, err = keys("list", "--store", secret, "--schema", pg_schema)
    assert code == 1
    line = one_error_line(err)
    assert line.startswith(f"retrysafe: error: {shown} (schema {pg_schema!r}) has ")
    assert f"`retrysafe migrate --store '{shown}' --schema {pg_schema}`" in line
    assert "s3cret" not in line and "create=True" not in line


@pytest.mark.parametrize("path", ["/abc", "/0/extra", "/1x", "/-1"])
def test_a_redis_url_whose_path_is_not_a_database_number_is_exit_2(path: str) -> None:
    """redis://host:port/abc or /0/extra would silently be database 0: refused (exit 2,
    naming --store) before anything is opened."""
    for command in (("list",), ("show", "k"), ("evict", "k", "--yes")):
        code, out, err = keys(*command, "--store", f"redis://127.0.0.1:6379{path}")
        assert code == 2 and out == ""
        line = one_error_line(err)
        assert line.startswith("retrysafe: error: --store: ") and "database number" in line


def test_the_authorization_is_stripped_of_surrounding_whitespace(sqlite_spec: Spec) -> None:
    """HTTP drops the spaces and tabs around a field value, so the middleware hashes
    `Bearer …` for a header sent as ` Bearer … `: --authorization finds the key the same."""
    h = seed(sqlite_spec, "k1")
    code, out, err = keys(
        "show", "k1", "--authorization", f" \t{AUTH}\t ", *sqlite_spec.args, "--json"
    )
    assert code == 0, err
    assert json.loads(out)["key_hash"] == h


def test_an_ambiguous_hash_prefix_names_every_match(sqlite_spec: Spec) -> None:
    """Three keys whose hashes share a first digit: the line names all three, as the docs
    say, not two "and maybe more"."""
    by_digit: dict[str, list[str]] = {}
    i = 0
    while not any(len(v) == 3 for v in by_digit.values()):
        by_digit.setdefault(hash_of(f"k{i}")[0], []).append(f"k{i}")
        i += 1
    digit, names = next((d, v) for d, v in by_digit.items() if len(v) == 3)
    hashes = [seed(sqlite_spec, name) for name in names]
    code, _, err = keys("show", "--hash", digit, *sqlite_spec.args)
    assert code == 1
    line = one_error_line(err)
    assert "matches 3 keys" in line and all(h[:16] in line for h in hashes)
    assert "maybe more" not in line


def test_times_carry_their_utc_offset(sqlite_spec: Spec) -> None:
    """Created and expiry times in the tables say which zone they are in (an offset)."""
    import re

    seed(sqlite_spec, "k1")
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d:\d\d")
    for args in (("list",), ("show", "k1", "--authorization", AUTH)):
        code, out, err = keys(*args, *sqlite_spec.args)
        assert code == 0, err
        assert len(stamp.findall(out)) >= 2, out


def test_a_released_key_shows_no_replayable_and_no_lease(sqlite_spec: Spec) -> None:
    """A released key has no answer: its replayable row is "-", and JSON gives null for
    replayable and for the lease that no longer means anything."""
    h = seed(sqlite_spec, "k1")
    assert keys("evict", "--hash", h, *sqlite_spec.args, "--yes")[0] == 0
    code, out, err = keys("show", "--hash", h, *sqlite_spec.args)
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if "replayable" in line]
    assert "yes" not in row and "-" in row
    shown = json.loads(keys("show", "--hash", h, *sqlite_spec.args, "--json")[1])
    assert (shown["state"], shown["replayable"], shown["lease_expires_at"]) == (
        "released",
        None,
        None,
    )


def test_small_messages_count_right(sqlite_spec: Spec) -> None:
    """A bad --hash names the 16 digits `keys list` shows; a 5000-character --prefix is
    reported as 5000 characters."""
    code, _, err = keys("show", "--hash", "xyz", *sqlite_spec.args)
    assert code == 2 and "the first 16 that `keys list` shows" in err
    code, _, err = keys("list", "--prefix", "x" * 5000, *sqlite_spec.args)
    assert code == 2 and "(5000 characters)" in one_error_line(err)


@pytest.mark.parametrize("command", ["show", "evict", "list"])
def test_help_epilogs_read_as_one_sentence(command: str) -> None:
    """The exit statuses of show and evict say what 1 means for them without a stray
    "; (" after the convention's text."""
    result = CliRunner().invoke(cli, ["keys", command, "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and EXIT_STATUS in text and "; (" not in text


def test_retrysafe_schema_in_the_environment_is_ignored_for_a_redis_store(
    redis_url: str, redis_prefix: str
) -> None:
    """RETRYSAFE_SCHEMA exported for the outbox commands does not stop `keys` (or the
    gateway) on a Redis store; an explicit --schema there is still exit 2."""
    result = CliRunner().invoke(
        cli,
        ["keys", "list", "--store", redis_url, "--prefix", redis_prefix, "--json"],
        env={"RETRYSAFE_SCHEMA": "app"},
    )
    assert result.exit_code == 0, result.stderr
    code, _, err = keys("list", "--store", redis_url, "--prefix", redis_prefix, "--schema", "app")
    assert code == 2 and "only a postgresql:// store has a schema" in one_error_line(err)
