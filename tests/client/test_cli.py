"""The outbox commands: `jobs`, `worker`, `reconcile`, `dlq` (JSON output, exit codes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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


def test_submit_worker_show_and_list_round_trip(
    sql_store_url: str, script: Script, base_url: str
) -> None:
    """submit → worker --until-idle → show/list report the job SUCCEEDED with its attempt,
    sent with its key (``--store sqlite:///…`` and ``--store postgresql://…``)."""
    store = sql_store_url
    script.plan("/cli", Step(201))
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
    """An exhausted job shows in `dlq list`; replay makes it PENDING; purge removes it."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/dlq", Step(503))
    _run("jobs", "submit", base_url + "/dlq", "--store", store)
    _run("worker", "--store", store, "--until-idle", "--attempts", "1", "--json")
    code, out, _ = _run("dlq", "list", "--store", store, "--json")
    [dead] = json.loads(out)
    assert dead["state"] == "unknown" and len(dead["attempt_log"]) == 1
    code, out, _ = _run("reconcile", "--store", store, "--json")
    assert code == 0 and json.loads(out)["unknown"] == 1
    code, out, _ = _run("dlq", "replay", dead["id"], "--store", store, "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "pending"
    code, out, _ = _run("jobs", "cancel", dead["id"], "--store", store)
    assert code == 0
    code, out, _ = _run("dlq", "purge", "--store", store, "--state", "unknown", "--yes")
    assert code == 0 and "purged 0" in out


def test_errors_are_one_line_and_non_zero(sqlite_path: Path, tmp_path: Path) -> None:
    """Every client command prints errors as one `retrysafe: error:` line and exits 1."""
    store = f"sqlite:///{sqlite_path}"
    for args in (
        ("jobs", "submit", "ftp://example.test/x", "--store", store),
        ("jobs", "show", "deadbeef", "--store", store),
        ("jobs", "cancel", "deadbeef", "--store", store),
        ("dlq", "replay", "deadbeef", "--store", store),
        ("reconcile", "deadbeef", "--store", store),
        ("worker", "--store", f"sqlite:///{tmp_path}/missing/x.db"),
        ("jobs", "list", "--store", f"sqlite:///{tmp_path}/missing/x.db"),
    ):
        code, out, err = _run(*args)
        assert code == 1
        assert err.startswith("retrysafe: error: ") and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err + out


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


def test_retrysafe_warning_is_one_line(sqlite_path: Path) -> None:
    """A RetrysafeWarning prints as `retrysafe: warning: …`, without source path or code."""
    store = f"sqlite:///{sqlite_path}"
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "worker", "--store", store, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert script.started.wait(30)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    with Outbox(store) as outbox:
        final = outbox.get(job.id)
    assert final.state is JobState.PENDING and final.key == job.key and final.attempts == 0


@pytest.mark.parametrize("args", [("jobs", "list"), ("jobs", "show", "deadbeef"), ("dlq", "list")])
def test_reading_commands_refuse_a_store_that_does_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    """A mistyped store path is an error for reading commands, and no file is created."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(*args, "--store", "sqlite:///typo.db")
    assert code == 1
    assert err.strip() == (
        "retrysafe: error: no store at typo.db (create one by submitting a job or with a worker)"
    )
    assert not Path("typo.db").exists()


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
