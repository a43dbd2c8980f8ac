"""Shared fixtures. Tests use real SQLite files, real sockets and seeded randomness, and the
machine's real PostgreSQL and Redis: one fixture each, here, for every test folder."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from retrysafe.stores import SQLiteStore

# Hypothesis profiles (docs/testing.md). "ci", the default, keeps the property and model tests
# to a few seconds so the whole suite stays under four minutes on a 2-core machine;
# ``--hypothesis-profile=long`` runs 50 times as many examples, with longer stateful runs.
# No deadline: the model tests talk to real databases, whose latency is not the code's.
settings.register_profile(
    "ci",
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")



def pytest_configure(config: pytest.Config) -> None:
    """Compile retrysafe and the tests' helper modules to bytecode once, before the workers
    start. This machine (and CI's) sets PYTHONDONTWRITEBYTECODE=1, so every worker and every
    child process the tests start (the demo, proof and CLI tests start hundreds) compiled
    them from source again: about 0.15 s of CPU each, a tenth of the suite's. Reading
    ``__pycache__`` is allowed under that setting; only writing it is not. Test modules are
    left to pytest, which rewrites their asserts. A tree that cannot be written is left as
    it is (quietly: it only costs time)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller did it
    import compileall
    import re

    import retrysafe

    tests = re.compile(r"(^|/)(test_[^/]*|conftest)\.py$")
    for folder in (Path(retrysafe.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(folder, quiet=2, rx=tests)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> object:
    """Keep pytest's rewritten test modules in ``__pycache__`` while collecting (the
    setting above stops it): every worker collects every module, and reading them back
    halves a worker's collection (14 s of CPU to 7 here) from the second run on."""
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = before


PG_URL = os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RETRYSAFE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def unreachable(service: str, url: str, exc: BaseException) -> None:
    """A service the tests need is down: skip, except under ``CI=true`` where it fails."""
    reason = f"{service} at {url} is unreachable ({type(exc).__name__}: {exc})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; under CI=true these tests must run, not skip")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def service_unreachable() -> Callable[[str, str, BaseException], None]:
    """:func:`unreachable`, for fixtures in other folders that start services of their own."""
    return unreachable


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The test PostgreSQL URL, once checked reachable (skip or, under CI, fail)."""
    import psycopg

    try:
        with psycopg.connect(PG_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        unreachable("PostgreSQL", PG_URL, exc)
    return PG_URL


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh, unique PostgreSQL schema name; the schema is dropped after the test."""
    import psycopg

    name = f"rs_test_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE".encode())


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis URL, once checked reachable (skip or, under CI, fail)."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
        client.close()
    except redis.RedisError as exc:
        unreachable("Redis", REDIS_URL, exc)
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A fresh, unique Redis key prefix; every key under it is deleted after the test."""
    import redis

    prefix = f"rs-test:{uuid.uuid4().hex[:16]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "retrysafe.db"


@pytest.fixture
def sqlite_store(sqlite_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(sqlite_path)
    yield store
    store.close()
