"""RedisStore on a Redis Cluster (SPEC §9): the ``redis+cluster://`` URL, one slot per key
hash, every master swept and checked, resharding followed, redirection storms and node failures
answered as ``StoreUnavailableError`` — against the local three-master cluster of conftest.py.
The contract suite runs on the cluster too (``KEY_STORES``); a master killed mid-run is in
test_outages.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.crc
import redis.exceptions as rex

from retrysafe import (
    ConfigurationError,
    RetrysafeWarning,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import StoredResponse
from retrysafe.stores import RedisStore, open_store
from retrysafe.stores._url_check import ClusterURL, parse_cluster_url

from ._redis_cluster import LocalCluster, Node

FP = "f" * 64
RESP = StoredResponse(201, (("content-type", "text/plain"),), b"done")
CLOSED_PORT = 1  # nothing listens on tcpmux


def _hash_on(cluster: LocalCluster, prefix: str, node: Node, start: int = 0) -> str:
    """A key hash (64 hex digits) whose record lives on ``node``."""
    for i in range(start, start + 10_000):
        h = f"{i:064x}"
        if cluster.owner(f"{prefix}k:{{{h}}}") is node:
            return h
    raise AssertionError("no key hash found for the node")


def _node_id(node: Node) -> str:
    client = node.client()
    try:
        raw = client.cluster("myid")
    finally:
        client.close()
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _setslot(node: Node, slot: int, *args: str) -> None:
    client = node.client()
    try:
        client.cluster("setslot", slot, *args)
    finally:
        client.close()


# ------------------------------------------------------------------------------- URLs
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
            ClusterURL((("127.0.0.1", 7000), ("127.0.0.1", 7001)), None, None, False),
        ),
        ("redis+cluster://cache", ClusterURL((("cache", 6379),), None, None, False)),
        (
            "redis+cluster://:p%40ss@h1:7000/0",
            ClusterURL((("h1", 7000),), None, "p@ss", False),
        ),
        (
            "rediss+cluster://app:pw@[::1]:7000,h2/",
            ClusterURL((("::1", 7000), ("h2", 6379)), "app", "pw", True),
        ),
    ],
)
def test_cluster_url_forms(url: str, expected: ClusterURL) -> None:
    """Several startup nodes, a default port of 6379, database 0, a login, IPv6 and TLS."""
    assert parse_cluster_url(url) == expected


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+cluster://", "without a host"),
        ("redis+cluster://:s3cret@", "without a host"),
        ("redis+cluster://:s3cret@h1:7000,,h2:7001", "without a host"),
        ("redis+cluster://:s3cret@h1:0", "1-65535"),
        ("redis+cluster://:s3cret@h1:65536", "1-65535"),
        ("redis+cluster://:s3cret@h1:port", "1-65535"),
        ("redis+cluster://:s3cret@h1:", "empty port"),
        ("redis+cluster://:s3cret@h1:7000/1", "only database 0"),
        ("redis+cluster://:s3cret@h1:7000/db", "only database 0"),
        ("redis+cluster://:s3cret@h1:7000/0?db=1", "query options"),
        ("redis+cluster://:s3cret@[::1:7000", "IPv6"),
    ],
)
def test_malformed_cluster_url_is_refused(url: str, why: str) -> None:
    """A cluster URL without a host, with a bad port, a database other than 0 or query
    options is a ConfigurationError before anything connects; the password is never shown."""
    with pytest.raises(ConfigurationError, match=why) as info:
        open_store(url)
    assert "s3cret" not in str(info.value)
    assert info.value.option == "store"


def test_unreachable_cluster_is_unavailable_naming_its_nodes_not_the_password() -> None:
    """No startup node answers: StoreUnavailableError naming the nodes, never the password."""
    url = f"redis+cluster://:s3cret-pw@127.0.0.1:{CLOSED_PORT},127.0.0.1:{CLOSED_PORT + 1}"
    with pytest.raises(StoreUnavailableError) as info:
        RedisStore(url, socket_timeout=1)
    message = str(info.value)
    assert f"127.0.0.1:{CLOSED_PORT},127.0.0.1:{CLOSED_PORT + 1}" in message
    assert "s3cret-pw" not in message and "s3cret-pw" not in repr(info.value)


def test_open_store_opens_a_cluster_and_shows_it_without_secrets(
    redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """open_store (and so every --store option) opens redis+cluster:// as a RedisStore on
    the cluster; its url and repr name every startup node."""
    store = open_store(redis_cluster.url, prefix=redis_cluster_prefix)
    try:
        assert isinstance(store, RedisStore) and store.cluster
        assert store.url == redis_cluster.url
        assert repr(store) == f"RedisStore({redis_cluster.url!r})"
        assert store.claim("c" * 64, FP, now=0, lease=10, retention=100)[0]
    finally:
        store.close()


def test_cluster_url_on_a_standalone_redis_is_an_error(redis_url: str) -> None:
    """redis+cluster:// naming a server without cluster support: a StoreError saying so (not
    "unavailable": retrying cannot help)."""
    host_port = redis_url.split("://", 1)[1].split("/", 1)[0]
    with pytest.raises(StoreError, match="not a Redis Cluster") as info:
        RedisStore(f"redis+cluster://{host_port}")
    assert not isinstance(info.value, StoreUnavailableError)


def test_redis_url_on_a_cluster_node_warns(redis_cluster: LocalCluster) -> None:
    """redis:// naming one cluster node works only for that node's slots: a warning says to
    use redis+cluster://."""
    with pytest.warns(RetrysafeWarning, match=r"Cluster node.*redis\+cluster://"):
        RedisStore(f"redis://{redis_cluster.nodes[0].address}/0").close()


def test_prefix_with_a_brace_is_refused_on_a_cluster(redis_cluster: LocalCluster) -> None:
    """A prefix with ``{`` would move the hash tag and split a record from its counter."""
    with pytest.raises(ConfigurationError, match="hash tag") as info:
        RedisStore(redis_cluster.url, prefix="app{1}:")
    assert info.value.option == "prefix"


# ---------------------------------------------------------------------------- layout
def test_each_record_shares_a_slot_with_its_counter_and_keys_spread_over_every_master(
    redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """A record and its fencing-token counter hash to one slot (the {key_hash} tag), and 30
    key hashes land on all three masters."""
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix)
    hashes = [f"{i:064x}" for i in range(30)]
    try:
        for h in hashes:
            store.claim(h, FP, now=0, lease=10, retention=100)
    finally:
        store.close()
    for h in hashes:
        record, counter = f"{redis_cluster_prefix}k:{{{h}}}", f"{redis_cluster_prefix}t:{{{h}}}"
        assert redis.crc.key_slot(record.encode()) == redis.crc.key_slot(counter.encode())
    held = []
    for node in redis_cluster.nodes:
        client = node.client()
        held.append(len(list(client.scan_iter(match=f"{redis_cluster_prefix}k:*"))))
        client.close()
    assert sum(held) == 30 and all(n > 0 for n in held), held


@pytest.fixture
def one_master_evicts(redis_cluster: LocalCluster) -> Iterator[Node]:
    """The cluster's last master with ``maxmemory-policy allkeys-lru``; restored afterwards."""
    node = redis_cluster.nodes[-1]
    client = node.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield node
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.close()


def test_an_evicting_policy_on_any_master_warns_naming_it(
    one_master_evicts: Node, redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """The eviction check reads every master: one evicting master warns, naming it."""
    with pytest.warns(RetrysafeWarning, match="allkeys-lru") as caught:
        store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix)
    try:
        # Only retrysafe's warnings: a loaded host's garbage collector may emit others (an
        # unclosed socket of an earlier test) inside the block.
        ours = [str(w.message) for w in caught if issubclass(w.category, RetrysafeWarning)]
        assert [one_master_evicts.address in m for m in ours] == [True], ours
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert store.check_eviction() == "allkeys-lru"
    finally:
        store.close()


# ----------------------------------------------------------------------- resharding
@pytest.mark.anyio
async def test_a_resharded_slot_keeps_its_records_and_tokens(
    redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """A slot migrated to another master while both faces are in use: ASK during the move
    and MOVED after it are followed; the record, its response and its token history move
    with the slot."""
    src, dst, third = redis_cluster.nodes
    h = _hash_on(redis_cluster, redis_cluster_prefix, src)
    record, counter = f"{redis_cluster_prefix}k:{{{h}}}", f"{redis_cluster_prefix}t:{{{h}}}"
    slot = redis.crc.key_slot(record.encode())
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix, clock="caller")
    face = store.asyncio_key_store()
    moved = False
    try:
        _, first = store.claim(h, FP, now=0, lease=10, retention=100)
        assert store.complete(h, first.fencing_token, RESP, now=1, retention=100)
        assert (await face.get(h)) == store.get(h)  # both faces know the old slot map
        src_id, dst_id = _node_id(src), _node_id(dst)
        _setslot(dst, slot, "IMPORTING", src_id)
        _setslot(src, slot, "MIGRATING", dst_id)
        mover = src.client()
        mover.migrate("127.0.0.1", dst.port, [record, counter], 0, 5000)
        mover.close()
        # Mid-move: the keys are on dst, the slot still on src: src answers ASK.
        during = store.get(h)
        assert during is not None and during.response == RESP
        assert (await face.get(h)) == during
        assert not store.claim(h, FP, now=2, lease=10, retention=100)[0]
        for node in (dst, src, third):
            _setslot(node, slot, "NODE", dst_id)
        moved = True
        # After the move the faces' maps are stale: MOVED, then the new owner.
        assert redis_cluster.owner(record) is dst
        assert (await face.get(h)) == during
        taken = store.take_over(h, first.fencing_token, now=2, lease=10)
        assert taken is None  # completed: nothing to take over, and no error
        assert store.get(h) == during
        store._r.delete(record)  # as if its TTL fired
        claimed, again = await face.claim(h, FP, now=200, lease=10, retention=100)
        assert claimed and again.fencing_token > first.fencing_token  # the counter moved too
    finally:
        if not moved:
            for node in (src, dst):
                _setslot(node, slot, "STABLE")
        await face.aclose()
        store.close()


@pytest.mark.anyio
async def test_a_redirection_storm_is_unavailable_not_a_raw_redis_error(
    redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """A slot half-migrated (MIGRATING on its master, not IMPORTING anywhere) bounces every
    call between ASK and MOVED until redis-py gives up: both faces raise
    StoreUnavailableError (the middleware's 503), and the key works once the slot is stable."""
    src, dst, _ = redis_cluster.nodes
    h = _hash_on(redis_cluster, redis_cluster_prefix, src, start=50_000)
    slot = redis.crc.key_slot(f"{redis_cluster_prefix}k:{{{h}}}".encode())
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix)
    face = store.asyncio_key_store()
    _setslot(src, slot, "MIGRATING", _node_id(dst))
    try:
        with pytest.raises(StoreUnavailableError) as sync_info:
            store.claim(h, FP, now=0, lease=10, retention=100)
        with pytest.raises(StoreUnavailableError) as async_info:
            await face.claim(h, FP, now=0, lease=10, retention=100)
    finally:
        _setslot(src, slot, "STABLE")
    try:
        for info in (sync_info, async_info):
            assert isinstance(info.value.__cause__, rex.ClusterError), info.value.__cause__
        assert store.claim(h, FP, now=0, lease=10, retention=100)[0]
        assert not (await face.claim(h, FP, now=0, lease=10, retention=100))[0]
    finally:
        await face.aclose()
        store.close()


# ----------------------------------------------------------------- error translation
@pytest.mark.parametrize(
    "error",
    [
        rex.ClusterDownError("The cluster is down"),
        rex.MasterDownError("MASTERDOWN Link with MASTER is down"),
        rex.TryAgainError("Multiple keys request during rehashing of slot"),
        rex.ClusterError("TTL exhausted."),
        rex.MovedError("3999 127.0.0.1:6381"),
        rex.AskError("3999 127.0.0.1:6381"),
        rex.SlotNotCoveredError("Slot 3999 is not covered by the cluster."),
        rex.RedisClusterException(
            "Redis Cluster cannot be connected. Please provide at least one reachable node"
        ),
        redis.ConnectionError("Error 111 connecting to 127.0.0.1:6381. Connection refused."),
    ],
    ids=lambda e: type(e).__name__,
)
def test_cluster_failures_are_store_unavailable(
    error: Exception,
    redis_cluster: LocalCluster,
    redis_cluster_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node down, failover, CLUSTERDOWN, slot migration, redirections that never settle: each
    is a StoreUnavailableError with the driver's error as its cause."""
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix)

    def fail(*_: Any, **__: Any) -> Any:
        raise error

    monkeypatch.setattr(store._r, "hgetall", fail)
    try:
        with pytest.raises(StoreUnavailableError) as info:
            store.get("d" * 64)
        assert info.value.__cause__ is error
    finally:
        store.close()


def test_keys_of_two_slots_in_one_call_are_a_store_error_not_unavailable(
    redis_cluster: LocalCluster, redis_cluster_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script whose keys hash to two slots (a bug, e.g. a broken hash tag) is refused by
    the cluster client: a plain StoreError (retrying cannot help), never a raw exception."""
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix)
    monkeypatch.setattr(store, "_keys", lambda h: [f"k:{h}", f"t:{h}"])  # no hash tag
    try:
        with pytest.raises(StoreError, match="same key slot") as info:
            store.claim("e" * 64, FP, now=0, lease=10, retention=100)
        assert not isinstance(info.value, StoreUnavailableError)
    finally:
        store.close()
