"""The Django test project, in this process (Django's test Client) and as real servers
(uvicorn for ASGI, gunicorn for WSGI) in child processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from retrysafe._serving import free_port

TESTS = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(scope="session")
def django_project(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Django set up in this process on a fresh SQLite file, migrated (retrysafe's tables
    and the shop's). Returns the database path."""
    db = tmp_path_factory.mktemp("django") / "db.sqlite3"
    os.environ["DJANGO_SETTINGS_MODULE"] = "djangoapp.settings"
    os.environ["RS_SQLITE"] = str(db)
    os.environ["RS_SQLITE_TIMEOUT"] = "0.5"  # a locked store fails fast (store-failure tests)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    return str(db)


@dataclass
class Server:
    """A Django test project served in a child process."""

    url: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _env(db: dict[str, str], retrysafe: dict[str, Any]) -> dict[str, str]:
    return {
        **os.environ,
        **db,
        "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
        "DJANGO_SETTINGS_MODULE": "djangoapp.settings",
        "RS_RETRYSAFE": json.dumps(retrysafe),
        "RS_SQLITE_TIMEOUT": "10",  # not the in-process project's 0.5 s
        "PYTHONUNBUFFERED": "1",
    }


def _listening(port: int, proc: subprocess.Popen[bytes]) -> bool:
    """Wait until ``proc`` listens on ``port`` (True) or died first (False)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, "the Django server never listened"
            time.sleep(0.05)


#: Starts of a child server before a death at start fails the test: a free port can be
#: taken by another test's process between free_port() and the child's bind.
_STARTS = 3


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The project's database for child servers: a SQLite file, or a fresh PostgreSQL
    schema (dropped after the test)."""
    if request.param == "sqlite":
        return {"RS_SQLITE": str(tmp_path / "db.sqlite3")}
    schema: str = request.getfixturevalue("pg_schema")
    url: str = request.getfixturevalue("pg_url")
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}".encode())
    return {"RS_PG_SCHEMA": schema, "RETRYSAFE_TEST_POSTGRES": url}


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    """Start the project: ``serve(db, server="uvicorn"|"gunicorn", **RETRYSAFE)``; migrated
    first; every process is killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(db: dict[str, str], server: str = "uvicorn", **retrysafe: Any) -> Server:
        env = _env(db, {"STORE": "django", **retrysafe})
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
            env=env,
            check=True,
            timeout=60,
        )
        return restart(env)

    def restart(env: dict[str, str], server: str = "uvicorn") -> Server:
        for _ in range(_STARTS):
            port = free_port()
            proc = subprocess.Popen(_command(env, server, port), env=env)
            procs.append(proc)
            if _listening(port, proc):
                return Server(f"http://127.0.0.1:{port}", env, proc, procs)
        raise AssertionError(f"the Django server died at start {_STARTS} times")

    def _command(env: dict[str, str], server: str, port: int) -> list[str]:
        if env.get("RS_SERVER", server) == "gunicorn":
            cmd = [
                sys.executable,
                "-m",
                "gunicorn",
                "-w",
                "1",
                "-k",
                "gthread",
                "--threads",
                env.get("RS_THREADS", "64"),
                "-b",
                f"127.0.0.1:{port}",
                "--log-level",
                "warning",
                "djangoapp.wsgi:application",
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "uvicorn",
                "djangoapp.asgi:application",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--no-access-log",
            ]
        return cmd

    def started(db: dict[str, str], server: str = "uvicorn", **retrysafe: Any) -> Server:
        return start({**db, "RS_SERVER": server}, **retrysafe)

    started.restart = restart  # type: ignore[attr-defined]
    yield started
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _client(**retrysafe: Any) -> Any:
    from django.test import Client, override_settings

    override = override_settings(RETRYSAFE={"STORE": "django", **retrysafe})
    override.enable()
    try:
        return Client(), override
    except BaseException:
        override.disable()
        raise


@pytest.fixture
def configured() -> Iterator[Any]:
    """``configured(**RETRYSAFE)``: a test Client whose middleware reads those settings."""
    overrides: list[Any] = []

    def make(**retrysafe: Any) -> Any:
        client, override = _client(**retrysafe)
        overrides.append(override)
        return client

    yield make
    for override in reversed(overrides):
        override.disable()
