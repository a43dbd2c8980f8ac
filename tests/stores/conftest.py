"""Every key store runs the same contract suite (SPEC §9), against the real services.

PostgreSQL (``RETRYSAFE_TEST_POSTGRES``, default ``postgresql://postgres@127.0.0.1:5432/test``)
gets a fresh schema per test; Redis (``RETRYSAFE_TEST_REDIS``, default
``redis://127.0.0.1:6379/0``) a fresh key prefix per test; both are removed afterwards. A Redis
Cluster of three masters is started by the tests themselves (``redis-server`` processes on free
loopback ports, once per session and xdist worker: ``_redis_cluster.py``) and gets a fresh key
prefix per test too. When a service is unreachable (or the cluster cannot be started) the tests
using it are skipped with the reason — except under ``CI=true``, where they fail: CI must never
go green without the real stores.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from retrysafe.stores import KeyStore, MemoryStore, SQLiteStore

if TYPE_CHECKING:
    from ._redis_cluster import LocalCluster

KEY_STORES = ["sqlite", "memory", "postgres", "redis", "redis-cluster"]


@pytest.fixture(scope="session")
def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    service_unreachable: Callable[[str, str, BaseException], None],
) -> Iterator[LocalCluster]:
    """Three Redis Cluster masters on free loopback ports, for this session (one cluster per
    xdist worker); stopped at the end. Skip or, under CI, fail when they cannot start."""
    import redis

    from ._redis_cluster import ClusterStartError, LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
    except (ClusterStartError, OSError, subprocess.SubprocessError, redis.RedisError) as exc:
        cluster.stop()
        where = "127.0.0.1 (three redis-server processes)"
        service_unreachable("a local Redis Cluster", where, exc)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def private_redis(
    tmp_path_factory: pytest.TempPathFactory,
    service_unreachable: Callable[[str, str, BaseException], None],
) -> Iterator[str]:
    """The URL of a standalone ``redis-server`` of this session (one per xdist worker), for
    the tests that pause it: a ``CLIENT PAUSE ALL`` on the shared server would stall every
    other worker's Redis tests meanwhile. Skip or, under CI, fail when it cannot start."""
    import redis

    from ._redis_cluster import ClusterStartError, start_private_server

    try:
        node = start_private_server(tmp_path_factory.mktemp("redis-private"))
    except (ClusterStartError, OSError, subprocess.SubprocessError, redis.RedisError) as exc:
        service_unreachable("a private redis-server", "127.0.0.1 (a free port)", exc)
    yield f"redis://{node.address}/0"
    node.stop()


@pytest.fixture
def redis_cluster_prefix(redis_cluster: LocalCluster) -> Iterator[str]:
    """A fresh, unique key prefix on the test cluster; its keys are deleted on every master
    afterwards (one key per command: a cluster refuses multi-key commands across slots)."""
    prefix = f"rs-test:{uuid.uuid4().hex[:16]}:"
    yield prefix
    for node in redis_cluster.nodes:
        client = node.client()
        try:
            pipe = client.pipeline(transaction=False)
            for key in client.scan_iter(match=prefix + "*", count=1000):
                pipe.unlink(key)
            pipe.execute()
        finally:
            client.close()


def open_test_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path, **kw: Any) -> Any:
    """Open a store of ``kind`` on a private namespace (caller's clock for the SQL/Redis ones,
    so the contract tests can drive time with ``now``)."""
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "keys.db")
    if kind == "memory":
        return MemoryStore()
    if kind == "postgres":
        from retrysafe.stores import PostgresStore

        schema = request.getfixturevalue("pg_schema")
        kw.setdefault("clock", "caller")
        return PostgresStore(request.getfixturevalue("pg_url"), schema=schema, **kw)
    if kind == "redis":
        from retrysafe.stores import RedisStore

        prefix = request.getfixturevalue("redis_prefix")
        kw.setdefault("clock", "caller")
        return RedisStore(request.getfixturevalue("redis_url"), prefix=prefix, **kw)
    if kind == "redis-cluster":
        from retrysafe.stores import RedisStore

        cluster = request.getfixturevalue("redis_cluster")
        prefix = request.getfixturevalue("redis_cluster_prefix")
        kw.setdefault("clock", "caller")
        return RedisStore(cluster.url, prefix=prefix, **kw)
    raise AssertionError(kind)


@pytest.fixture(params=KEY_STORES)
def key_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyStore]:
    store: KeyStore = open_test_store(request.param, request, tmp_path)
    yield store
    store.close()
