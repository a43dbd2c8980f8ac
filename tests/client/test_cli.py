"""The outbox commands: `jobs`, `worker`, `reconcile`, `dlq` (JSON output, exit codes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrysafe import JobState, Outbox, RetryPolicy
from retrysafe.cli import cli

from .conftest import Script, Step


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_show_json_gives_a_body_that_is_no_utf8_exactly(tmp_path: Path) -> None:
    """`jobs show --json`: a UTF-8 body is ``body``; one that is no UTF-8 (submitted from
    Python) is ``body`` with U+FFFD and ``body_base64``, its exact bytes (it was only the
    text: the bytes could not be got back; a fresh user's check), in the row or, over
    3.5 KiB, in outbox_bodies."""
    import base64

    from retrysafe import Outbox

    store = f"sqlite:///{tmp_path / 's.db'}"
    raw, large = b"\xff\xfe{\x00}", b"\x80" * 5000
    with Outbox(store) as outbox:
        ids = [outbox.submit("http://127.0.0.1:9/x", content=c).id for c in (raw, large)]
        text = outbox.submit("http://127.0.0.1:9/x", json={"a": "é"}).id
    for job_id, body in zip(ids, (raw, large), strict=True):
        code, out, err = _run("jobs", "show", job_id, "--store", store, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert base64.b64decode(shown["body_base64"]) == body and "\ufffd" in shown["body"]
    code, out, _ = _run("jobs", "show", text, "--store", store, "--json")
    shown = json.loads(out)
    assert json.loads(shown["body"]) == {"a": "é"} and "body_base64" not in shown


def _default_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _signal_mid_attempt(
    script: Script, args: list[str], sig: signal.Signals
) -> tuple[int, str, str]:
    """Run ``retrysafe ARGS`` in a child process, send it ``sig`` once the endpoint has
    received a request, and return its exit code, stdout and stderr. The child starts with
    SIGHUP at its default (a test run under ``nohup`` passes it on ignored)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_hangup,
    )
    try:
        assert script.started.wait(30)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def _migrate(store: str) -> None:
    """Create the store, as docs/cli.md says to before the first command."""
    code, _, err = _run("migrate", "--store", store)
    assert code == 0, err


def test_submit_worker_show_and_list_round_trip(
    sql_store_url: str, script: Script, base_url: str
) -> None:
    """submit → worker --until-idle → show/list report the job SUCCEEDED with its attempt,
    sent with its key (``--store sqlite:///…`` and ``--store postgresql://…``)."""
    store = sql_store_url
    script.plan("/cli", Step(201))
    _migrate(store)
    code, out, err = _run(
        "jobs", "submit", base_url + "/cli", "-d", '{"a": 1}', "--store", store, "--json"
    )
    assert code == 0, err
    job = json.loads(out)
    code, out, err = _run(
        "worker", "--store", store, "--until-idle", "--wait-initial", "0.01", "--json"
    )
    assert code == 0 and json.loads(out.splitlines()[-1])["succeeded"] == 1, err
    code, out, _ = _run("jobs", "show", job["id"][:10], "--store", store, "--json")
    shown = json.loads(out)
    assert shown["state"] == "succeeded" and shown["attempt_log"][0]["status"] == 201
    code, out, _ = _run("jobs", "list", "--store", store, "--json")
    assert json.loads(out)["counts"]["succeeded"] == 1
    code, out, _ = _run("jobs", "list", "--store", store)
    assert code == 0 and job["id"][:12] in out
    assert [s.key for s in script.requests("/cli")] == [job["key"]]


def test_dlq_list_replay_and_purge(sqlite_path: Path, script: Script, base_url: str) -> None:
    """An exhausted job shows in `dlq list`; reconcile leaves it UNKNOWN (exit 1); replay
    makes it PENDING; purge removes it."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/dlq", Step(503))
    _migrate(store)
    _run("jobs", "submit", base_url + "/dlq", "--store", store)
    _run("worker", "--store", store, "--until-idle", "--attempts", "1", "--json")
    code, out, _ = _run("dlq", "list", "--store", store, "--json")
    [dead] = json.loads(out)
    assert dead["state"] == "unknown" and len(dead["attempt_log"]) == 1
    code, out, err = _run("reconcile", "--store", store, "--json")
    assert code == 1 and json.loads(out)["unknown"] == 1
    assert err == (
        "retrysafe: error: jobs still UNKNOWN: 1 (run `retrysafe reconcile` again once "
        "their destination answers)\n"
    )
    code, out, err = _run("dlq", "replay", dead["id"], "--all", "--store", store)
    assert code == 2 and "not both" in err  # which was meant? nothing replayed
    code, out, _ = _run("dlq", "list", "--store", store, "--json")
    assert [d["state"] for d in json.loads(out)] == ["unknown"]
    code, out, _ = _run("dlq", "replay", dead["id"], "--store", store, "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "pending"
    code, out, _ = _run("jobs", "cancel", dead["id"], "--store", store)
    assert code == 0
    code, out, _ = _run("dlq", "purge", "--store", store, "--state", "unknown", "--yes")
    assert code == 0 and "purged 0" in out


def test_failures_are_one_line_and_exit_1(sqlite_path: Path) -> None:
    """An operation that fails on an existing store (unknown job ids) is one
    `retrysafe: error:` line and exit 1."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    for args in (
        ("jobs", "show", "deadbeef", "--store", store),
        ("jobs", "cancel", "deadbeef", "--store", store),
        ("jobs", "retry", "deadbeef", "--store", store),
        ("dlq", "replay", "deadbeef", "--store", store),
        ("reconcile", "deadbeef", "--store", store),
    ):
        code, out, err = _run(*args)
        assert code == 1, args
        assert err.startswith("retrysafe: error: no job ") and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err + out



def test_a_submit_whose_answer_is_lost_tells_the_key_to_run_it_again_with(
    sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`jobs submit` whose write got no answer (the store may have committed it) is one line,
    exit 1, naming the ``--key`` to run the command again with: without it, a second run
    records the job again under a fresh key (tests/stores/test_postgres_recovery.py makes
    the store lose that answer for real). On SQLite, where a write that raised was not
    committed, the error is the store's own."""
    from retrysafe import StoreUnavailableError
    from retrysafe.client._store import SQLOutboxStore
    from retrysafe.stores._sqlite import SQLiteConnector

    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()

    def lost(self: object, job: object, **kw: object) -> object:
        raise StoreUnavailableError("no answer within 15 s", store=store)

    monkeypatch.setattr(SQLOutboxStore, "insert_job", lost)
    code, out, err = _run("jobs", "submit", "http://example.test/x", "--store", store)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "may have been" not in err  # SQLite: a write that raised was not committed
    # A server's store, whose write may have committed before its answer was lost:
    monkeypatch.setattr(SQLiteConnector, "may_have_written", lambda self, exc: True)
    code, out, err = _run("jobs", "submit", "http://example.test/x", "--store", store)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("retrysafe: error: no answer within 15 s; it may have been recorded")
    key = err.split("--key ", 1)[1].split(" ", 1)[0]
    monkeypatch.undo()
    code, out, _ = _run("jobs", "submit", "http://example.test/x", "--store", store, "--key", key)
    assert code == 0 and f"key={key}" in out


def test_a_failed_command_keeps_the_drivers_log_lines_off_stderr(sqlite_path: Path) -> None:
    """What psycopg's pool logs as it drops a broken connection stays off stderr, where the
    command's one error line says what failed (a fresh user's `jobs submit` on PostgreSQL
    printed the pool's line above it; only the `keys` commands kept them off)."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    code = (
        "import logging, sys\n"
        "from retrysafe import StoreUnavailableError, cli\n"
        "from retrysafe.client._store import SQLOutboxStore\n"
        "def lost(self, job, **kw):\n"
        "    logging.getLogger('psycopg.pool').warning('discarding closed connection: <BAD>')\n"
        "    raise StoreUnavailableError('no answer within 15 s')\n"
        "SQLOutboxStore.insert_job = lost\n"
        "cli.main(sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "jobs", "submit", "http://example.test/x", "--store", store],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.splitlines() == ["retrysafe: error: no answer within 15 s"], out.stderr

def test_bad_input_is_one_line_naming_the_option_and_exits_2(
    sqlite_path: Path, tmp_path: Path
) -> None:
    """A URL that is not http(s), a store in a missing directory: one `retrysafe: error:`
    line naming the option, exit 2, nothing created or recorded."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    missing = f"sqlite:///{tmp_path}/missing/x.db"
    for args, option in (
        (("jobs", "submit", "ftp://example.test/x", "--store", store), "URL: "),
        (("worker", "--store", missing), "--store: "),
        (("jobs", "list", "--store", missing), "--store: "),
    ):
        code, out, err = _run(*args)
        assert code == 2, args
        assert err.startswith(f"retrysafe: error: {option}") and len(err.splitlines()) == 1
        assert "Traceback" not in err + out
    assert not (tmp_path / "missing").exists()
    with Outbox(store) as outbox:
        assert outbox.jobs() == []


def test_ambiguous_job_id_prefix_lists_candidates(sqlite_path: Path) -> None:
    """`jobs show <prefix>` matching several jobs says it is ambiguous and names candidates."""
    store = f"sqlite:///{sqlite_path}"
    with Outbox(store) as outbox:  # 17 ids: two share a first hex digit
        ids = [outbox.submit("http://example.test/x", json={"i": i}).id for i in range(17)]
    prefix = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) > 1)
    code, _, err = _run("jobs", "show", prefix, "--store", store)
    assert code == 1 and "ambiguous" in err
    named = [i for i in ids if i in err]
    assert len(named) >= 2 and all(i.startswith(prefix) for i in named)


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "list", "--limit", "-5"),
        ("dlq", "list", "--limit", "-5"),
        ("reconcile", "-c", "0"),
        ("reconcile", "--limit", "0"),
        ("worker", "-c", "0"),
        ("jobs", "submit", "http://example.test/x", "--deadline", "-1"),
    ],
)
def test_negative_or_zero_numbers_are_usage_errors(
    sqlite_path: Path, args: tuple[str, ...]
) -> None:
    """Negative limits, zero concurrency, a negative deadline: exit 2, nothing done."""
    store = f"sqlite:///{sqlite_path}"
    with Outbox(store):
        pass
    code, _, err = _run(*args, "--store", store)
    assert code == 2 and "range" in err


def test_purge_with_a_negative_age_deletes_nothing(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """`dlq purge --older-than -5 --yes` is a usage error and keeps the dead letters."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/dead", Step(400))
    with Outbox(store, policy=RetryPolicy(attempts=1, wait_initial=0.01)) as outbox:
        job = outbox.submit(base_url + "/dead", json={})
        outbox.worker().run_until_idle()
        code, _, _ = _run("dlq", "purge", "--older-than", "-5", "--yes", "--store", store)
        assert code == 2
        assert outbox.get(job.id).state is JobState.REJECTED


def test_idempotency_key_header_points_to_the_key_option(sqlite_path: Path) -> None:
    """`jobs submit -H 'Idempotency-Key: x'` says to use --key; nothing is stored."""
    store = f"sqlite:///{sqlite_path}"
    code, _, err = _run(
        "jobs", "submit", "http://example.test/x", "-H", "Idempotency-Key: x", "--store", store
    )
    assert code == 2 and "--key" in err and "key=" not in err
    assert not sqlite_path.exists()


@pytest.mark.parametrize(
    "headers",
    [("Content-Type: a/b", "Content-Type: c/d"), ("X-A: 1", "x-a: 2")],
)
def test_a_header_given_twice_is_refused_not_replaced(
    sqlite_path: Path, headers: tuple[str, str]
) -> None:
    """`-H` twice with one name (any letter case): the second silently replaced the first
    (curl sends both); now one clear error, exit 2, nothing stored."""
    store = f"sqlite:///{sqlite_path}"
    _migrate(store)
    args = ["jobs", "submit", "http://example.test/x", "--store", store]
    code, out, err = _run(*args, "-H", headers[0], "-H", headers[1])
    assert code == 2 and "given twice" in err and out == ""
    assert len(err.strip().splitlines()) == 1
    with Outbox(store) as outbox:
        assert outbox.jobs() == []


def test_retrysafe_warning_is_one_line(sqlite_path: Path) -> None:
    """A RetrysafeWarning prints as `retrysafe: warning: …`, without source path or code."""
    store = f"sqlite:///{sqlite_path}"
    _migrate(store)
    code, _, err = _run(
        "worker", "--store", store, "--lease", "1.5", "--heartbeat", "1", "--until-idle", "--json"
    )
    assert code == 0
    [line] = [x for x in err.splitlines() if "lease" in x]
    assert line.startswith("retrysafe: warning: heartbeat (1 s)")
    assert ".py" not in err and "warnings.warn" not in err


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--lease", "0"), "--lease"),
        (("--heartbeat", "-1"), "--heartbeat"),
        (("--max-run-time", "0"), "--max-run-time"),
        (("--lease", "nan"), "--lease"),
        (("--heartbeat", "inf"), "--heartbeat"),
        (("--max-run-time", "1e12"), "--max-run-time"),
        (("--lease", "1e9"), "--lease"),
        (("--lease", "5", "--heartbeat", "5"), "--heartbeat"),
        (("--heartbeat", "20"), "--heartbeat"),
        (("--timeout", "nan"), "--timeout"),
        (("--timeout", "inf"), "--timeout"),
        (("--timeout", "0"), "--timeout"),
    ],
)
def test_bad_lease_timing_flags_exit_2_and_create_no_store(
    sqlite_path: Path, args: tuple[str, ...], option: str
) -> None:
    """worker --lease/--heartbeat/--max-run-time/--timeout zero, negative, NaN, inf, huge, or
    a heartbeat not shorter than the lease: exit 2 naming the flag, no store file created."""
    code, _, err = _run("worker", "--store", f"sqlite:///{sqlite_path}", "--until-idle", *args)
    assert code == 2 and option in err, err
    assert not sqlite_path.exists()


def test_ctrl_c_on_worker_releases_its_job_and_exits_130(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """SIGINT mid-attempt: the job is PENDING again with its key, and the exit code is 130."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/hang", Step(200, sleep=10.0))
    with Outbox(store) as outbox:
        job = outbox.submit(base_url + "/hang", json={})
    code, _, err = _signal_mid_attempt(
        script, ["worker", "--store", store, "--json"], signal.SIGINT
    )
    assert code == 130, err
    with Outbox(store) as outbox:
        final = outbox.get(job.id)
    assert final.state is JobState.PENDING and final.key == job.key and final.attempts == 0


@pytest.mark.parametrize(("presses", "said"), [(2, "released (pending, same key)"), (3, "lease")])
def test_ctrl_c_pressed_twice_still_releases_every_job_and_three_times_exits_at_once(
    sqlite_path: Path, script: Script, base_url: str, presses: int, said: str
) -> None:
    """A fresh user's check: Ctrl-C pressed twice quickly (a few ms apart) with 16 attempts in
    flight left jobs IN_FLIGHT until their lease ended in 12 of 30 runs (asyncio's handler
    raised KeyboardInterrupt into the release), and one landing as the process exited printed
    a traceback and died by the signal. Twice now releases every job (one line says so);
    three times exits at once, saying what is left to the lease. Exit 130, no traceback."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/hang", Step(200, sleep=10.0))
    with Outbox(store) as outbox:
        jobs = [outbox.submit(base_url + "/hang", json={"i": i}) for i in range(8)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "worker", "--store", store, "-c", "8", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(script.requests("/hang")) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(script.requests("/hang")) == 8
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and said in err.splitlines()[-1], err
    if presses == 2:
        with Outbox(store) as outbox:
            states = [outbox.get(j.id) for j in jobs]
        assert {(j.state, j.attempts) for j in states} == {(JobState.PENDING, 0)}


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "list"),
        ("jobs", "show", "deadbeef"),
        ("dlq", "list"),
        ("jobs", "submit", "http://example.test/x"),
        ("jobs", "retry", "deadbeef"),
        ("jobs", "cancel", "deadbeef"),
        ("worker", "--until-idle"),
        ("reconcile",),
        ("dlq", "replay", "--all"),
        ("dlq", "purge", "--yes"),
    ],
)
def test_commands_refuse_a_store_that_does_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    """A mistyped store path is bad input for every command, reading or changing (exit 2, the
    hint to run `retrysafe migrate`), and no file is created."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(*args, "--store", "sqlite:///typo.db")
    assert code == 2
    assert err.strip() == (
        "retrysafe: error: --store: no store at typo.db (create it with `retrysafe migrate "
        "--store sqlite:///typo.db`, or pass the right --store)"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[str]:
    """A store holding one job, whose file and directory are immutable (``chattr +i``): even
    root cannot write them, and SQLite cannot create its WAL index next to the file."""
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "outbox.db"
    store = f"sqlite:///{path}"
    with Outbox(store) as outbox:
        outbox.submit("http://example.test/x", json={})
    done = [p for p in (path, directory) if _chattr("+i", p)]
    try:
        if len(done) < 2:
            pytest.skip("cannot make a directory immutable here (chattr +i failed)")
        yield store
    finally:
        for p in done:
            _chattr("-i", p)


def _chattr(flag: str, path: Path) -> bool:
    if os.geteuid() != 0:
        os.chmod(path, 0o555 if flag == "+i" else 0o755)
        return True
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_reading_commands_work_on_a_read_only_store(read_only_store: str) -> None:
    """`jobs list`, `jobs show` and `dlq list` read a store that cannot be written."""
    code, out, err = _run("jobs", "list", "--store", read_only_store, "--json")
    assert code == 0, err
    [job] = json.loads(out)["jobs"]
    code, out, err = _run("jobs", "show", job["id"], "--store", read_only_store, "--json")
    assert code == 0 and json.loads(out)["id"] == job["id"]
    code, out, err = _run("dlq", "list", "--store", read_only_store, "--json")
    assert code == 0 and json.loads(out) == []


def test_writing_to_a_read_only_store_says_it_is_read_only(read_only_store: str) -> None:
    """`jobs submit` on a store that cannot be written says the store is read-only."""
    code, _, err = _run("jobs", "submit", "http://example.test/y", "--store", read_only_store)
    assert code == 1
    assert err.startswith("retrysafe: error: the store ") and "is read-only" in err


# ---------------------------------------------------------------------- issue 11
@pytest.mark.parametrize(
    "header",
    ["Content-Length: 5", "Transfer-Encoding: chunked", "Host: evil.test", "Connection: close"],
)
def test_headers_the_client_sets_are_refused_naming_the_header_option(
    sqlite_path: Path, header: str
) -> None:
    """`jobs submit -H 'Content-Length: 5'` (or Transfer-Encoding, Host, Connection) would make
    every attempt a malformed request: exit 2 naming -H/--header, and no job is recorded."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    code, _, err = _run("jobs", "submit", "http://example.test/x", "-H", header, "--store", store)
    assert code == 2, err
    assert err.startswith("retrysafe: error: -H/--header: header ") and err.count("\n") == 1
    assert header.split(":")[0] in err
    with Outbox(store) as outbox:
        assert outbox.jobs() == []


def test_a_job_url_with_credentials_is_refused_without_printing_them(sqlite_path: Path) -> None:
    """`jobs submit http://user:s3cret@host/` is bad input (exit 2, naming URL): nothing is
    stored, and the password appears nowhere."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    code, out, err = _run("jobs", "submit", "http://user:s3cret@example.test/x", "--store", store)
    assert code == 2
    assert err.startswith("retrysafe: error: URL: ") and "credentials" in err
    assert "s3cret" not in err + out
    with Outbox(store) as outbox:
        assert outbox.jobs() == []


def test_a_stored_job_url_with_credentials_is_printed_without_them(
    sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job URL with ``user:password@`` written before submit refused them is shown by
    `jobs list`, `jobs show` and their --json without the password."""
    from retrysafe.client._models import NewJob

    monkeypatch.delenv("COLUMNS", raising=False)  # each URL on one line of the table

    store = f"sqlite:///{sqlite_path}"
    url = "http://user:s3cret@example.test/x"
    with Outbox(store) as outbox:
        new = NewJob(
            id="ab" * 16,
            key="k-legacy",
            method="POST",
            url=url,
            destination="http://example.test:80",
            headers=(),
            body=b"{}",
            deadline_at=None,
        )
        outbox.store.insert_job(new, now=time.time())
    for args in (
        ("jobs", "list"),
        ("jobs", "list", "--json"),
        ("jobs", "show", "abab"),
        ("jobs", "show", "abab", "--json"),
    ):
        code, out, err = _run(*args, "--store", store)
        assert code == 0, err
        assert "example.test/x" in out and "s3cret" not in out, args


def test_nan_data_is_bad_input_naming_the_data_option(sqlite_path: Path) -> None:
    """`-d NaN` is not JSON a server can read: exit 2 naming --data, like `-d '{bad'`."""
    store = f"sqlite:///{sqlite_path}"
    Outbox(store).close()
    for data in ("NaN", "{bad", '{"x": Infinity}'):
        code, _, err = _run("jobs", "submit", "http://example.test/x", "-d", data, "--store", store)
        assert code == 2 and err.startswith("retrysafe: error: --data: "), (data, err)


def test_worker_until_idle_exits_1_when_jobs_are_left_unknown(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """`worker --until-idle` whose jobs end UNKNOWN left work undone: exit 1, one line saying
    how many and to run `retrysafe reconcile`, after the JSON summary."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/down", Step(503))
    with Outbox(store) as outbox:
        outbox.submit(base_url + "/down", json={})
    code, out, err = _run("worker", "--store", store, "--until-idle", "--attempts", "1", "--json")
    assert code == 1
    assert json.loads(out.splitlines()[-1])["unknown"] == 1
    assert err.strip().splitlines() == [
        "retrysafe: error: jobs left UNKNOWN: 1 (their effect may or may not have happened; "
        "`retrysafe reconcile` re-sends them with the same key)"
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_lets_the_worker_finish_its_attempt_and_exit_143(
    sqlite_path: Path, script: Script, base_url: str, sig: signal.Signals
) -> None:
    """SIGTERM mid-attempt: the attempt finishes (the job SUCCEEDED, not sent twice), the
    worker prints its summary and exits 143 (128 + SIGTERM). SIGHUP (the terminal closed)
    does the same: it killed the worker on the spot, its job IN_FLIGHT for a lease."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=1.0))
    with Outbox(store) as outbox:
        job = outbox.submit(base_url + "/slow", json={})
    code, out, err = _signal_mid_attempt(script, ["worker", "--store", store, "--json"], sig)
    assert code == 143, err
    assert json.loads(out.splitlines()[-1])["succeeded"] == 1
    assert "retrysafe: stopped by SIGTERM" in err
    with Outbox(store) as outbox:
        assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert len(script.requests("/slow")) == 1


def test_tables_sent_to_a_pipe_are_not_wrapped(
    sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output that is not a terminal (and no $COLUMNS) gets each row on one line, whatever
    its width: the full URL and key of a job sit on the line of its id."""
    monkeypatch.delenv("COLUMNS", raising=False)
    store = f"sqlite:///{sqlite_path}"
    url = "http://example.test/" + "a-long-path/" * 10
    with Outbox(store) as outbox:
        job = outbox.submit(url, json={})
    code, out, err = _run("jobs", "list", "--store", store)
    assert code == 0, err
    [row] = [line for line in out.splitlines() if job.id[:12] in line]
    assert url in row and job.key in row


def test_dlq_list_shows_the_attempts_of_each_dead_letter(
    sqlite_path: Path, script: Script, base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlq list` (the table) shows each dead letter's attempts, as the README says: one row
    per attempt with its job, number, status and outcome."""
    monkeypatch.delenv("COLUMNS", raising=False)
    store = f"sqlite:///{sqlite_path}"
    script.plan("/dead", Step(503))
    with Outbox(store) as outbox:
        job = outbox.submit(base_url + "/dead", json={})
        outbox.worker(policy=RetryPolicy(attempts=2, wait_initial=0.01)).run_until_idle()
    code, out, err = _run("dlq", "list", "--store", store)
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "their attempts" in line)
    rows = [line for line in lines[at:] if job.id[:12] in line]
    assert len(rows) == 2
    assert all("503" in row for row in rows)
    assert [row.split("│")[2].strip() for row in rows] == ["1", "2"]


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (("jobs", "list", "--limit", "0"), "--limit: 0 is not in the range"),
        (("jobs", "list", "--bogus"), "No such option '--bogus'"),
        (("jobs", "submit"), "Missing argument 'URL'"),
        (("worker", "-c", "nan"), "--concurrency: 'nan' is not a valid integer"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: tuple[str, ...], start: str) -> None:
    """click's own usage errors follow the convention: one `retrysafe: error:` line naming the
    option, pointing to --help, exit 2 (no three-line usage block)."""
    code, _, err = _run(*args)
    assert code == 2
    assert err.startswith(f"retrysafe: error: {start}") and err.count("\n") == 1
    assert "--help')" in err


def test_submit_reads_data_from_a_file_or_stdin_like_webhooks_send(tmp_path: Path) -> None:
    """`-d @file` and `-d -` read the body as `webhooks send PAYLOAD` does (one reader for
    both); the body stored is the compact JSON of what was read."""
    store = f"sqlite:///{tmp_path / 'o.db'}"
    _migrate(store)
    body = tmp_path / "body.json"
    body.write_text('{"text": "h\\u00e9llo", "n": [1, 2]}', encoding="utf-8")
    code, out, err = _run("jobs", "submit", "http://api.test/x", "-d", f"@{body}",
                          "--store", store, "--json")  # fmt: skip
    assert code == 0, err
    from_file = json.loads(out)["id"]
    result = CliRunner().invoke(
        cli,
        ["jobs", "submit", "http://api.test/x", "-d", "-", "--store", store, "--json"],
        input='{"from": "stdin"}',
    )
    assert result.exit_code == 0, result.stderr
    from_stdin = json.loads(result.stdout)["id"]
    outbox = Outbox(store)
    try:
        assert outbox.get(from_file).body == b'{"text":"h\\u00e9llo","n":[1,2]}'
        assert outbox.get(from_stdin).body == b'{"from":"stdin"}'
    finally:
        outbox.close()
    # curl's `-d @-` reads stdin too; a file named "-" is `@./-`.
    curl_style = CliRunner().invoke(
        cli,
        ["jobs", "submit", "http://api.test/x", "-d", "@-", "--store", store, "--json"],
        input='{"from": "@-"}',
    )
    assert curl_style.exit_code == 0, curl_style.stderr
    (tmp_path / "-").write_text('{"from": "a file named -"}', encoding="utf-8")
    named = CliRunner().invoke(
        cli,
        ["jobs", "submit", "http://api.test/x", "-d", f"@{tmp_path / '-'}", "--store", store,
         "--json"],
        input='{"from": "stdin, wrongly"}',
    )  # fmt: skip
    assert named.exit_code == 0, named.stderr
    outbox = Outbox(store)
    try:
        assert outbox.get(json.loads(curl_style.stdout)["id"]).body == b'{"from":"@-"}'
        assert outbox.get(json.loads(named.stdout)["id"]).body == b'{"from":"a file named -"}'
    finally:
        outbox.close()
    for bad, says in (
        (f"@{tmp_path / 'missing.json'}", "cannot read"),
        ("@" + str(tmp_path), "cannot read"),
        ("not json", "is not JSON"),
    ):
        code, _, err = _run("jobs", "submit", "http://api.test/x", "-d", bad, "--store", store)
        assert code == 2 and err.startswith("retrysafe: error: --data:") and says in err, err


def test_data_from_a_closed_stdin_or_a_bare_at_sign_is_one_clear_line(
    tmp_path: Path,
) -> None:
    """Fresh-user pass: `-d -` with stdin closed (`<&-`) was a traceback, and `-d @` said
    "cannot read : No such file" with a blank name."""
    store = f"sqlite:///{tmp_path / 'o.db'}"
    _migrate(store)
    closed = subprocess.run(
        [sys.executable, "-m", "retrysafe", "jobs", "submit", "http://api.test/x", "-d", "-",
         "--store", store],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert closed.returncode == 2, closed.stderr
    assert closed.stderr == "retrysafe: error: --data: - reads stdin, and stdin is closed\n"
    code, _, err = _run("jobs", "submit", "http://api.test/x", "-d", "@", "--store", store)
    assert code == 2 and "@ needs a file name" in err, err
    code, _, err = _run("jobs", "submit", "http://api.test/x", "-d", "", "--store", store)
    assert code == 2 and "--data: the argument is not JSON" in err, err
    code, out, _ = _run("jobs", "list", "--store", store, "--json")
    assert json.loads(out)["jobs"] == []


def test_sigterm_on_reconcile_gives_its_jobs_back_as_unknown_and_exits_143(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """SIGTERM mid-reconcile (what `timeout`, systemd and Kubernetes send): every job it had
    claimed is UNKNOWN again, so the next reconcile sees it, and the exit code is 143. The
    default action killed the process and left them IN_FLIGHT until their leases ended."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/down", Step(503))
    script.plan("/hang", Step(200, sleep=10.0))
    with Outbox(store, policy=RetryPolicy(attempts=1, wait_initial=0.01)) as outbox:
        job = outbox.submit(base_url + "/down", json={})
        outbox.worker(poll_interval=0.01).run_until_idle()
        assert outbox.get(job.id).state is JobState.UNKNOWN
    # The reconcile attempt goes to the same URL, which now hangs.
    script.plan("/down", Step(200, sleep=10.0))
    script.started.clear()
    code, _, err = _signal_mid_attempt(
        script, ["reconcile", "--store", store, "--timeout", "30"], signal.SIGTERM
    )
    assert code == 143, err
    assert "stopped by SIGTERM" in err
    with Outbox(store) as outbox:
        final = outbox.get(job.id)
    assert final.state is JobState.UNKNOWN and final.key == job.key


def test_stored_text_is_shown_as_it_is_never_as_markup_or_terminal_codes(
    tmp_path: Path,
) -> None:
    """A key of `[/]` is a valid key and stopped `jobs list` with rich's MarkupError; one of
    `[bold]x` restyled the row; a last error holding ESC retitled the terminal in `jobs show`
    (a fresh-user pass). Each is shown as it is stored, control characters escaped."""
    db = f"sqlite:///{tmp_path}/o.db"
    with Outbox(db) as outbox:
        closing = outbox.submit("http://127.0.0.1:9/a", json={}, key="[/]")
        outbox.submit("http://127.0.0.1:9/b", json={}, key="[bold]x")
    with Outbox(db) as again, again.store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(
            "UPDATE outbox_jobs SET last_error = ? WHERE id = ?",
            ("\x1b]0;pwned\x07 boom", closing.id),
        )
    wide = {"COLUMNS": "300"}  # whole cells, whatever the suite's terminal
    listed = CliRunner().invoke(cli, ["jobs", "list", "--store", db], env=wide)
    assert listed.exit_code == 0, listed.stderr
    assert "[/]" in listed.stdout and "[bold]x" in listed.stdout
    shown = CliRunner().invoke(cli, ["jobs", "show", closing.id, "--store", db], env=wide)
    code, out, err = shown.exit_code, shown.stdout, shown.stderr
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "last error: \\x1b]0;pwned\\x07 boom" in out


def test_reconcile_tells_a_destination_that_stops_answering_as_a_cli_warning_line(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Reconcile of UNKNOWN jobs whose destination now hangs: the worker's warning (the
    destination down to one attempt in flight) is one ``retrysafe: warning:`` line on stderr,
    not Python's bare last-resort line (a fresh-user pass saw it without the prefix)."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/gone", Step(503))
    with Outbox(store, policy=RetryPolicy(attempts=1, wait_initial=0.01)) as outbox:
        for _ in range(6):
            outbox.submit(base_url + "/gone", json={})
        outbox.worker(poll_interval=0.01).run_until_idle()
    script.plan("/gone", Step(200, sleep=5.0))
    code, _, err = _run("reconcile", "--store", store, "--timeout", "0.3", "-c", "4")
    assert code == 1, err
    lines = err.splitlines()
    down = [line for line in lines if "one attempt in flight" in line]
    assert down and all(
        line.startswith("retrysafe: warning: destination http://127.0.0.1:") for line in down
    ), err
    assert all(line.startswith("retrysafe: ") for line in lines), err


def test_submit_refuses_a_body_over_max_body_and_names_the_option(tmp_path: Path) -> None:
    """`jobs submit` records at most --max-body bytes (default 10 MiB, the outbox's): past
    it one error line naming the command line's option (not the Python one), exit 2,
    nothing recorded; the option raises it."""
    store = f"sqlite:///{tmp_path / 'o.db'}"
    _migrate(store)
    body = tmp_path / "big.json"
    body.write_text(json.dumps({"a": "x" * 2000}))
    code, out, err = _run("jobs", "submit", "http://api.test/x", "-d", f"@{body}",
                          "--max-body", "1000", "--store", store)  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "body is 2,008 bytes, over the limit of 1,000" in err
    assert "(--max-body BYTES raises it)" in err and "Outbox(" not in err
    outbox = Outbox(store)
    try:
        assert outbox.jobs() == []
    finally:
        outbox.close()
    code, out, err = _run("jobs", "submit", "http://api.test/x", "-d", f"@{body}",
                          "--max-body", "2008", "--store", store)  # fmt: skip
    assert code == 0, err


def test_a_ctrl_c_before_the_loop_took_it_starts_no_work() -> None:
    """A fresh user's check: Ctrl-C to `retrysafe reconcile` while it set up (counted, no loop
    yet) cancelled the reconcile at its first await, its claim, which landed all the same:
    60 jobs IN_FLIGHT in 6 of 15 runs, said to be UNKNOWN again. The work does not start."""
    from retrysafe.cli._client import _Interrupts

    interrupts = _Interrupts("jobs")
    started: list[bool] = []

    async def main() -> None:
        with interrupts.in_loop():
            started.append(True)

    previous = signal.getsignal(signal.SIGINT)
    try:
        with interrupts.around_loop(lambda: False):
            interrupts._record(signal.SIGINT, None)  # as the handler does while no loop runs
            asyncio.run(main())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # exiting: ignored
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started == [] and interrupts.count == 1 and not interrupts.forced


@pytest.mark.parametrize("command", [["worker"], ["reconcile"], ["webhooks", "worker"]])
def test_an_in_memory_store_is_not_told_to_migrate(command: list[str]) -> None:
    """``--store sqlite:///:memory:``: each process's in-memory database starts empty, so the
    usual hint (`retrysafe migrate --store sqlite:///:memory:`) could never help; the line
    says to give a file."""
    code, _, err = _run(*command, "--store", "sqlite:///:memory:")
    assert code == 1, err
    assert "in-memory SQLite database" in err and "migrate --store" not in err
    assert len(err.strip().splitlines()) == 1


def test_ctrl_c_goes_back_to_the_handler_from_before_once_the_loop_lets_go() -> None:
    """The worker's loop takes Ctrl-C while it runs; leaving, asyncio put back Python's
    KeyboardInterrupt, not the command's recorder, so a Ctrl-C while ``asyncio.run`` was
    still closing the loop raised inside it ("Event loop stopped before Future completed",
    exit 1, no summary: a fresh user's check, six presses 3 ms apart)."""
    import threading

    from retrysafe.cli._client import _on_signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")

    def before(signum: int, frame: object) -> None:
        pass

    old = signal.signal(signal.SIGINT, before)
    try:

        async def main() -> None:
            with _on_signal(signal.SIGINT, lambda: None):
                assert signal.getsignal(signal.SIGINT) is not before  # the loop's, inside

        asyncio.run(main())
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, old)


def test_the_drivers_lines_go_to_the_workers_json_lines_not_stderr(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's JSON lines carry the store driver's own lines (psycopg's pool discarding a
    broken connection): they reached stderr as bare text, once per process with
    `--processes` (a fresh user's check: 45 lines when the database's connections were
    cut). The logger is put back as it was afterwards."""
    import logging

    from retrysafe.cli import _client
    from retrysafe.cli._common import driver_lines_to

    monkeypatch.setattr(_client, "_STDOUT", [])  # this test's stdout, not an earlier one's
    pool = logging.getLogger("psycopg.pool")
    parent = logging.getLogger("psycopg")
    before = (parent.propagate, list(parent.handlers))
    handler = _client._JsonLines()
    with driver_lines_to(handler):
        pool.warning("discarding broken connection: %s", "<psycopg.AsyncConnection [BAD]>")
    assert handler.out.wait(10)
    out, err = capfd.readouterr()
    [line] = [json.loads(text) for text in out.splitlines()]
    assert line["logger"] == "psycopg.pool" and line["level"] == "warning"
    assert line["message"] == "discarding broken connection: <psycopg.AsyncConnection [BAD]>"
    assert "discarding" not in err
    assert (parent.propagate, list(parent.handlers)) == before


def test_after_a_third_ctrl_c_errors_of_work_cut_short_print_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A third Ctrl-C with PostgreSQL refusing connections: as the loop closed, the driver's
    pool generators cut short printed some 55 lines of traceback (a fresh user's check,
    three runs of three); the command promises one line. After a forced exit the loop's
    handler of errors nobody retrieved drops them; before one, asyncio's own reports them."""
    import logging

    from retrysafe.cli._client import _Interrupts

    interrupts = _Interrupts("jobs")
    context = {"message": "an error occurred during closing of asynchronous generator"}
    loop = asyncio.new_event_loop()
    reported: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reported.append(record.getMessage())

    seen = Seen()
    logging.getLogger("asyncio").addHandler(seen)
    try:
        interrupts.exception_handler(loop, dict(context))
        assert reported == [context["message"]]  # asyncio's own report
        interrupts.forced = True
        interrupts.exception_handler(loop, dict(context))
        assert reported == [context["message"]]  # dropped
    finally:
        logging.getLogger("asyncio").removeHandler(seen)
        loop.close()


def test_until_idle_giving_up_on_the_store_ends_after_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`worker --until-idle` on a store unavailable for its outage limit: the run's end is
    a Served that gave up (so the command prints its summary, then one error line, exit
    1). It raised out of the command, which printed no summary (a fresh user's check)."""
    from _readonly import ReadOnly
    from retrysafe import Outbox, SQLiteStore, Worker
    from retrysafe.cli._client import finish, serve

    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "jobs.db"
    with Outbox(f"sqlite:///{path}") as outbox:
        outbox.submit("http://127.0.0.1:9/x", json={})
    with ReadOnly(path):
        store = SQLiteStore(path, busy_timeout=0.05)
        try:
            worker = Worker(store, poll_interval=0.01, store_outage_limit=0.3)
            served = serve(worker, until_idle=True)
        finally:
            store.close()
    assert served.gave_up is not None and "store_outage_limit 0.3 s" in served.gave_up
    assert served.code is None and served.stats.store_outages == 1
    with pytest.raises(SystemExit) as ended:
        finish(served, until_idle=True, what="jobs")
    assert ended.value.code == 1
    assert capsys.readouterr().err.startswith("retrysafe: error: store ")
