"""Where one pass of the proof keeps its state: a fresh pair of SQLite files, or a fresh
PostgreSQL schema, created for the pass and removed after it.

A :class:`Space` also knows how to take its store away (:meth:`Space.outage`): SQLite files
locked by another process, PostgreSQL backends of the run terminated.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from retrysafe._exceptions import ConfigurationError, RetrysafeError, StoreUnavailableError
from retrysafe.proof._scenarios import EFFECTS_TABLE
from retrysafe.stores import SQLiteStore

__all__ = ["Backend", "ProofError", "Space", "check_store", "child_env", "kill_children"]

# Every connection of a run carries this application_name (PostgreSQL), so an outage
# terminates the run's backends and nobody else's.
_APP_PREFIX = "retrysafe-proof-"


class ProofError(RetrysafeError):
    """The proof could not run a pass (a child process failed, a store misbehaved).

    Attributes:
        result: from :func:`~retrysafe.proof.run_proof`, the :class:`ProofResult` of what
            finished before (``partial``); None elsewhere.
    """

    result: Any = None


# Every child process alive now, so a forced exit can kill them (they run in their own
# sessions: a terminal's Ctrl-C reaches only the runner, which stops them in order).
_LIVE: set[subprocess.Popen[bytes]] = set()


def kill_children() -> None:
    """SIGKILL every child process of every run in this process (for a forced exit)."""
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()
        _LIVE.discard(proc)


def _register(procs: list[subprocess.Popen[bytes]]) -> None:
    _LIVE.update(procs)


def _sqlite_url(path: Path) -> str:
    return "sqlite:///" + str(path)


class Space:
    """One pass's stores. ``store_args`` go to every child (``--store``, ``--schema``).

    Attributes:
        dir: a directory of the pass's files (effects log, naive queue files, child logs).
        keys_args: child arguments of the service's key store.
        outbox_args: child arguments of the outbox store.
    """

    dir: Path
    keys_args: list[str]
    outbox_args: list[str]
    #: Environment variables every child of the pass gets (the PostgreSQL URL).
    env: dict[str, str] = {}  # noqa: RUF012 - replaced per instance, never mutated

    def open_outbox(self) -> Any:
        """The outbox store, opened in this process."""
        raise NotImplementedError

    def effects(self) -> Counter[str]:
        """Effects per operation: the plain log's lines plus the transactional table's rows."""
        counts: Counter[str] = Counter()
        log = self.dir / "effects.log"
        if log.exists():
            counts.update(line for line in log.read_text().splitlines() if line)
        counts.update(self._table_effects())
        return counts

    def _table_effects(self) -> list[str]:
        raise NotImplementedError

    def outage(self, seconds: float) -> list[subprocess.Popen[bytes]]:
        """Take the store away now; returns child processes that hold it away (to wait for).

        Raises:
            StoreUnavailableError: the outage could not be started (nothing was done).
        """
        raise NotImplementedError

    def restart(self, command: str) -> list[subprocess.Popen[bytes]]:
        """Start ``command`` (split like a shell does), which restarts the database server;
        returns it as the process to wait for."""
        proc = subprocess.Popen(
            shlex.split(command),
            stdout=subprocess.DEVNULL,
            stderr=(self.dir / "restart.log").open("ab"),
            stdin=subprocess.DEVNULL,
        )
        _register([proc])
        return [proc]

    def close(self) -> None:
        """Remove what the pass created (every child of the pass must have stopped)."""


class _SQLiteSpace(Space):
    def __init__(self, root: Path) -> None:
        self.dir = root
        root.mkdir(parents=True)
        self._keys = root / "keys.db"
        self._outbox = root / "outbox.db"
        SQLiteStore(self._keys).close()
        SQLiteStore(self._outbox).close()
        with contextlib.closing(sqlite3.connect(self._keys)) as conn:
            conn.execute(f"CREATE TABLE {EFFECTS_TABLE} (operation TEXT NOT NULL)")
            conn.commit()
        self.keys_args = ["--store", _sqlite_url(self._keys)]
        self.outbox_args = ["--store", _sqlite_url(self._outbox)]

    def open_outbox(self) -> Any:
        return SQLiteStore(self._outbox)

    def close(self) -> None:
        for db in (self._keys, self._outbox):  # a 100,000-job pass leaves ~100 MB
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(str(db) + suffix).unlink()

    def _table_effects(self) -> list[str]:
        with contextlib.closing(sqlite3.connect(self._keys)) as conn:
            return [row[0] for row in conn.execute(f"SELECT operation FROM {EFFECTS_TABLE}")]

    def outage(self, seconds: float) -> list[subprocess.Popen[bytes]]:
        holders = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "retrysafe.proof._child",
                    "lock",
                    "--path",
                    str(db),
                    "--seconds",
                    str(seconds),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            for db in (self._keys, self._outbox)
        ]
        _register(holders)
        for holder in holders:  # both files are locked before the outage counts as begun
            assert holder.stdout is not None
            if holder.stdout.readline().strip() != b"locked":  # it exited without the lock
                raise ProofError("a lock holder could not lock its SQLite file")
        return holders


class _PostgresSpace(Space):
    def __init__(self, root: Path, url: str, run_id: str, index: int) -> None:
        from retrysafe.stores import open_store

        self.dir = root
        root.mkdir(parents=True)
        self._app = f"{_APP_PREFIX}{run_id}"
        self._url = url
        self.schema = f"retrysafe_proof_{run_id}_{index}"
        tagged = _with_application_name(url, self._app)
        self._store = open_store(tagged, schema=self.schema)
        with self._store.connector.connection() as conn:
            conn.execute(f"CREATE TABLE {EFFECTS_TABLE} (operation TEXT NOT NULL)")
        self.keys_args = ["--store", "env:" + STORE_ENV, "--schema", self.schema]
        self.outbox_args = self.keys_args
        self.env = {STORE_ENV: tagged}

    def open_outbox(self) -> Any:
        return self._store

    def _table_effects(self) -> list[str]:
        with self._store.connector.connection() as conn:
            rows = conn.execute(f"SELECT operation FROM {EFFECTS_TABLE}").fetchall()
        return [row[0] for row in rows]

    def outage(self, seconds: float) -> list[subprocess.Popen[bytes]]:
        import psycopg

        try:
            with psycopg.connect(self._url, autocommit=True, connect_timeout=10) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = %s AND pid <> pg_backend_pid()",
                    (self._app,),
                )
        except psycopg.Error as exc:  # e.g. the server is restarting: no outage this time
            raise StoreUnavailableError(f"cannot terminate the run's backends: {exc}") from exc
        return []

    def close(self) -> None:
        import psycopg

        self._store.close()
        with psycopg.connect(self._url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def _with_application_name(url: str, name: str) -> str:
    joiner = "&" if "?" in url else "?"
    return f"{url}{joiner}application_name={name}"


class Backend:
    """The run's store: ``"sqlite"`` (files under the run's directory) or a PostgreSQL URL.

    Args:
        store: ``"sqlite"`` or ``postgresql://…`` / ``postgres://…``.
        root: a directory for the run's files.

    Raises:
        ConfigurationError: an unsupported store, or a PostgreSQL server that cannot be
            reached or refuses the connection (checked before anything starts).
    """

    def __init__(self, store: str, root: Path) -> None:
        self.root = root
        self.run_id = secrets.token_hex(3)
        self._spaces = 0
        self.kind = check_store(store)
        self.url = None if self.kind == "sqlite" else store

    def space(self, name: str) -> Space:
        """A fresh space for one pass, named after it."""
        self._spaces += 1
        root = self.root / f"{self._spaces:02d}-{name}"
        if self.url is None:
            return _SQLiteSpace(root)
        return _PostgresSpace(root, self.url, self.run_id, self._spaces)


def check_store(store: str) -> str:
    """``"sqlite"`` or ``"postgresql"`` for a ``--store`` value, after checking that a
    PostgreSQL server answers.

    Raises:
        ConfigurationError: neither ``sqlite`` nor a ``postgresql://`` URL, a URL that
            libpq cannot parse, or psycopg missing.
        StoreUnavailableError: the server cannot be reached or refuses the connection.
        The password never appears in a message.
    """
    if store == "sqlite":
        return "sqlite"
    if store.startswith(("postgresql://", "postgres://")):
        _check_postgres(store)
        return "postgresql"
    from retrysafe.stores._url_check import redact_url

    hint = ""
    if store.startswith("sqlite:"):
        # Every pass needs a fresh store of its own: the proof makes its SQLite files itself.
        hint = " (the proof makes fresh SQLite files for every pass: pass --store sqlite)"
    raise ConfigurationError(
        f"{redact_url(store)!r} is neither sqlite nor a postgresql://… URL{hint}",
        option="store",
    )


def _check_postgres(url: str) -> None:
    from retrysafe.stores._url_check import check_postgres_url, redact_url

    check_postgres_url(url)  # the checks every command makes: ConfigurationError
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigurationError(
            "the PostgreSQL proof needs psycopg: pip install 'retrysafe[postgres]'",
            option="store",
        ) from exc
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        for secret in _secrets(url):
            reason = reason.replace(secret, "***")
        message = f"{redact_url(url)}: cannot connect: {reason}"
        if isinstance(exc, psycopg.OperationalError):  # down, refused, auth: found by trying
            raise StoreUnavailableError(message, store=redact_url(url)) from exc
        raise ConfigurationError(message, option="store") from exc  # a URL that cannot work


def _secrets(url: str) -> list[str]:
    """The passwords a URL carries (``user:password@``, ``?password=``), to scrub."""
    found = []
    with contextlib.suppress(ValueError):
        parts = urlsplit(url)
        if parts.password:
            found.append(parts.password)
        for name, values in parse_qs(parts.query).items():
            if name.lower() in ("password", "passwd", "pass", "pwd"):
                found.extend(v for v in values if v)
    return found


#: The environment variable a child reads its PostgreSQL URL from: a password on a command
#: line is visible to every local user (``ps``).
STORE_ENV = "RETRYSAFE_PROOF_STORE_URL"


def child_env() -> dict[str, str]:
    """The environment of every child: this one, with this process's ``sys.path`` first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env
