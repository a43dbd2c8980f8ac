"""``retrysafe ui``: what it refuses before serving anything, and a run that serves a page
and stops on SIGINT with exit 130 (docs/cli.md's convention)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from retrysafe import SQLiteStore
from retrysafe._serving import free_port
from retrysafe.cli import cli


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["ui", *args], env=env)
    return result.exit_code, result.output


def get_when_listening(url: str) -> httpx.Response:
    """GET ``url`` once the console listens (it logs its URL just before binding)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return httpx.get(url, headers={"accept": "text/html"})
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = tmp_path / "app.db"
    SQLiteStore(path).close()
    return f"sqlite:///{path}"


@pytest.mark.parametrize("listen", ["0.0.0.0:8090", "[::]:8090", "192.0.2.10:8090"])
def test_a_non_loopback_listen_without_token_is_refused(db: str, listen: str) -> None:
    """Exit 2 naming --listen and --token; nothing is served."""
    code, out = run("--store", db, "--listen", listen)
    assert code == 2
    assert "--listen" in out and "--token" in out


@pytest.mark.parametrize("token", ["short", "with spaces but long enough"])
def test_a_weak_token_is_refused(db: str, token: str) -> None:
    """A token under 16 characters or with whitespace: exit 2 naming --token."""
    code, out = run("--store", db, "--listen", "0.0.0.0:8090", "--token", token)
    assert code == 2 and "--token" in out and "16–512 visible ASCII" in out


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("--listen", "nonsense"), "--listen"),
        (("--listen", "127.0.0.1:0"), "--listen"),
        (("--listen", "127.0.0.1:70000"), "--listen"),
        (("--reconcile-timeout", "-1"), "--reconcile-timeout"),
        (("--reconcile-timeout", "nan"), "--reconcile-timeout"),
    ],
)
def test_bad_options_are_usage_errors(db: str, args: tuple[str, ...], name: str) -> None:
    """Exit 2, one line naming the option."""
    code, out = run("--store", db, *args)
    assert code == 2 and name in out


def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path: Path) -> None:
    """The console opens an existing store only: a typo creates nothing."""
    missing = tmp_path / "typo.db"
    code, out = run("--store", f"sqlite:///{missing}")
    assert code == 2 and "retrysafe migrate" in out
    assert not missing.exists()


def test_memory_store_is_refused(db: str) -> None:
    """memory:// lives in one process: nothing to look at (exit 2)."""
    code, _ = run("--store", "memory://")
    assert code == 2


def test_the_console_serves_and_stops_on_sigint(db: str) -> None:
    """It logs a JSON line with its URL, serves the overview, and SIGINT stops it (exit 130)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "ui", "--store", db, "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RETRYSAFE_UI_TOKEN": ""},
    )
    try:
        assert proc.stderr is not None
        line = json.loads(proc.stderr.readline())
        assert line["msg"] == "console listening"
        assert line["url"] == f"http://127.0.0.1:{port}/"
        r = get_when_listening(line["url"] + "jobs")
        assert r.status_code == 200 and "Jobs" in r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
    finally:
        proc.kill()
        proc.wait(10)


def test_schema_is_for_postgresql_only(db: str) -> None:
    """--schema with a SQLite store: exit 2 naming --schema."""
    code, out = run("--store", db, "--schema", "app")
    assert code == 2 and "--schema" in out


def test_the_console_opens_a_postgresql_store_in_its_schema(pg_url: str, pg_schema: str) -> None:
    """--schema NAME: the console reads the tables of that schema (created by migrate)."""
    from retrysafe.stores import PostgresStore

    PostgresStore(pg_url, schema=pg_schema).close()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "ui", "--store", pg_url, "--schema", pg_schema,
         "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = json.loads(proc.stderr.readline())
        assert line["msg"] == "console listening", line
        r = get_when_listening(line["url"] + "jobs")
        assert r.status_code == 200 and "Jobs" in r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 143
    finally:
        proc.kill()
        proc.wait(10)


def test_sigterm_mid_reconcile_gives_the_job_back_as_unknown(tmp_path: Path) -> None:
    """A reconcile waiting on an endpoint that never answers: SIGTERM stops the console within
    the 5-second convention (exit 143) and the job is UNKNOWN again, not stuck IN_FLIGHT."""
    import re
    import socket
    import threading

    from retrysafe import Outbox
    from retrysafe.client import JobState, outbox_store

    path = tmp_path / "app.db"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections (the backlog) and never answers
    with Outbox(SQLiteStore(path)) as outbox:
        job = outbox.submit(f"http://127.0.0.1:{silent.getsockname()[1]}/x", json={})
        outbox_store(outbox.store).transition_job(
            job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0.0
        )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "ui", "--store", f"sqlite:///{path}",
         "--listen", f"127.0.0.1:{port}", "--reconcile-timeout", "60"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        url = json.loads(proc.stderr.readline())["url"]
        page = get_when_listening(url + "keys")
        found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
        assert found is not None
        form = {
            "csrf_token": found.group(1),
            "action": "reconcile",
            "queue": "default",
            "id": job.id,
            "confirmed": "yes",
        }
        posting = threading.Thread(
            target=lambda: httpx.post(
                url + "actions/apply", data=form, cookies=dict(page.cookies), timeout=30
            ),
            daemon=True,
        )
        posting.start()
        deadline = time.monotonic() + 10
        with Outbox(SQLiteStore(path)) as outbox:
            while outbox.get(job.id).state is not JobState.IN_FLIGHT:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 143
            assert time.monotonic() - started < 8
            after = outbox.get(job.id)
            assert after.state is JobState.UNKNOWN
            assert after.lease_token is None
    finally:
        proc.kill()
        proc.wait(10)
        silent.close()


def test_prefix_is_for_redis_only(db: str) -> None:
    """--prefix with a SQLite store: exit 2 naming --prefix."""
    code, out = run("--store", db, "--prefix", "app:")
    assert code == 2 and "--prefix" in out


def test_a_localhost_listen_is_bound_and_shown_as_127_0_0_1(db: str) -> None:
    """``--listen localhost:PORT`` serves on 127.0.0.1 and says so (a browser would try [::1]
    first, where another local user could listen)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "ui", "--store", db, "--listen", f"localhost:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = json.loads(proc.stderr.readline())
        assert line["url"] == f"http://127.0.0.1:{port}/"
        assert get_when_listening(line["url"] + "jobs").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
