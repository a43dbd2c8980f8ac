"""The Redis key store: a low-latency key store for the middleware (SPEC §9), on one Redis
server (``redis://``) or a Redis Cluster (``redis+cluster://``).

Layout (``prefix`` defaults to ``"retrysafe:"``; the raw idempotency key is never stored, only
its SHA-256 ``key_hash``):

* ``{prefix}k:{<key_hash>}`` — a hash per record: ``fp``, ``st`` (running/completed), ``tok``,
  ``lease``, ``exp``, ``ct`` (the claim's time; absent on records an older retrysafe wrote;
  all times Unix seconds), and once completed ``status``, ``headers`` (JSON), ``body``,
  ``rep``. It carries a native TTL (``PEXPIRE``) of the retention, so Redis drops
  expired keys by itself; ``purge_keys`` only sweeps records whose ``exp`` passed early.
* ``{prefix}t:{<key_hash>}`` — the key hash's fencing-token counter (``INCR``). It outlives the
  record by ``token_ttl`` seconds (default 7 days), so a key claimed again after its record
  expired still gets a larger token than any owner that might still be running.
* ``{prefix}e:{<key_hash>}`` — the marker an operator's :meth:`RedisStore.evict` leaves: a hash
  of the evicted record's ``st`` (``released``), ``tok``, ``lease``, ``exp`` and ``ct``, with
  the record's remaining TTL, so ``retrysafe keys`` shows an evicted key as released (as the
  SQL stores' tombstone does) until its retention would have ended. Only the operator's
  commands read it; the middleware's scripts never touch it (a claim writes the record beside
  it, and the record, when there is one, is what a key reads as).

The braces are a hash tag: a cluster hashes only ``<key_hash>``, so every key of one key hash
sits in one slot and every script touches keys of a single slot (a prefix with braces is
refused on a cluster for that reason). The layout is the same on one server and on a cluster.

Every primitive is one Lua script (run with ``EVALSHA``; a server that lost its script cache gets
the script itself once, ``EVAL``), so claims and the fenced complete/release/take-over/extend are
atomic on the server, and each is one round trip: a claim returns the new claim or, when the key
is taken, the record that answers the request. On a cluster the scripts run
through redis-py's cluster clients (``redis.cluster.RedisCluster`` and its asyncio twin), which
route each call by its keys' slot and follow ``MOVED`` / ``ASK`` redirections; everything else
(scripts, key layout, arguments, decoding, error translation) is written once for both kinds.

Clock: by default (``clock="server"``) the scripts read Redis's ``TIME`` and ignore every
``now`` argument; ``clock="caller"`` honours ``now`` (the contract tests drive time by hand).

Durability is Redis's: with ``appendonly yes`` + ``appendfsync everysec`` a crash of the Redis
host can lose about the last second of claims and completions; with no AOF (RDB snapshots or
nothing) a restart loses everything since the last snapshot. A lost record is a forgotten key:
its repeat runs the handler again. Eviction is worse — see :meth:`RedisStore.check_eviction`.

The async face (the ASGI middleware's) talks to one server over
:mod:`~retrysafe.stores._redis_wire` when hiredis is installed (``pip install retrysafe[redis]``
brings it) and the URL is plain ``redis://``: one pipelined connection per event loop, several
times cheaper per command than redis-py's asyncio client. A cluster, TLS or other connection
options use redis-py's asyncio clients. Either way the operations, scripts, arguments, decoding
and error translation are the ones below.

redis-py is imported only when this module is (``pip install retrysafe[redis]``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import warnings
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Generator,
    Mapping,
    Sequence,
)
from typing import Any, Concatenate, Literal, NamedTuple, ParamSpec, TypeVar, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.commands.core import AsyncScript, Script
from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)

from retrysafe._exceptions import (
    ConfigurationError,
    RetrysafeWarning,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._base import KeyEntry, KeyPosition, check_limit, listed_states, page_of
from retrysafe.stores._connector import adrive, drive
from retrysafe.stores._keys import claimed_record, headers_json
from retrysafe.stores._url_check import (
    CLUSTER_SCHEMES,
    check_redis_url,
    parse_cluster_url,
    redact_url,
)

try:  # the lean async transport needs hiredis (in the redis extra)
    from retrysafe.stores._redis_wire import RedisWire, wire_options
except ImportError:  # pragma: no cover - exercised by the no-hiredis test
    RedisWire = None  # type: ignore[assignment,misc]
    wire_options = None  # type: ignore[assignment]

__all__ = ["RedisStore"]

_T = TypeVar("_T")
_P = ParamSpec("_P")
Clock = Literal["server", "caller"]
SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster

# What redis-py raises when a node or the cluster cannot serve a call *now*: a node down or
# failing over (connection refused / timeout, CLUSTERDOWN, MASTERDOWN, LOADING), a slot being
# migrated (TRYAGAIN, or MOVED / ASK redirections that outlived the client's 16 hops: "TTL
# exhausted"), a slot map the client cannot complete. All of them heal by themselves.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,
    TryAgainError,
    AskError,  # and MovedError, its subclass
    SlotNotCoveredError,
)
# RedisClusterException is no RedisError and carries every client-side cluster failure in one
# class: these are the ones about reaching the cluster (the rest, such as keys of two slots in
# one command, are bugs and stay plain StoreErrors).
_UNREACHABLE_CLUSTER = ("cannot be connected", "not covered", "could not agree")

# Shared prologue: ``now`` from ARGV[1] (empty: the server's TIME), formatted floats.
_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function f(x) return string.format('%.17g', x) end
local function owned(tok)
  local cur = redis.call('HMGET', KEYS[1], 'st', 'tok')
  return cur[1] == 'running' and cur[2] == tok
end
"""

# KEYS: record, counter. ARGV: now, fingerprint, lease, keep (s), keep_ms, counter_ms.
# Returns {0, the record's HGETALL} when the key is taken, else {1, token, lease, expiry}.
_CLAIM = (
    _NOW
    + """
local exp = redis.call('HGET', KEYS[1], 'exp')
if exp and tonumber(exp) > now then
  return {0, redis.call('HGETALL', KEYS[1])}
end
local tok = redis.call('INCR', KEYS[2])
local old = tonumber(redis.call('HGET', KEYS[1], 'tok') or '0')
if tok <= old then
  tok = old + 1
  redis.call('SET', KEYS[2], tok)
end
local lease, keep = f(now + tonumber(ARGV[3])), f(now + tonumber(ARGV[4]))
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'st', 'running', 'tok', tostring(tok),
  'lease', lease, 'exp', keep, 'ct', f(now))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return {1, tok, lease, keep}
"""
)

# KEYS: record, counter. ARGV: now, token, lease, counter_ms.
_TAKE_OVER = (
    _NOW
    + """
if not owned(ARGV[2]) or tonumber(redis.call('HGET', KEYS[1], 'lease')) > now then
  return false
end
local tok = redis.call('INCR', KEYS[2])
if tok <= tonumber(ARGV[2]) then
  tok = tonumber(ARGV[2]) + 1
  redis.call('SET', KEYS[2], tok)
end
redis.call('HSET', KEYS[1], 'tok', tostring(tok), 'lease', f(now + tonumber(ARGV[3])))
local lease_ms = math.ceil(tonumber(ARGV[3]) * 1000)
if redis.call('PTTL', KEYS[1]) < lease_ms then redis.call('PEXPIRE', KEYS[1], lease_ms) end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: record, counter. ARGV: now, token, retention, retention_ms, counter_ms, status,
# headers, body, replayable.
_COMPLETE = (
    _NOW
    + """
if not owned(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'st', 'completed', 'status', ARGV[6], 'headers', ARGV[7],
  'body', ARGV[8], 'rep', ARGV[9], 'exp', f(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""
)

# KEYS: record. ARGV: now, token.
_RELEASE = (
    _NOW
    + """
if not owned(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""
)

# KEYS: record. ARGV: now, token, lease.
_EXTEND = (
    _NOW
    + """
if not owned(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'lease', f(now + tonumber(ARGV[3])))
local lease_ms = math.ceil(tonumber(ARGV[3]) * 1000)
if redis.call('PTTL', KEYS[1]) < lease_ms then redis.call('PEXPIRE', KEYS[1], lease_ms) end
return 1
"""
)

# KEYS: one record. ARGV: now. Deletes it if its retention ended.
_PURGE = (
    _NOW
    + """
local exp = redis.call('HGET', KEYS[1], 'exp')
if exp and tonumber(exp) <= now then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

# KEYS: record, eviction marker. ARGV: token. Forgets the record an operator looked at
# (whatever its state) if it still has that token; the counter stays, so the next claim's token
# is larger (as after a release) and the evicted owner's fenced writes match nothing. The
# marker keeps the record's token and times, as released, for the rest of its TTL: what
# `retrysafe keys` shows of an evicted key (a second evict then says "released already").
_EVICT = """
local cur = redis.call('HMGET', KEYS[1], 'tok', 'lease', 'exp', 'ct')
if cur[1] ~= ARGV[1] then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
if ttl > 0 then
  redis.call('HSET', KEYS[2], 'st', 'released', 'tok', cur[1], 'lease', cur[2] or '0',
    'exp', cur[3] or '0')
  if cur[4] then redis.call('HSET', KEYS[2], 'ct', cur[4]) end
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
"""

_SCRIPTS = {
    "claim": _CLAIM,
    "take_over": _TAKE_OVER,
    "complete": _COMPLETE,
    "release": _RELEASE,
    "extend": _EXTEND,
    "purge": _PURGE,
    "evict": _EVICT,
}

#: The record fields a listing reads (everything but the body, whose size HSTRLEN gives).
_ENTRY_FIELDS = ("st", "fp", "tok", "lease", "exp", "ct", "status", "headers", "rep")

#: The SHA1 of each script, as EVALSHA names it (redis-py's Script computes the same).
_SHAS = {
    name: hashlib.sha1(src.encode(), usedforsecurity=False).hexdigest()
    for name, src in _SCRIPTS.items()
}

_STATES = {state.value: state for state in KeyState}
_SAFE_POLICIES = frozenset({"noeviction"})


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _record(key_hash: str, flat: Sequence[Any] | None) -> KeyRecord | None:
    if not flat:
        return None
    it = iter(flat)
    fields: dict[str, bytes] = {
        (k.decode() if isinstance(k, bytes) else str(k)): v for k, v in zip(it, it, strict=True)
    }
    return _from_fields(key_hash, fields)


def _decoded(fields: Mapping[Any, Any]) -> dict[str, bytes]:
    """HGETALL's answer as ``{str: bytes}`` (redis-py types it loosely as bytes | str)."""
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v if isinstance(v, bytes) else str(v).encode()
        )
        for k, v in fields.items()
    }


def _from_fields(key_hash: str, fields: dict[str, bytes]) -> KeyRecord | None:
    if "st" not in fields:
        return None
    state = _STATES[fields["st"].decode()]
    response = None
    if state is KeyState.COMPLETED and "status" in fields:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(fields["headers"] or b"[]"))
        response = StoredResponse(
            int(fields["status"]), pairs, bytes(fields["body"]), fields["rep"] == b"1"
        )
    return KeyRecord(
        key_hash=key_hash,
        fingerprint=fields["fp"].decode(),
        state=state,
        fencing_token=int(fields["tok"]),
        lease_expires_at=float(fields["lease"]),
        expires_at=float(fields["exp"]),
        response=response,
    )


def _entry(
    key_hash: str,
    fields: Mapping[str, bytes | None],
    *,
    now: float,
    body_size: int | None,
    body: bytes | None = None,
) -> KeyEntry | None:
    """A record's :class:`~retrysafe.stores._base.KeyEntry`, or None when it vanished (its
    TTL fired, it was released) between the scan and the read."""
    st = fields.get("st")
    if st is None:
        return None
    exp, created, status = fields.get("exp"), fields.get("ct"), fields.get("status")
    completed = st == b"completed" and status is not None
    return KeyEntry(
        key_hash=key_hash,
        state="expired" if float(exp or 0) <= now else st.decode(),
        fingerprint=(fields.get("fp") or b"").decode(),
        fencing_token=int(fields.get("tok") or 0),
        lease_expires_at=float(fields.get("lease") or 0),
        expires_at=float(exp or 0),
        created_at=None if created is None else float(created),
        status=int(status) if completed and status is not None else None,
        headers=tuple(
            (str(k), str(v)) for k, v in json.loads(fields.get("headers") or b"[]")
        )
        if completed
        else (),
        body_size=(body_size or 0) if completed else None,
        replayable=fields.get("rep") != b"0",
        body=body if completed else None,
    )


class _Call(NamedTuple):
    """One Redis request of an operation: run the Lua script ``script`` on ``keys`` with
    ``args``, or (``script`` None) read the record hash ``keys[0]``."""

    script: str | None
    keys: list[str]
    args: list[Any]


# The key store's primitives, written once: each is an operation (a generator of Redis requests,
# like the SQL stores' operations) that the sync store and its async face both drive.
_RedisOp = Generator[_Call, Any, _T]


def _claim(
    s: RedisStore, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
) -> _RedisOp[tuple[bool, KeyRecord]]:
    args = s._claim_args(fingerprint, now, lease, retention)
    reply = yield s._script("claim", key_hash, args, one_key=False)
    if reply[0]:  # {1, token, lease, expiry}
        return True, claimed_record(key_hash, fingerprint, *reply[1:])
    return False, cast(KeyRecord, _record(key_hash, reply[1]))


def _take_over(
    s: RedisStore, key_hash: str, fencing_token: int, *, now: float, lease: float
) -> _RedisOp[KeyRecord | None]:
    args = s._take_over_args(fencing_token, now, lease)
    return _record(key_hash, (yield s._script("take_over", key_hash, args, one_key=False)))


def _complete(
    s: RedisStore,
    key_hash: str,
    fencing_token: int,
    response: StoredResponse,
    *,
    now: float,
    retention: float,
) -> _RedisOp[bool]:
    args = s._complete_args(fencing_token, response, now, retention)
    return bool((yield s._script("complete", key_hash, args, one_key=False)) == 1)


def _release(s: RedisStore, key_hash: str, fencing_token: int) -> _RedisOp[bool]:
    return bool((yield s._script("release", key_hash, ["", fencing_token], one_key=True)) == 1)


def _extend_lease(
    s: RedisStore, key_hash: str, fencing_token: int, *, now: float, lease: float
) -> _RedisOp[bool]:
    args = [s._now(now), fencing_token, lease]
    return bool((yield s._script("extend", key_hash, args, one_key=True)) == 1)


def _get(s: RedisStore, key_hash: str) -> _RedisOp[KeyRecord | None]:
    fields = yield _Call(None, s._keys(key_hash)[:1], [])
    return _from_fields(key_hash, _decoded(fields))


def _sync(
    fn: Callable[Concatenate[RedisStore, _P], _RedisOp[_T]],
) -> Callable[Concatenate[RedisStore, _P], _T]:
    def method(self: RedisStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return drive(fn(self, *args, **kwargs), self._execute)

    method.__name__ = fn.__name__.lstrip("_")
    return method


def _async(
    fn: Callable[Concatenate[RedisStore, _P], _RedisOp[_T]],
) -> Callable[Concatenate[AsyncRedisKeys, _P], Coroutine[Any, Any, _T]]:
    async def method(self: AsyncRedisKeys, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await adrive(fn(self._s, *args, **kwargs), self._execute)

    method.__name__ = fn.__name__.lstrip("_")
    return method


class RedisStore:
    """Redis-backed :class:`~retrysafe.stores.KeyStore` (and its async face).

    Concurrency contract: see :class:`~retrysafe.stores.KeyStore`; every primitive is one Lua
    script, atomic on the Redis server (on a cluster: on the master of the key's slot). Fencing
    tokens of a key hash grow even across expiry (the counter key outlives the record by
    ``token_ttl``).

    Args:
        url: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS) for one server;
            ``redis+cluster://[:password@]host:port[,host:port…]`` or ``rediss+cluster://``
            for a Redis Cluster (any reachable node is enough to discover the others; see
            :func:`~retrysafe.stores._url_check.parse_cluster_url`). A cluster client reads
            the slot map when it is created, so an unreachable cluster raises
            :class:`~retrysafe.StoreUnavailableError` even with ``check=False``.
        prefix: prepended to every key this store writes (default ``"retrysafe:"``); on a
            cluster it must not contain ``{`` or ``}`` (they would change the hash tag).
        clock: ``"server"`` (default): leases and retention use Redis's ``TIME`` and every
            ``now`` argument is ignored; ``"caller"``: the ``now`` arguments are used (tests).
        token_ttl: seconds the fencing-token counter outlives its record (default 7 days).
        socket_timeout: seconds to wait for a connection or an answer before raising
            :class:`~retrysafe.StoreUnavailableError`.
        check: at startup PING the server and check its eviction policy (default True).

    Raises:
        ConfigurationError: a malformed URL (for a cluster also: no host, a bad port, a
            database other than 0) or bad option.
        StoreUnavailableError: the server (a cluster: every startup node) cannot be reached
            or refuses the login (the message names host and port, never the password).
        StoreError: a ``redis+cluster://`` URL names a server without cluster support.

    Warns:
        RetrysafeWarning: ``maxmemory-policy`` lets Redis (any cluster master) evict our keys
            (see :meth:`check_eviction`); a ``redis://`` URL names a cluster node (keys of
            other nodes' slots would fail: use ``redis+cluster://``).
    """

    dialect = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "retrysafe:",
        clock: Clock = "server",
        token_ttl: float = 7 * 86400.0,
        socket_timeout: float = 5.0,
        check: bool = True,
    ) -> None:
        if clock not in ("server", "caller"):
            raise ConfigurationError("clock must be 'server' or 'caller'", option="clock")
        if token_ttl < 0:
            raise ConfigurationError("token_ttl must be >= 0 seconds", option="token_ttl")
        self.prefix = prefix
        self.clock: Clock = clock
        self.token_ttl = token_ttl
        self._url = url
        self._options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
        }
        self._closed = False
        #: Whether this store talks to a Redis Cluster (``redis+cluster://``).
        self.cluster = url.partition("://")[0].lower() in CLUSTER_SCHEMES
        self._r: SyncClient
        self._nodes: tuple[tuple[str, int], ...] = ()  # a cluster's startup nodes
        if self.cluster:
            if "{" in prefix or "}" in prefix:
                raise ConfigurationError(
                    f"prefix {prefix!r} contains a brace: on a Redis Cluster the braces "
                    "around the key hash are the hash tag that keeps a record and its "
                    "fencing-token counter in one slot",
                    option="prefix",
                )
            parsed = parse_cluster_url(url)
            self._password: str | None = parsed.password
            self.where = parsed.where
            login: dict[str, Any] = {"username": parsed.username, "password": parsed.password}
            if parsed.tls:
                login["ssl"] = True
            self._options.update(login)
            self._nodes = parsed.nodes
            node: Any = redis.cluster.ClusterNode  # untyped in redis-py
            nodes = [node(h, p) for h, p in parsed.nodes]
            self._r = self._call(
                redis.cluster.RedisCluster, startup_nodes=nodes, **self._options
            )
        else:
            check_redis_url(url)
            try:
                self._r = redis.Redis.from_url(url, **self._options)
            except ValueError as exc:
                raise ConfigurationError(f"malformed Redis URL: {exc}", option="store") from exc
            kw = self._r.connection_pool.connection_kwargs
            self._password = kw.get("password")
            self.where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
        self._scripts: dict[str, Script] = {
            name: self._r.register_script(src) for name, src in _SCRIPTS.items()
        }
        #: The lean transport's connection options, or None when redis-py serves the async
        #: face (a cluster, TLS, other options, or no hiredis).
        self._wire_options: dict[str, Any] | None = None
        if not self.cluster and wire_options is not None:
            self._wire_options = wire_options(url)
        if check:
            try:
                self._call(self._r.ping)
            except TypeError as exc:  # redis-py takes URL query options as connection kwargs
                self._r.close()
                raise ConfigurationError(
                    f"Redis URL {redact_url(url)!r} has an option redis-py does not know "
                    f"({exc}); retrysafe's own options (prefix, …) are arguments of "
                    "RedisStore or command-line flags (--prefix), not URL options",
                    option="store",
                ) from None
            if not self.cluster:
                self._warn_if_cluster_node()
            self.check_eviction()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

    @property
    def url(self) -> str:
        """The URL without the password."""
        scheme = self._url.split("://", 1)[0]
        return f"{scheme}://{self.where}"

    # ------------------------------------------------------------------ helpers
    def _keys(self, key_hash: str) -> list[str]:
        return [f"{self.prefix}k:{{{key_hash}}}", f"{self.prefix}t:{{{key_hash}}}"]

    def _marker(self, key_hash: str) -> str:
        """The name of ``key_hash``'s eviction marker (see the module's layout)."""
        return f"{self.prefix}e:{{{key_hash}}}"

    def _now(self, now: float) -> str:
        return repr(float(now)) if self.clock == "caller" else ""

    def _translate(self, exc: Exception) -> StoreError:
        """The one place where redis-py's errors (one server or a cluster, sync or async)
        become retrysafe's: :class:`~retrysafe.StoreUnavailableError` for anything that heals
        by itself (the middleware answers 503 ``store-unavailable``), else
        :class:`~retrysafe.StoreError`. The password never appears in the message."""
        msg = str(exc)
        if self._password:
            msg = msg.replace(self._password, "***")
        what = f"Redis {'Cluster ' if self.cluster else ''}store at {self.where}"
        if isinstance(exc, AskError) and not self.cluster:  # MovedError is an AskError
            return StoreError(
                f"{what} failed: {msg} (the server is a Redis Cluster node: use "
                "redis+cluster://host:port)",
                store=self.url,
            )
        if isinstance(exc, _UNAVAILABLE):
            kind = "refused the login" if isinstance(exc, redis.AuthenticationError) else ""
            return StoreUnavailableError(
                f"{what} unavailable{': ' + kind if kind else ''}: {msg}", store=self.url
            )
        if isinstance(exc, RedisClusterException) and "cluster mode is not enabled" in (
            msg.lower()
        ):
            return StoreError(
                f"{what} is not a Redis Cluster (cluster support is disabled on the node): "
                "use redis://host:port/db for one server",
                store=self.url,
            )
        if isinstance(exc, RedisClusterException) and any(
            text in msg for text in _UNREACHABLE_CLUSTER
        ):
            return StoreUnavailableError(f"{what} unavailable: {msg}", store=self.url)
        if isinstance(exc, redis.ResponseError) and (
            "NOAUTH" in msg or "WRONGPASS" in msg or "READONLY" in msg or "OOM" in msg
        ):
            return StoreUnavailableError(f"{what} unavailable: {msg}", store=self.url)
        return StoreError(f"{what} failed: {msg}", store=self.url)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        try:
            return fn(*args, **kwargs)
        except (redis.RedisError, RedisClusterException) as exc:
            raise self._translate(exc) from exc

    def _script(self, name: str, key_hash: str, args: Sequence[Any], *, one_key: bool) -> _Call:
        """The request that runs script ``name`` on ``key_hash``'s record (and, unless
        ``one_key``, its fencing-token counter: both keys hash to one slot)."""
        keys = self._keys(key_hash)
        return _Call(name, keys[:1] if one_key else keys, list(args))

    def _masters(self) -> list[tuple[str, redis.Redis]]:
        """``(host:port, client)`` of every master: the server itself, or each cluster
        master's own connection (a cluster ``SCAN`` or ``CONFIG`` must visit every master)."""
        r = self._r
        if isinstance(r, redis.cluster.RedisCluster):
            return [
                (f"{node.host}:{node.port}", self._call(r.get_redis_connection, node))
                for node in self._call(r.get_primaries)
            ]
        return [(self.where, r)]

    def _async_client(self) -> AsyncClient:
        """A new ``redis.asyncio`` client for the same server or cluster."""
        if self.cluster:
            nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in self._nodes]
            return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, **self._options)
        return redis.asyncio.Redis.from_url(self._url, **self._options)

    def _warn_if_cluster_node(self) -> None:
        try:
            info = self._r.info("cluster")
        except redis.ResponseError:
            return  # INFO renamed/disabled: cannot check
        except redis.RedisError as exc:
            raise self._translate(exc) from exc
        if info.get("cluster_enabled") in (1, "1"):
            warnings.warn(
                f"Redis at {self.where} is a Redis Cluster node: keys whose slots live on "
                "other nodes will fail (MOVED). Use redis+cluster://host:port[,host:port…].",
                RetrysafeWarning,
                stacklevel=3,
            )

    def check_eviction(self) -> str | None:
        """Warn (:class:`~retrysafe.RetrysafeWarning`) when ``maxmemory-policy`` may evict
        our keys — on a cluster, checked on every master, and the warning names it; return
        the policy (on a cluster: the first unsafe one, else ``"noeviction"``), or None when
        ``CONFIG`` is disabled (not an error).

        Every record carries a TTL, so ``volatile-*`` policies can evict it just like
        ``allkeys-*``: an evicted record is a forgotten key, and its repeat runs the handler
        again (a duplicate). Only ``noeviction`` is safe.
        """
        found: list[str] = []
        for where, client in self._masters():
            try:
                got = client.config_get("maxmemory-policy")
            except redis.ResponseError:
                continue  # CONFIG renamed/disabled (managed Redis): cannot check
            except redis.RedisError as exc:
                raise self._translate(exc) from exc
            policy = _warn_policy(got, where)
            if policy is not None:
                found.append(policy)
        unsafe = [p for p in found if p not in _SAFE_POLICIES]
        return next(iter(unsafe or found), None)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection pool. Idempotent."""
        if not self._closed:
            self._closed = True
            self._r.close()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def asyncio_key_store(self) -> AsyncRedisKeys:
        """A new async face (its own ``redis.asyncio`` client; close it with ``aclose()``)."""
        return AsyncRedisKeys(self)

    # ------------------------------------------------------------------ KeyStore
    def _claim_args(
        self, fingerprint: str, now: float, lease: float, retention: float
    ) -> list[Any]:
        return [
            self._now(now),
            fingerprint,
            lease,
            retention,
            _ms(retention),
            _ms(retention + self.token_ttl),
        ]

    def _complete_args(
        self, token: int, response: StoredResponse, now: float, retention: float
    ) -> list[Any]:
        return [
            self._now(now),
            token,
            retention,
            _ms(retention),
            _ms(retention + self.token_ttl),
            response.status,
            headers_json(response.headers),
            response.body,
            "1" if response.replayable else "0",
        ]

    def _take_over_args(self, token: int, now: float, lease: float) -> list[Any]:
        return [self._now(now), token, lease, _ms(lease + self.token_ttl)]

    def _execute(self, call: _Call) -> Any:
        """Run one request of an operation on the sync client."""
        if call.script is None:
            return self._call(self._r.hgetall, call.keys[0])
        return self._call(self._scripts[call.script], keys=call.keys, args=call.args)

    claim = _sync(_claim)
    take_over = _sync(_take_over)
    complete = _sync(_complete)
    release = _sync(_release)
    extend_lease = _sync(_extend_lease)
    get = _sync(_get)

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        """Delete records (and eviction markers) whose ``exp`` passed. Redis's native TTL
        already drops expired ones by itself; this sweep (``SCAN`` in batches of ``batch``, one
        script per key,
        pipelined; on a cluster on every master in turn) catches records whose ``exp`` passed
        before their TTL fired. A slot migrating during the sweep makes it raise
        :class:`~retrysafe.StoreUnavailableError`; run it again later."""
        if batch < 1:
            raise ConfigurationError("batch must be >= 1", option="batch")
        total = 0
        match = f"{_glob_escape(self.prefix)}[ke]:*"  # records and eviction markers
        arg = self._now(now)
        for _, client in self._masters():  # a cluster: every master holds its own slots
            cursor: int = 0
            while True:
                cursor, keys = self._call(client.scan, cursor, match=match, count=batch)
                if keys:
                    pipe = client.pipeline(transaction=False)
                    for key in keys:
                        self._scripts["purge"](keys=[key], args=[arg], client=pipe)
                    total += sum(int(x) for x in self._call(pipe.execute))
                if cursor == 0:
                    break
        return total

    # ------------------------------------------------------------------ KeyAdmin
    def _store_now(self, now: float) -> float:
        """``now`` on this store's clock: the caller's, or Redis's ``TIME``."""
        if self.clock == "caller":
            return float(now)
        client = self._masters()[0][1]
        seconds, micros = self._call(client.time)
        return float(seconds) + float(micros) / 1_000_000

    def _hash_of(self, name: bytes | str) -> tuple[str, bool] | None:
        """The key hash in the name of a record (``{prefix}k:{<hash>}``) or of an eviction
        marker (``{prefix}e:{<hash>}``), and whether it is the record; None when the name is
        neither of this store's (another prefix that starts like ours)."""
        text = name.decode() if isinstance(name, bytes) else name
        for kind in ("k", "e"):
            head = f"{self.prefix}{kind}:{{"
            inner = text[len(head) : -1]
            if text.startswith(head) and text.endswith("}") and _is_hash(inner):
                return inner, kind == "k"
        return None

    def _scan(self, match: str, *, body: bool, now: float) -> list[KeyEntry]:
        """Every record (or, for a key hash without one, eviction marker) whose name matches
        ``match`` (``SCAN`` on every master, in batches, each batch read in one pipelined
        round trip)."""
        found: dict[str, tuple[bool, KeyEntry]] = {}
        for _, client in self._masters():
            cursor: int = 0
            while True:
                cursor, names = self._call(client.scan, cursor, match=match, count=1000)
                hashes = [(n, h) for n in names if (h := self._hash_of(n)) is not None]
                if hashes:
                    pipe = client.pipeline(transaction=False)
                    for name, _ in hashes:
                        pipe.hmget(name, _ENTRY_FIELDS)
                        pipe.hstrlen(name, "body")
                        if body:
                            pipe.hget(name, "body")
                    replies = self._call(pipe.execute)
                    step = 3 if body else 2
                    for i, (_, (key_hash, is_record)) in enumerate(hashes):
                        values, size = replies[i * step], replies[i * step + 1]
                        entry = _entry(
                            key_hash,
                            dict(zip(_ENTRY_FIELDS, values, strict=True)),
                            now=now,
                            body_size=int(size),
                            body=replies[i * step + 2] if body else None,
                        )
                        # A record is what its key reads as; a marker only stands in for
                        # an evicted record that was not claimed again.
                        if entry is not None and (is_record or key_hash not in found):
                            found[key_hash] = (is_record, entry)
                if cursor == 0:
                    break
        return [entry for _, entry in found.values()]

    def list_keys(
        self,
        *,
        now: float,
        limit: int = 100,
        states: Collection[str] | None = None,
        after: KeyEntry | KeyPosition | None = None,
    ) -> list[KeyEntry]:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.list_keys`: ``SCAN`` of this store's
        prefix on every master (never ``KEYS``), each batch read in one pipelined round
        trip, sorted in the client. A record its owner released is gone on Redis; an
        evicted one is ``"released"`` (its marker) until its retention ends."""
        wanted = listed_states(states, limit)
        entries = self._scan(
            f"{_glob_escape(self.prefix)}[ke]:*", body=False, now=self._store_now(now)
        )
        return page_of(entries, limit=limit, states=wanted, after=after)

    def find_keys(self, prefix: str, *, now: float, limit: int = 2) -> list[KeyEntry]:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.find_keys`: a whole hash is one
        ``HGETALL`` (of the record, else of its eviction marker); a shorter prefix (hex
        digits only: no glob character can reach the pattern) is a ``SCAN`` of the prefix's
        records and markers."""
        check_limit(limit)
        if not prefix or not _is_hash(prefix, whole=False):
            return []
        at = self._store_now(now)
        if len(prefix) == 64:
            for name in (self._keys(prefix)[0], self._marker(prefix)):
                fields = _decoded(self._call(self._r.hgetall, name))
                body = fields.get("body")
                entry = _entry(
                    prefix,
                    fields,
                    now=at,
                    body_size=None if body is None else len(body),
                    body=body,
                )
                if entry is not None:
                    return [entry]
            return []
        match = f"{_glob_escape(self.prefix)}[ke]:{{{prefix}*"
        found = self._scan(match, body=True, now=at)
        return sorted(found, key=lambda e: e.key_hash)[:limit]

    def evict(self, key_hash: str, fencing_token: int) -> bool:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.evict`: one script (``DEL`` if the
        token still matches, leaving the eviction marker; the token counter stays)."""
        keys = [self._keys(key_hash)[0], self._marker(key_hash)]
        return bool(self._execute(_Call("evict", keys, [fencing_token])) == 1)


def _is_hash(text: str, *, whole: bool = True) -> bool:
    """Is ``text`` a key hash (64 lower-case hex digits) or, unless ``whole``, a start of one?"""
    return (len(text) == 64 or not whole) and len(text) <= 64 and set(text) <= _HEX


_HEX = frozenset("0123456789abcdef")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _warn_policy(got: Any, where: str) -> str | None:
    raw = got.get(b"maxmemory-policy", got.get("maxmemory-policy")) if got else None
    if raw is None:
        return None
    policy = raw.decode() if isinstance(raw, bytes) else str(raw)
    if policy not in _SAFE_POLICIES:
        warnings.warn(
            f"Redis at {where} has maxmemory-policy={policy}: under memory pressure Redis "
            "may EVICT idempotency keys (every retrysafe key has a TTL, so volatile-* "
            "policies can evict them too), and a forgotten key lets a retry run the handler "
            "again — duplicate effects. Set `maxmemory-policy noeviction` (Redis then "
            "refuses writes when full, which retrysafe answers with 503).",
            RetrysafeWarning,
            stacklevel=4,
        )
    return policy


class AsyncRedisKeys:
    """The async face of :class:`RedisStore` (:class:`~retrysafe.stores.AsyncKeyStore`): the
    same scripts on a ``redis.asyncio`` client (a cluster's: ``redis.asyncio.cluster``),
    created in the event loop that first uses it (a new one for another loop). Close it with
    :meth:`aclose`."""

    def __init__(self, store: RedisStore) -> None:
        self._s = store
        self._client: AsyncClient | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._wire: RedisWire | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _ready(self) -> tuple[AsyncClient, dict[str, AsyncScript]]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            client = self._s._async_client()
            self._client, self._loop = client, loop
            self._scripts = {n: client.register_script(src) for n, src in _SCRIPTS.items()}
        client = self._client
        if isinstance(client, redis.asyncio.cluster.RedisCluster):
            # An asyncio cluster client must be initialised before its first commands
            # (redis-py #3032): commands issued at once on a new client race its lazy
            # start-up (redis-py 8.1: AttributeError in send_packed_command, which would
            # escape as a 500). A no-op once done; after a node failure redis-py marks the
            # client for it again, and this re-reads the slot map under redis-py's own lock.
            await self._await(client.initialize())
        return client, self._scripts

    async def _await(self, aw: Awaitable[_T]) -> _T:
        try:
            return await aw
        except (redis.RedisError, RedisClusterException) as exc:
            raise self._s._translate(exc) from exc

    async def _execute(self, call: _Call) -> Any:
        """Run one request of an operation: on the lean transport when it serves this
        store's URL, else on the ``redis.asyncio`` client."""
        wire = self._wire
        if wire is None or self._loop is not asyncio.get_running_loop():
            if self._s._wire_options is None:
                client, scripts = await self._ready()
                if call.script is None:
                    return await self._await(client.hgetall(call.keys[0]))
                return await self._await(scripts[call.script](keys=call.keys, args=call.args))
            wire = self._wire_of_this_loop()
        try:
            keys = call.keys
            if call.script is None:
                flat = await wire.call(("HGETALL", keys[0]))
                it = iter(flat)
                return dict(zip(it, it, strict=True))
            try:
                sha = _SHAS[call.script]
                return await wire.call(("EVALSHA", sha, len(keys), *keys, *call.args))
            except NoScriptError:  # the server's script cache was flushed: send the script
                src = _SCRIPTS[call.script]
                return await wire.call(("EVAL", src, len(keys), *keys, *call.args))
        except redis.RedisError as exc:
            raise self._s._translate(exc) from exc

    def _wire_of_this_loop(self) -> RedisWire:
        """A new lean transport for the running event loop (see :mod:`._redis_wire`)."""
        assert RedisWire is not None and self._s._wire_options is not None
        options = self._s._options
        wire = RedisWire(
            self._s._wire_options,
            timeout=options["socket_timeout"],
            connect_timeout=options["socket_connect_timeout"],
        )
        self._wire, self._loop = wire, asyncio.get_running_loop()
        return wire

    async def aclose(self) -> None:
        """Close this face's client. Idempotent."""
        wire, self._wire = self._wire, None
        if wire is not None:
            await wire.aclose()
        client, self._client = self._client, None
        if client is not None:
            # aclose() since redis 5; close() before (and in older type stubs).
            closer = getattr(client, "aclose", None) or client.close
            await closer()

    claim = _async(_claim)
    take_over = _async(_take_over)
    complete = _async(_complete)
    release = _async(_release)
    extend_lease = _async(_extend_lease)
    get = _async(_get)
