"""``retrysafe migrate``: creates a missing schema, does nothing the second time, upgrades an
older one and refuses a newer one (exit 1, naming both versions and ``retrysafe migrate``)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from retrysafe import SchemaError
from retrysafe.cli import cli
from retrysafe.stores import SCHEMA_VERSION, SQLiteStore


def _migrate(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["migrate", *args])
    return result.exit_code, result.stdout, result.stderr


def _sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'm.db'}"


def _pg_args(request: pytest.FixtureRequest) -> list[str]:
    url: str = request.getfixturevalue("pg_url")
    return ["--store", url, "--schema", request.getfixturevalue("pg_schema")]


@pytest.fixture(params=["sqlite", "postgres"])
def store_args(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """``--store`` (and ``--schema``) arguments naming an empty store."""
    if request.param == "sqlite":
        return ["--store", _sqlite_url(tmp_path)]
    return _pg_args(request)


def _set_version(args: list[str], version: int) -> None:
    store = args[1]
    if store.startswith("sqlite:"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        with conn:
            conn.execute(
                "UPDATE retrysafe_meta SET value = ? WHERE name = 'schema_version'",
                (str(version),),
            )
        conn.close()
        return
    import psycopg

    with psycopg.connect(store, autocommit=True) as pg:
        pg.execute(
            f"UPDATE {args[3]}.retrysafe_meta SET value = %s WHERE name = 'schema_version'",
            (str(version),),
        )


def test_migrate_creates_the_schema_then_is_a_no_op(store_args: list[str]) -> None:
    """On an empty store migrate creates the current version; a second run changes nothing."""
    code, out, err = _migrate(*store_args, "--json")
    assert code == 0, err
    first = json.loads(out)
    assert (first["action"], first["from_version"], first["to_version"]) == (
        "created",
        None,
        SCHEMA_VERSION,
    )
    code, out, err = _migrate(*store_args)
    assert code == 0, err
    assert f"version {SCHEMA_VERSION}; nothing to do" in out


def test_migrate_names_the_postgres_schema_it_migrated(request: pytest.FixtureRequest) -> None:
    """`migrate --schema X` says which schema its line is about (every schema of a database
    has the same URL), in the line and as ``schema`` in JSON; SQLite has none (null)."""
    args = _pg_args(request)
    code, out, err = _migrate(*args)
    assert code == 0, err
    assert out.startswith("postgresql://") and f" (schema {args[3]!r}): created" in out
    code, out, err = _migrate(*args, "--json")
    report = json.loads(out)
    assert code == 0 and report["schema"] == args[3]
    assert report["message"].startswith(f"{report['store']} (schema {args[3]!r}): ")
    sqlite_url = _sqlite_url(request.getfixturevalue("tmp_path"))
    code, out, err = _migrate("--store", sqlite_url, "--json")
    assert code == 0 and json.loads(out)["schema"] is None, err


def test_migrate_refuses_a_redis_url_whose_path_is_not_a_database(redis_url: str) -> None:
    """`migrate --store redis://host:port/abc` would connect to database 0: exit 2 naming
    --store, as every malformed URL."""
    code, out, err = _migrate("--store", redis_url.rsplit("/", 1)[0] + "/abc")
    assert code == 2 and out == ""
    assert err.startswith("retrysafe: error: --store: ") and "database number" in err


def test_migrate_refuses_a_newer_schema_version(store_args: list[str]) -> None:
    """A schema from a newer retrysafe: exit 1, naming both versions and `retrysafe migrate`."""
    assert _migrate(*store_args)[0] == 0
    _set_version(store_args, 99)
    code, out, err = _migrate(*store_args)
    assert code == 1 and out == ""
    assert "schema version 99" in err and f"up to {SCHEMA_VERSION}" in err
    # The command to run names the store as given, and its PostgreSQL schema (it read
    # "--store URL" and left the schema out).
    assert f"then run `retrysafe migrate --store {store_args[1]}" in err
    assert store_args[1].startswith("sqlite:") or f"--schema {store_args[3]}`" in err
    if not store_args[1].startswith("sqlite:"):  # the console's own --schema is named too
        result = CliRunner().invoke(cli, ["ui", *store_args, "--listen", "127.0.0.1:9"])
        assert result.exit_code == 1
        assert f"--schema {store_args[3]}`" in result.stderr


def test_migrate_adds_the_outbox_tables_to_an_older_postgres_schema(
    request: pytest.FixtureRequest,
) -> None:
    """A version-1 PostgreSQL schema written before the outbox existed gets its tables; a
    store opened with create=False on it says to run `retrysafe migrate`."""
    import psycopg

    from retrysafe.stores import PostgresStore

    args = _pg_args(request)
    assert _migrate(*args)[0] == 0
    with psycopg.connect(args[1], autocommit=True) as conn:
        conn.execute(
            f"DROP TABLE {args[3]}.webhook_deliveries, {args[3]}.outbox_attempts, "
            f"{args[3]}.outbox_jobs"
        )
    with pytest.raises(SchemaError, match="retrysafe migrate"):
        PostgresStore(args[1], schema=args[3], create=False)
    code, out, err = _migrate(*args, "--json")
    assert code == 0, err
    assert json.loads(out)["action"] == "upgraded"
    from retrysafe.client._store import outbox_store

    with PostgresStore(args[1], schema=args[3], create=False) as store:
        assert outbox_store(store).count_jobs(queue="default")


def test_migrate_on_redis_says_there_is_nothing_to_migrate(redis_url: str) -> None:
    """Redis has no schema: migrate connects once, says so and exits 0."""
    code, out, _ = _migrate("--store", redis_url, "--json")
    report: dict[str, Any] = json.loads(out)
    assert code == 0 and report["action"] == "not-applicable"
    assert "nothing to migrate" in report["message"]


def test_migrate_on_a_redis_cluster_says_there_is_nothing_to_migrate(redis_cluster: Any) -> None:
    """``--store redis+cluster://…`` opens the cluster (every node of the URL shown, no
    password) and, like Redis, has nothing to migrate."""
    code, out, err = _migrate("--store", redis_cluster.url, "--json")
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    assert report["action"] == "not-applicable" and report["store"] == redis_cluster.url


def test_migrate_on_a_malformed_cluster_url_fails() -> None:
    """A cluster URL naming database 1 is bad input (exit 2, naming --store), refused before
    connecting, without the password."""
    code, _, err = _migrate("--store", "redis+cluster://:s3cret@127.0.0.1:7000/1")
    assert code == 2
    assert err.startswith("retrysafe: error: --store: ")
    assert "only database 0" in err and "s3cret" not in err


def test_migrate_on_unreachable_redis_fails() -> None:
    """A Redis that cannot be reached is an error even though there is nothing to migrate."""
    code, _, err = _migrate("--store", "redis://127.0.0.1:1/0", "--json")
    assert code == 1
    assert "unavailable" in err


def _drop(args: list[str], table: str) -> None:
    store = args[1]
    if store.startswith("sqlite:"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        conn.execute("PRAGMA foreign_keys=OFF")
        conn.execute(f"DROP TABLE {table}")
        conn.close()
        return
    import psycopg

    with psycopg.connect(store, autocommit=True) as pg:
        pg.execute(f"DROP TABLE {args[3]}.{table} CASCADE")


@pytest.mark.parametrize(
    "table",
    ["idempotency_keys", "outbox_attempts", "agent_runs", "webhook_endpoints", "webhook_events"],
)
def test_migrate_recreates_any_dropped_table(store_args: list[str], table: str) -> None:
    """Every table of the layout is checked, not one per feature: a table dropped by hand is
    named by stores opened without create, and migrate puts it back."""
    assert _migrate(*store_args)[0] == 0
    _drop(store_args, table)
    code, out, err = _migrate(*store_args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["action"] == "upgraded" and table in report["message"]
    assert "nothing to do" in _migrate(*store_args)[1]


def test_a_store_without_one_table_names_it_and_migrate(request: pytest.FixtureRequest) -> None:
    from retrysafe.stores import PostgresStore

    args = _pg_args(request)
    assert _migrate(*args)[0] == 0
    _drop(args, "outbox_attempts")
    with pytest.raises(SchemaError, match=r"outbox_attempts.*retrysafe migrate"):
        PostgresStore(args[1], schema=args[3], create=False)


@pytest.mark.parametrize("raw", ["abc", "", "1.5", "-1"])
def test_an_unreadable_schema_version_is_one_clear_error(store_args: list[str], raw: str) -> None:
    """A version edited by hand into something that is not a whole number: every command says
    so in one line (exit 1), migrate too; nothing is changed."""
    assert _migrate(*store_args)[0] == 0
    store = store_args[1]
    if store.startswith("sqlite:"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        with conn:
            conn.execute(
                "UPDATE retrysafe_meta SET value = ? WHERE name = 'schema_version'", (raw,)
            )
        conn.close()
    else:
        import psycopg

        with psycopg.connect(store, autocommit=True) as pg:
            pg.execute(
                f"UPDATE {store_args[3]}.retrysafe_meta SET value = %s "
                "WHERE name = 'schema_version'",
                (raw,),
            )
    code, out, err = _migrate(*store_args)
    assert code == 1 and out == ""
    assert "unreadable schema version" in err and len(err.strip().splitlines()) == 1
    # The command to run names the store as given, and its PostgreSQL schema.
    assert f"then run `retrysafe migrate --store {store}" in err
    assert store.startswith("sqlite:") or f"--schema {store_args[3]}`" in err
    result = CliRunner().invoke(cli, ["jobs", "list", *store_args[:2]])
    if store.startswith("sqlite:"):  # jobs list takes no --schema: the public schema differs
        assert result.exit_code == 1
        assert "unreadable schema version" in result.stderr


def test_an_older_schema_version_is_upgraded(store_args: list[str]) -> None:
    assert _migrate(*store_args)[0] == 0
    _set_version(store_args, 0)
    code, out, err = _migrate(*store_args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["action"], report["from_version"], report["to_version"]) == (
        "upgraded",
        0,
        SCHEMA_VERSION,
    )


def _to_version_1(args: list[str]) -> None:
    """Turn a current store into the version-1 layout: no idempotency_keys.created_at."""
    store = args[1]
    drop = "ALTER TABLE {}idempotency_keys DROP COLUMN created_at"
    if store.startswith("sqlite:"):
        conn = sqlite3.connect(store[len("sqlite:///") :])
        with conn:
            conn.execute(drop.format(""))
        conn.close()
    else:
        import psycopg

        with psycopg.connect(store, autocommit=True) as pg:
            pg.execute(drop.format(args[3] + ".").encode())
    _set_version(args, 1)


def _open(args: list[str], **options: Any) -> Any:
    from retrysafe.stores import open_store

    if not args[1].startswith("sqlite:"):
        options["schema"] = args[3]
    return open_store(args[1], **options)


def test_a_version_1_store_is_upgraded_by_migrate_and_keeps_its_keys(
    store_args: list[str],
) -> None:
    """A version-1 store (idempotency_keys without created_at) is refused by a store opened
    without create, naming `retrysafe migrate`; migrate adds the column (version 1 -> 2),
    the key claimed before reads back with no claim time, and claims after it record one."""
    from retrysafe.stores._base import KeyAdmin

    old, new = "a" * 64, "b" * 64
    assert _migrate(*store_args)[0] == 0
    with _open(store_args) as store:
        store.claim(old, "f" * 64, now=1000.0, lease=10, retention=1e9)
    _to_version_1(store_args)
    with pytest.raises(SchemaError, match=r"older schema \(version 1.*retrysafe migrate"):
        _open(store_args, create=False)
    code, out, err = _migrate(*store_args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["action"], report["from_version"], report["to_version"]) == (
        "upgraded",
        1,
        SCHEMA_VERSION,
    )
    assert f"upgraded the schema from version 1 to {SCHEMA_VERSION}" in report["message"]
    with _open(store_args, create=False) as store:
        assert store.claim(new, "f" * 64, now=2000.0, lease=10, retention=1e9)[0]
        assert store.get(old) is not None
        admin: KeyAdmin = store
        listed = admin.list_keys(now=3000.0)
    assert [(e.key_hash, e.created_at is None) for e in listed] == [(new, False), (old, True)]
    assert "nothing to do" in _migrate(*store_args)[1]


def test_of_concurrent_migrations_one_creates_and_the_others_find_nothing_to_do(
    store_args: list[str],
) -> None:
    """Three `retrysafe migrate` processes at once on an empty store: each reports what it did
    under the store's lock, so exactly one says "created"."""
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "retrysafe", "migrate", "--json", *store_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    actions = sorted(json.loads(out)["action"] for out, _ in outs)
    assert actions == ["created", "none", "none"]


@pytest.mark.parametrize(
    "store", ["memory://", "foo://x", "sqlite:///{tmp}", "sqlite:///{tmp}/no/m.db"]
)
def test_migrate_refuses_what_cannot_hold_a_store(tmp_path: Path, store: str) -> None:
    """memory:// (it forgets everything), an unknown scheme, a directory and a path in a
    missing directory: exit 2 naming --store, nothing created."""
    code, out, err = _migrate("--store", store.format(tmp=tmp_path))
    assert code == 2 and out == ""
    assert err.startswith("retrysafe: error: --store: ") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_migrate_creates_a_store_the_other_commands_then_use(tmp_path: Path) -> None:
    """The documented first step: `jobs list` refuses a store that does not exist and names
    `retrysafe migrate`; after migrate it lists an empty outbox."""
    store = _sqlite_url(tmp_path)
    first = CliRunner().invoke(cli, ["jobs", "list", "--store", store, "--json"])
    assert first.exit_code == 2 and f"retrysafe migrate --store {store}" in first.stderr
    assert _migrate("--store", store)[0] == 0
    listed = CliRunner().invoke(cli, ["jobs", "list", "--store", store, "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout)["jobs"] == []


# The version-2 layout of outbox_attempts (SQLite): keyed by (job_id, number), deleted with
# its job by a foreign key; no trigger.
_V2_ATTEMPTS = """
CREATE TABLE outbox_attempts (
    job_id          TEXT NOT NULL REFERENCES outbox_jobs (id) ON DELETE CASCADE,
    number          INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    started_at      REAL NOT NULL,
    duration        REAL NOT NULL,
    outcome         TEXT NOT NULL,
    status          INTEGER,
    error_type      TEXT,
    replayed        INTEGER NOT NULL DEFAULT 0,
    counted         INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (job_id, number)
) WITHOUT ROWID
"""
_ATTEMPT_COLUMNS = (
    "job_id, number, idempotency_key, started_at, duration, outcome, status, error_type, "
    "replayed, counted"
)


def _to_version_2(path: Path) -> None:
    """Turn a current SQLite store into the version-2 layout, its attempts kept."""
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP TRIGGER outbox_attempts_of_deleted_job")
        conn.execute("ALTER TABLE outbox_attempts RENAME TO current_attempts")
        conn.execute(_V2_ATTEMPTS)
        conn.execute(
            f"INSERT INTO outbox_attempts ({_ATTEMPT_COLUMNS}) "
            f"SELECT {_ATTEMPT_COLUMNS} FROM current_attempts"
        )
        conn.execute("DROP TABLE current_attempts")
    conn.close()
    _set_version(["--store", f"sqlite:///{path}"], 2)


def test_a_version_2_sqlite_store_gets_its_attempts_rebuilt_and_keeps_them(
    tmp_path: Path,
) -> None:
    """Version 2 -> 3 on SQLite: the attempts table is rebuilt keyed by the job's creation
    time. Every attempt is kept (read back per job as before), the old table is gone, a job
    delivered after the upgrade records its attempts, and deleting a job still deletes its
    attempts (the trigger that replaced the foreign key's cascade)."""
    import httpx

    from retrysafe import Outbox, RetryPolicy

    calls: dict[str, int] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        n = calls[request.url.path] = calls.get(request.url.path, 0) + 1
        if request.url.path == "/flaky" and n == 1:
            return httpx.Response(503)
        return httpx.Response(422 if request.url.path == "/bad" else 201)

    db = tmp_path / "m.db"
    url = f"sqlite:///{db}"
    policy = RetryPolicy(wait_initial=0.01, wait_max=0.01)
    run = {"transport": httpx.MockTransport(answer), "poll_interval": 0.01}
    with Outbox(url, policy=policy) as outbox:
        ids = [
            outbox.submit(f"http://127.0.0.1:9/{p}", json={}).id for p in ("ok", "flaky", "bad")
        ]
        assert outbox.worker(**run).run_until_idle().succeeded == 2
        before = {i: outbox.attempts(i) for i in ids}
    assert [len(before[i]) for i in ids] == [1, 2, 1]
    _to_version_2(db)

    with pytest.raises(SchemaError, match=r"older schema \(version 2.*retrysafe migrate"):
        _open(["--store", url], create=False)
    code, out, err = _migrate("--store", url, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["action"], report["from_version"], report["to_version"]) == (
        "upgraded",
        2,
        SCHEMA_VERSION,
    )

    conn = sqlite3.connect(db)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert not {t for t in tables if t.startswith("retrysafe_rebuilt_")}
    columns = [r[1] for r in conn.execute("PRAGMA table_info(outbox_attempts)")]
    assert columns[:3] == ["job_created_at", "job_id", "number"]
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    conn.close()

    with Outbox(url, policy=policy) as outbox:
        assert {i: outbox.attempts(i) for i in ids} == before
        later = outbox.submit("http://127.0.0.1:9/ok", json={"after": True}).id
        assert outbox.worker(**run).run_until_idle().succeeded == 1
        assert [(a.number, a.status) for a in outbox.attempts(later)] == [(1, 201)]
        assert outbox.purge(states=["succeeded"], ids=[ids[1]]) == 1
    conn = sqlite3.connect(db)
    left = conn.execute("SELECT job_id, count(*) FROM outbox_attempts GROUP BY job_id").fetchall()
    conn.close()
    assert dict(left) == {ids[0]: 1, ids[2]: 1, later: 1}
    assert "nothing to do" in _migrate("--store", url)[1]


def test_an_attempt_log_of_the_old_layout_behind_a_current_version_stops_the_worker(
    tmp_path: Path,
) -> None:
    """A SQLite store whose attempts table takes the version-2 layout while a worker runs on
    it (the version says 3: edited by hand, or a process that never opened the store, such
    as a Django project before its migration 0002): the record fails, and the worker stops
    with a SchemaError naming `retrysafe migrate` instead of sending the job again and again.
    (Opening the store again repairs it: see the next test.)"""
    import httpx

    from retrysafe import Outbox

    db = tmp_path / "m.db"
    url = f"sqlite:///{db}"
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    with Outbox(url) as outbox:
        job = outbox.submit("http://127.0.0.1:9/x", json={})
        _to_version_2(db)
        _set_version(["--store", url], SCHEMA_VERSION)
        worker = outbox.worker(transport=httpx.MockTransport(answer), poll_interval=0.01)
        with pytest.raises(SchemaError, match=r"older retrysafe schema.*retrysafe migrate"):
            worker.run_until_idle()
        assert len(sent) == 1
        assert outbox.get(job.id).state.value == "pending"


def test_migrate_repairs_a_current_version_whose_layout_was_damaged(tmp_path: Path) -> None:
    """A store at the current version without its attempts trigger and an index (dropped by
    hand), and with its attempts table in the version-2 layout: the version alone said
    current, so `retrysafe migrate` did nothing while the worker said to run it, and a
    purged job's attempts stayed behind. Now migrate re-creates what is missing, keeps the
    attempts, and a second run has nothing to do; opening the store with create=False names
    what is missing."""
    from retrysafe import Outbox

    db = tmp_path / "d.db"
    url = f"sqlite:///{db}"
    with Outbox(url) as outbox:
        job = outbox.submit("http://127.0.0.1:9/x", json={})
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(
            "INSERT INTO outbox_attempts (job_created_at, job_id, number, idempotency_key, "
            "started_at, duration, outcome) SELECT created_at, id, 1, idempotency_key, "
            "created_at, 0.1, 'server_error' FROM outbox_jobs"
        )
    conn.close()
    _to_version_2(db)
    _set_version(["--store", url], SCHEMA_VERSION)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DROP INDEX outbox_jobs_due")
    conn.close()
    with pytest.raises(
        SchemaError, match=rf"version {SCHEMA_VERSION} without .*job_created_at.*outbox_jobs_due"
    ):
        SQLiteStore(db, create=False)
    code, out, err = _migrate("--store", url)
    assert code == 0, err
    assert f"re-created what schema version {SCHEMA_VERSION} lacked" in out
    assert "outbox_jobs_due" in out and "outbox_attempts_of_deleted_job" in out
    code, out, err = _migrate("--store", url)
    assert code == 0 and "nothing to do" in out, out + err
    with Outbox(url) as outbox:
        assert [a.number for a in outbox.attempts(job.id)] == [1]
    conn = sqlite3.connect(db)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert {"outbox_jobs_due", "outbox_attempts_of_deleted_job"} <= names


def test_a_store_without_an_index_opens_without_create_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only an index or trigger missing: the statements still run, so a store opened with
    create=False (a read-only copy, a user without DDL rights) is used, with a warning naming
    what is missing and `retrysafe migrate`; it was refused outright."""
    from retrysafe.stores import SQLiteStore

    db = tmp_path / "i.db"
    SQLiteStore(db).close()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DROP INDEX outbox_jobs_due")
    conn.close()
    with caplog.at_level("WARNING", logger="retrysafe.stores"):
        SQLiteStore(db, create=False).close()
        SQLiteStore(db, readonly=True).close()
    warned = [r.getMessage() for r in caplog.records]
    assert warned and all("without outbox_jobs_due" in m for m in warned)
    assert "retrysafe migrate" in warned[0]


def test_migrate_re_creates_a_postgresql_index_dropped_by_hand(
    pg_url: str, pg_schema: str
) -> None:
    """PostgreSQL: an index of the layout dropped by hand is missing at the current version,
    and migrate re-creates it."""
    import psycopg

    args = ["--store", pg_url, "--schema", pg_schema]
    assert _migrate(*args)[0] == 0
    with psycopg.connect(pg_url, autocommit=True) as pg:
        pg.execute(f"DROP INDEX {pg_schema}.outbox_jobs_due")
    code, out, err = _migrate(*args)
    assert code == 0, err
    assert f"re-created what schema version {SCHEMA_VERSION} lacked: outbox_jobs_due" in out
    with psycopg.connect(pg_url, autocommit=True) as pg:
        row = pg.execute(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
            (pg_schema, "outbox_jobs_due"),
        ).fetchone()
    assert row is not None and row[0] == 1


def test_a_version_3_sqlite_store_gets_its_body_table_and_keeps_its_jobs(tmp_path: Path) -> None:
    """Version 3 -> 4 on SQLite: a store opened without create names outbox_bodies and
    migrate; migrate adds the table and its triggers. A job written before keeps its large body
    in its row and is read and delivered as before; a new large body goes to the table."""
    import os

    from retrysafe import Outbox

    db = tmp_path / "v3.db"
    url = f"sqlite:///{db}"
    old_body, new_body = os.urandom(9000), os.urandom(9000)
    with Outbox(url) as outbox:
        old = outbox.submit("http://127.0.0.1:9/old", content=b"{}")
    conn = sqlite3.connect(db)
    with conn:  # the version-3 layout: no body table, bodies in their rows
        conn.execute("DROP TRIGGER outbox_bodies_of_deleted_job")
        conn.execute("DROP TABLE outbox_bodies")
        conn.execute("UPDATE outbox_jobs SET body = ? WHERE id = ?", (old_body, old.id))
    conn.close()
    _set_version(["--store", url], 3)
    with pytest.raises(SchemaError, match=r"older schema \(version 3.*retrysafe migrate"):
        SQLiteStore(db, create=False)
    code, out, err = _migrate("--store", url, "--json")
    assert code == 0, err
    assert json.loads(out)["from_version"] == 3
    with Outbox(url) as outbox:
        assert outbox.get(old.id).body == old_body
        new = outbox.submit("http://127.0.0.1:9/new", content=new_body)
        assert outbox.get(new.id).body == new_body
    conn = sqlite3.connect(db)
    kinds = dict(conn.execute("SELECT id, typeof(body) FROM outbox_jobs").fetchall())
    conn.close()
    assert kinds == {old.id: "blob", new.id: "integer"}


def test_the_cli_names_a_dropped_trigger_once_as_its_own_warning(tmp_path: Path) -> None:
    """A trigger dropped by hand: `jobs submit` and `jobs list` still work, and say so in one
    `retrysafe: warning:` line each (it was Python's bare log line, twice for a submit)."""
    db = tmp_path / "t.db"
    url = f"sqlite:///{db}"
    assert _migrate("--store", url)[0] == 0
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DROP TRIGGER outbox_bodies_of_deleted_job")
    conn.close()
    for args in (["jobs", "submit", "http://127.0.0.1:9/x", "-d", "{}"], ["jobs", "list"]):
        # A process each, as on the command line (a process warns once per store).
        result = subprocess.run(
            [sys.executable, "-m", "retrysafe", *args, "--store", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("retrysafe: warning: "), lines
        assert "without outbox_bodies_of_deleted_job" in lines[0]
        assert "retrysafe migrate" in lines[0]


def test_migrate_deletes_what_a_dropped_deletion_trigger_left_behind(tmp_path: Path) -> None:
    """With the triggers that delete a job's attempts and large body dropped by hand, a purge
    leaves them behind; migrate re-created the triggers and kept the orphans (a fresh user's
    check). It now deletes them, and nothing of a job that is still there."""
    import os

    import httpx

    from retrysafe import JobState, Outbox

    db = tmp_path / "o.db"
    url = f"sqlite:///{db}"
    with Outbox(url) as outbox:
        gone = outbox.submit("http://127.0.0.1:9/a", content=os.urandom(8000))
        kept = outbox.submit("http://127.0.0.1:9/b", content=os.urandom(8000))
        outbox.worker(transport=httpx.MockTransport(lambda r: httpx.Response(201))).run_until_idle()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DROP TRIGGER outbox_attempts_of_deleted_job")
        conn.execute("DROP TRIGGER outbox_bodies_of_deleted_job")
        conn.execute("DELETE FROM outbox_jobs WHERE id = ?", (gone.id,))

    def left() -> tuple[set[str], set[str]]:
        bodies = {r[0] for r in conn.execute("SELECT job_id FROM outbox_bodies")}
        attempts = {r[0] for r in conn.execute("SELECT job_id FROM outbox_attempts")}
        return bodies, attempts

    assert left() == ({gone.id, kept.id}, {gone.id, kept.id})
    code, _, err = _migrate("--store", url)
    assert code == 0, err
    assert left() == ({kept.id}, {kept.id})
    conn.close()
    with Outbox(url) as outbox:
        assert outbox.get(kept.id).state is JobState.SUCCEEDED
        assert len(outbox.get(kept.id).body) == 8000
