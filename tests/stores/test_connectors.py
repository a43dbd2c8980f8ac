"""The connector seam (issue 12): named statements, operations, transactions, both dialects."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from retrysafe import ConfigurationError, StoreError
from retrysafe.core import StoredResponse
from retrysafe.stores import PostgresStore, SQLiteStore
from retrysafe.stores import _keys as keys
from retrysafe.stores._connector import Clock, Exec, Op, Statement, Statements, count, drive, one


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        store: Any = SQLiteStore(tmp_path / "c.db")
    else:
        store = PostgresStore(
            request.getfixturevalue("pg_url"),
            schema=request.getfixturevalue("pg_schema"),
            clock="caller",
        )
    yield store
    store.close()


def _claimed(store: Any, key: str) -> int:
    claimed, record = store.claim(key, "fp", now=1000.0, lease=30.0, retention=60.0)
    assert claimed
    return int(record.fencing_token)


def _response() -> StoredResponse:
    return StoredResponse(201, (("content-type", "text/plain"),), b"ok", True)


def test_a_key_completed_inside_a_transaction_commits_with_it(sql_store: Any) -> None:
    token = _claimed(sql_store, "k1")
    with sql_store.transaction() as conn:
        op = keys.complete(
            sql_store.connector.clock, "k1", token, _response(), now=1001.0, retention=60.0
        )
        assert sql_store.connector.run(op, connection=conn) is True
    record = sql_store.get("k1")
    assert record is not None and record.response is not None
    assert record.response.status == 201


def test_a_transaction_that_raises_rolls_the_completion_back(sql_store: Any) -> None:
    token = _claimed(sql_store, "k2")
    op = keys.complete(
        sql_store.connector.clock, "k2", token, _response(), now=1001.0, retention=60.0
    )

    def business_transaction() -> None:
        with sql_store.transaction() as conn:
            sql_store.connector.run(op, connection=conn)
            raise RuntimeError("the application's own write failed")

    with pytest.raises(RuntimeError):
        business_transaction()
    record = sql_store.get("k2")
    assert record is not None and record.response is None


def test_a_connection_from_another_store_is_refused(sql_store: Any, tmp_path: Path) -> None:
    other = SQLiteStore(tmp_path / "other.db")
    try:
        with (
            other.transaction() as foreign,
            pytest.raises(ConfigurationError, match=r"is an open transaction on .*, not on"),
        ):
            sql_store.connector.run(keys.get("caller", "k"), connection=foreign)
    finally:
        other.close()


def test_a_connection_of_an_ended_transaction_is_refused(sql_store: Any) -> None:
    with sql_store.transaction() as conn:
        pass
    with pytest.raises(ConfigurationError, match=r"open store.transaction\(\)"):
        sql_store.connector.run(keys.get("caller", "k"), connection=conn)
    with pytest.raises(ConfigurationError, match="got a str that is not one"):
        sql_store.connector.run(keys.get("caller", "k"), connection="not a connection")


def test_a_transaction_of_another_store_object_on_the_same_file_is_accepted(
    tmp_path: Path,
) -> None:
    """``Outbox("sqlite:///x.db")`` and ``SQLiteStore("x.db").transaction()`` are two objects on
    one database: the connection of one is good for the other (the write lands in the file the
    transaction commits)."""
    first, second = SQLiteStore(tmp_path / "same.db"), SQLiteStore(tmp_path / "same.db")
    token = _claimed(first, "same")
    try:
        with second.transaction() as conn:
            op = keys.complete("caller", "same", token, _response(), now=1001.0, retention=60.0)
            assert first.connector.run(op, connection=conn) is True
        record = first.get("same")
        assert record is not None and record.response is not None
    finally:
        first.close()
        second.close()


def _boom(clock: Clock, key: str) -> Op[None]:
    """Claims a key, then fails: inside an atomic run the claim must not survive."""
    yield from keys.claim(clock, key, "fp", now=1000.0, lease=30.0, retention=60.0)
    raise StoreError("the operation gave up")


def test_an_atomic_operation_that_fails_leaves_nothing_behind(sql_store: Any) -> None:
    with pytest.raises(StoreError, match="gave up"):
        sql_store.connector.run(_boom("caller", "k3"), atomic=True)
    assert sql_store.get("k3") is None
    # Without atomic=True the first statement stands (each statement is its own transaction).
    with pytest.raises(StoreError, match="gave up"):
        sql_store.connector.run(_boom("caller", "k4"))
    assert sql_store.get("k4") is not None


def test_the_async_face_runs_the_same_operations(sql_store: Any) -> None:
    async def main() -> None:
        face = sql_store.asyncio_key_store()
        try:
            claimed, record = await face.claim("a1", "fp", now=1000.0, lease=30.0, retention=60.0)
            assert claimed
            again, same = await face.claim("a1", "fp", now=1000.0, lease=30.0, retention=60.0)
            assert not again and same.fencing_token == record.fencing_token
            assert await face.complete(
                "a1", record.fencing_token, _response(), now=1001.0, retention=60.0
            )
            stored = await face.get("a1")
            assert stored is not None and stored.response is not None
        finally:
            await face.aclose()

    asyncio.run(main())


def test_the_sqlite_async_face_restarts_an_operation_when_the_file_is_locked(
    tmp_path: Path,
) -> None:
    """Another process holds the write lock: the inline attempt fails without effect and the
    operation starts again, from the beginning, in a thread (a generator runs only once)."""
    store = SQLiteStore(tmp_path / "locked.db", busy_timeout=5.0)
    blocker = sqlite3.connect(
        tmp_path / "locked.db", isolation_level=None, check_same_thread=False
    )
    blocker.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, lambda: blocker.execute("COMMIT"))

    async def main() -> tuple[bool, Any]:
        face = store.asyncio_key_store()
        release.start()
        try:
            result: tuple[bool, Any] = await face.claim(
                "l1", "fp", now=1000.0, lease=30.0, retention=60.0
            )
            return result
        finally:
            await face.aclose()

    try:
        claimed, record = asyncio.run(main())
        assert claimed and record.fencing_token == 1
    finally:
        release.join()
        blocker.close()
        store.close()


def test_a_multi_statement_block_runs_in_one_transaction(tmp_path: Path) -> None:
    """A block of several statements: all or nothing, and the first one's result."""
    store = SQLiteStore(tmp_path / "m.db")
    store.run(lambda c: c.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
    block = Statement(
        "test.block",
        {
            "sqlite": (
                "INSERT INTO t (x) VALUES (:x) RETURNING x",
                "INSERT INTO t (x) VALUES (:x)",
            ),
            "postgres": (),
        },
    )

    def op(clock: Clock) -> Op[Any]:
        return (yield one(block, {"x": 1}))

    with pytest.raises(StoreError):  # the second insert violates the primary key
        store.connector.run(op("caller"))
    assert store.run(lambda c: c.execute("SELECT count(*) FROM t").fetchone()[0]) == 0
    store.close()


def test_drive_throws_errors_into_the_operation() -> None:
    seen: list[str] = []
    stmt = Statement("test.x", {"sqlite": ("SELECT 1",), "postgres": (b"SELECT 1",)})

    def op() -> Op[str]:
        try:
            yield count(stmt, {})
        except ValueError as exc:
            seen.append(str(exc))
            return "handled"
        return "not reached"

    def execute(request: Exec) -> Any:
        raise ValueError("driver said no")

    assert drive(op(), execute) == "handled"
    assert seen == ["driver said no"]


def test_statement_files_must_name_the_same_statements(tmp_path: Path) -> None:
    pkg = tmp_path / "fakepkg"
    (pkg / "sql").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sql" / "f.sqlite.sql").write_text("-- name: a\nSELECT 1;\n-- name: b\nSELECT 2;\n")
    (pkg / "sql" / "f.postgres.sql").write_text("-- name: a\nSELECT 1;\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"\['b'\] exist in one dialect only"):
            Statements("fakepkg", "f")
    finally:
        sys.path.remove(str(tmp_path))


def test_every_feature_names_the_same_statements_in_both_dialects() -> None:
    from retrysafe.agents import _store as agents
    from retrysafe.client import _store as outbox
    from retrysafe.webhooks import _store as webhooks

    for package, feature, columns in (
        (
            "retrysafe.stores",
            "keys",
            {"key_columns": keys.KEY_COLUMNS, "entry_columns": keys.ENTRY_COLUMNS},
        ),
        ("retrysafe.client", "outbox", {"job_columns": outbox.JOB_COLUMNS}),
        ("retrysafe.webhooks", "webhooks", {"endpoint_columns": webhooks.ENDPOINT_COLUMNS}),
        (
            "retrysafe.agents",
            "agents",
            {"call_columns": agents.CALL_COLUMNS, "run_columns": agents.RUN_COLUMNS},
        ),
    ):
        # Raises when the files disagree or name a column list that is not given.
        statements = Statements(package, feature, columns=columns)
        assert all("{" not in p for st in statements._by_name.values() for p in st.parts["sqlite"])


def test_a_statement_naming_an_unknown_column_list_is_refused(tmp_path: Path) -> None:
    pkg = tmp_path / "fakecols"
    (pkg / "sql").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for dialect in ("sqlite", "postgres"):
        (pkg / "sql" / f"f.{dialect}.sql").write_text("-- name: a\nSELECT {nothing} FROM t;\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"f.a: no column list \{nothing\}"):
            Statements("fakecols", "f")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_block_as_another_takes_its_sql_and_columns_read_per_dialect(tmp_path: Path) -> None:
    """``-- as: NAME``: a name one dialect needs, the other's being its plain statement; a
    ``reads`` expression replaces a column in one dialect's lists only. An ``as`` block with
    SQL of its own, or naming no block, is refused at import."""
    pkg = tmp_path / "fakeas"
    (pkg / "sql").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sql" / "f.sqlite.sql").write_text(
        "-- name: a\nSELECT {cols} FROM t;\n-- name: b\nSELECT 2;\n"
    )
    (pkg / "sql" / "f.postgres.sql").write_text(
        "-- name: a\nSELECT {cols} FROM t;\n-- name: b\n-- as: a\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        made = Statements(
            "fakeas", "f", columns={"cols": ("x", "y")}, reads={"sqlite": {"y": "y + 1"}}
        )
        assert made["a"].parts["sqlite"] == ("SELECT x, y + 1 FROM t",)
        assert made["a"].parts["postgres"] == (b"SELECT x, y FROM t",)
        assert made["b"].parts["postgres"] == made["a"].parts["postgres"]
        for feature, bad in (
            ("g", "-- name: b\n-- as: a\nSELECT 3;\n"),
            ("h", "-- name: b\n-- as: nothing\n"),
        ):
            for dialect, b in (("sqlite", "-- name: b\nSELECT 2;\n"), ("postgres", bad)):
                (pkg / "sql" / f"{feature}.{dialect}.sql").write_text(
                    "-- name: a\nSELECT {cols} FROM t;\n" + b
                )
            with pytest.raises(RuntimeError, match="block b is `as: "):
                Statements("fakeas", feature, columns={"cols": ("x",)})
    finally:
        sys.path.remove(str(tmp_path))


def _migrate(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "migrate", "--json", "--store", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _both_succeed(*args: str) -> None:
    procs = [_migrate(*args), _migrate(*args)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


def test_two_concurrent_migrations_of_one_sqlite_file_both_succeed(tmp_path: Path) -> None:
    _both_succeed(f"sqlite:///{tmp_path / 'race.db'}")
    with SQLiteStore(tmp_path / "race.db", create=False) as store:
        assert store.get("nothing") is None


def test_two_concurrent_migrations_of_one_postgres_schema_both_succeed(
    pg_url: str, pg_schema: str
) -> None:
    _both_succeed(pg_url, "--schema", pg_schema)
    with PostgresStore(pg_url, schema=pg_schema, create=False) as store:
        assert store.get("nothing") is None


def test_an_each_block_runs_per_row_in_one_transaction_and_is_all_or_nothing() -> None:
    """A block marked ``-- each: rows`` (SQLite's form of a batch another dialect takes as
    one JSON statement): every statement once per row; "all" returns every run's rows,
    "count" their total; a row that fails undoes the rows before it."""
    from retrysafe.stores._connector import Exec, Statement
    from retrysafe.stores._sqlite import _execute

    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER NOT NULL CHECK (n < 10))")
    conn.execute("CREATE TABLE log (id INTEGER)")
    insert = Statement(
        "test.insert",
        {"sqlite": ("INSERT INTO t (id, n) VALUES (:id, :n) RETURNING id, n",
                    "INSERT INTO log (id) VALUES (:id)"), "postgres": (b"",)},
        {"sqlite": "rows", "postgres": None},
    )  # fmt: skip
    rows = [{"id": 1, "n": 1}, {"id": 2, "n": 2}]
    assert _execute(conn, Exec(insert, {"rows": rows}, "all")) == [(1, 1), (2, 2)]
    assert conn.execute("SELECT count(*) FROM log").fetchone() == (2,)
    counted = Statement(
        "test.bump", {"sqlite": ("UPDATE t SET n = n + 1 WHERE id = :id",), "postgres": (b"",)},
        {"sqlite": "rows", "postgres": None},
    )  # fmt: skip
    assert _execute(conn, Exec(counted, {"rows": [{"id": 1}, {"id": 2}, {"id": 9}]}, "count")) == 2
    bad = [{"id": 3, "n": 3}, {"id": 4, "n": 99}]  # the second breaks the CHECK
    with pytest.raises(sqlite3.IntegrityError):
        _execute(conn, Exec(insert, {"rows": bad}, "all"))
    assert conn.execute("SELECT count(*) FROM t WHERE id = 3").fetchone() == (0,)
    assert not conn.in_transaction


def test_a_json_text_parameter_is_json_on_postgres_and_never_written_on_sqlite(
    pg_url: str,
) -> None:
    """JsonText binds as its JSON text on PostgreSQL (cast as the statement says), and SQLite,
    which binds only the parameters its statement names, never serialises it."""
    import psycopg

    from retrysafe.stores._connector import JsonText
    from retrysafe.stores._postgres import _JsonTextDumper  # registered on import

    assert _JsonTextDumper is not None
    with psycopg.connect(pg_url) as conn:
        [(value,)] = conn.execute("SELECT %(j)s::jsonb", {"j": JsonText([{"a": 1, "b": None}])})
    assert value == [{"a": 1, "b": None}]

    class Unwritable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError("serialised")

    conn2 = sqlite3.connect(":memory:")
    assert conn2.execute("SELECT :n", {"n": 1, "j": JsonText(Unwritable())}).fetchone() == (1,)
    conn2.close()


def test_a_postgres_urls_own_options_are_kept_and_keepalives_are_on(
    pg_url: str, pg_schema: str
) -> None:
    """The URL's ``options`` (here a statement timeout) reach the server, the store's schema
    is the search_path all the same, and TCP keepalives are on unless the URL sets its own:
    a server that vanished without a word fails a connection within about a minute."""
    url = f"{pg_url}?options=-c%20statement_timeout%3D1234%20-c%20search_path%3Delsewhere"
    with PostgresStore(url, schema=pg_schema) as store, store.connector.transaction() as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == ("1234ms",)
        assert conn.execute("SHOW search_path").fetchone() == (pg_schema,)
        params = conn.info.get_parameters()
        assert (params["keepalives"], params["keepalives_idle"]) == ("1", "30")
        assert params["tcp_user_timeout"] == "60000"
    own = f"{pg_url}?keepalives_idle=7"
    with PostgresStore(own, schema=pg_schema) as store, store.connector.transaction() as conn:
        assert conn.info.get_parameters()["keepalives_idle"] == "7"


def test_a_postgres_urls_options_ending_in_a_backslash_are_refused(pg_url: str) -> None:
    """A trailing backslash would escape the space before the store's -c search_path (libpq
    quoting), and the server would refuse the connection as if it were down: bad input."""
    with pytest.raises(ConfigurationError, match="backslash"):
        PostgresStore(f"{pg_url}?options=-c%20application_name%3Dx%5C")
