"""The Redis key store: a low-latency key store for the middleware (SPEC §9).

Layout (``prefix`` defaults to ``"retrysafe:"``; the raw idempotency key is never stored, only
its SHA-256 ``key_hash``):

* ``{prefix}k:{<key_hash>}`` — a hash per record: ``fp``, ``st`` (running/completed), ``tok``,
  ``lease``, ``exp`` (Unix seconds), and once completed ``status``, ``headers`` (JSON),
  ``body``, ``rep``. It carries a native TTL (``PEXPIRE``) of the retention, so Redis drops
  expired keys by itself; ``purge_keys`` only sweeps records whose ``exp`` passed early.
* ``{prefix}t:{<key_hash>}`` — the key hash's fencing-token counter (``INCR``). It outlives the
  record by ``token_ttl`` seconds (default 7 days), so a key claimed again after its record
  expired still gets a larger token than any owner that might still be running. The braces are
  a hash tag: both keys sit in one cluster slot, so the scripts may touch both.

Every primitive is one Lua script (registered once, run with ``EVALSHA``), so claims and the
fenced complete/release/take-over/extend are atomic on the server.

Clock: by default (``clock="server"``) the scripts read Redis's ``TIME`` and ignore every
``now`` argument; ``clock="caller"`` honours ``now`` (the contract tests drive time by hand).

Durability is Redis's: with ``appendonly yes`` + ``appendfsync everysec`` a crash of the Redis
host can lose about the last second of claims and completions; with no AOF (RDB snapshots or
nothing) a restart loses everything since the last snapshot. A lost record is a forgotten key:
its repeat runs the handler again. Eviction is worse — see :meth:`RedisStore.check_eviction`.

redis-py is imported only when this module is (``pip install retrysafe[redis]``).
"""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import redis
import redis.asyncio
from redis.commands.core import AsyncScript, Script

from retrysafe._exceptions import (
    ConfigurationError,
    RetrysafeWarning,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import KeyRecord, KeyState, StoredResponse

__all__ = ["RedisStore"]

_T = TypeVar("_T")
Clock = Literal["server", "caller"]

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
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'st', 'running', 'tok', tostring(tok),
  'lease', f(now + tonumber(ARGV[3])), 'exp', f(now + tonumber(ARGV[4])))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return {1, redis.call('HGETALL', KEYS[1])}
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

_SCRIPTS = {
    "claim": _CLAIM,
    "take_over": _TAKE_OVER,
    "complete": _COMPLETE,
    "release": _RELEASE,
    "extend": _EXTEND,
    "purge": _PURGE,
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


class RedisStore:
    """Redis-backed :class:`~retrysafe.stores.KeyStore` (and its async face).

    Concurrency contract: see :class:`~retrysafe.stores.KeyStore`; every primitive is one Lua
    script, atomic on the Redis server. Fencing tokens of a key hash grow even across expiry
    (the counter key outlives the record by ``token_ttl``).

    Args:
        url: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS).
        prefix: prepended to every key this store writes (default ``"retrysafe:"``).
        clock: ``"server"`` (default): leases and retention use Redis's ``TIME`` and every
            ``now`` argument is ignored; ``"caller"``: the ``now`` arguments are used (tests).
        token_ttl: seconds the fencing-token counter outlives its record (default 7 days).
        socket_timeout: seconds to wait for a connection or an answer before raising
            :class:`~retrysafe.StoreUnavailableError`.
        check: at startup PING the server and check its eviction policy (default True).

    Raises:
        ConfigurationError: a malformed URL or bad option.
        StoreUnavailableError: the server cannot be reached or refuses the login (the message
            names host and port, never the password).

    Warns:
        RetrysafeWarning: ``maxmemory-policy`` lets Redis evict our keys (see
            :meth:`check_eviction`).
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
        try:
            self._r: redis.Redis = redis.Redis.from_url(url, **self._options)
        except ValueError as exc:
            raise ConfigurationError(f"malformed Redis URL: {exc}", option="store") from exc
        kw = self._r.connection_pool.connection_kwargs
        self._password: str | None = kw.get("password")
        self.where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
        self._scripts: dict[str, Script] = {
            name: self._r.register_script(src) for name, src in _SCRIPTS.items()
        }
        self._closed = False
        if check:
            self._call(self._r.ping)
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

    def _now(self, now: float) -> str:
        return repr(float(now)) if self.clock == "caller" else ""

    def _translate(self, exc: Exception) -> StoreError:
        msg = str(exc)
        if self._password:
            msg = msg.replace(self._password, "***")
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError | redis.BusyLoadingError):
            kind = "refused the login" if isinstance(exc, redis.AuthenticationError) else ""
            return StoreUnavailableError(
                f"Redis store at {self.where} unavailable{': ' + kind if kind else ''}: {msg}",
                store=self.url,
            )
        if isinstance(exc, redis.ResponseError) and (
            "NOAUTH" in msg or "WRONGPASS" in msg or "READONLY" in msg or "OOM" in msg
        ):
            return StoreUnavailableError(
                f"Redis store at {self.where} unavailable: {msg}", store=self.url
            )
        return StoreError(f"Redis store at {self.where} failed: {msg}", store=self.url)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise StoreError(f"{self!r} is closed", store=self.url)
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as exc:
            raise self._translate(exc) from exc

    def _run(self, name: str, key_hash: str, args: Sequence[Any], *, one_key: bool) -> Any:
        keys = self._keys(key_hash)[:1] if one_key else self._keys(key_hash)
        return self._call(self._scripts[name], keys=keys, args=list(args))

    def check_eviction(self) -> str | None:
        """Warn (:class:`~retrysafe.RetrysafeWarning`) when ``maxmemory-policy`` may evict
        our keys; return the policy, or None when ``CONFIG`` is disabled (not an error).

        Every record carries a TTL, so ``volatile-*`` policies can evict it just like
        ``allkeys-*``: an evicted record is a forgotten key, and its repeat runs the handler
        again (a duplicate). Only ``noeviction`` is safe.
        """
        try:
            got = self._r.config_get("maxmemory-policy")
        except redis.ResponseError:
            return None  # CONFIG renamed/disabled (managed Redis): cannot check
        except redis.RedisError as exc:
            raise self._translate(exc) from exc
        return _warn_policy(got, self.where)

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
        keep = max(retention, lease)
        return [self._now(now), fingerprint, lease, keep, _ms(keep), _ms(keep + self.token_ttl)]

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
            json.dumps([list(p) for p in response.headers]),
            response.body,
            "1" if response.replayable else "0",
        ]

    def _take_over_args(self, token: int, now: float, lease: float) -> list[Any]:
        return [self._now(now), token, lease, _ms(lease + self.token_ttl)]

    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        args = self._claim_args(fingerprint, now, lease, retention)
        claimed, flat = self._run("claim", key_hash, args, one_key=False)
        return bool(claimed), cast(KeyRecord, _record(key_hash, flat))

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        args = self._take_over_args(fencing_token, now, lease)
        return _record(key_hash, self._run("take_over", key_hash, args, one_key=False))

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        args = self._complete_args(fencing_token, response, now, retention)
        return bool(self._run("complete", key_hash, args, one_key=False) == 1)

    def release(self, key_hash: str, fencing_token: int) -> bool:
        return bool(self._run("release", key_hash, ["", fencing_token], one_key=True) == 1)

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        args = [self._now(now), fencing_token, lease]
        return bool(self._run("extend", key_hash, args, one_key=True) == 1)

    def get(self, key_hash: str) -> KeyRecord | None:
        fields = self._call(self._r.hgetall, self._keys(key_hash)[0])
        return _from_fields(key_hash, _decoded(fields))

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        """Delete records whose ``exp`` passed. Redis's native TTL already drops expired
        records by itself; this sweep (``SCAN`` in batches of ``batch``, one script per key,
        pipelined) catches records whose ``exp`` passed before their TTL fired."""
        if batch < 1:
            raise ConfigurationError("batch must be >= 1", option="batch")
        total = 0
        match = f"{_glob_escape(self.prefix)}k:*"
        cursor: int = 0
        arg = self._now(now)
        while True:
            cursor, keys = self._call(self._r.scan, cursor, match=match, count=batch)
            if keys:
                pipe = self._r.pipeline(transaction=False)
                for key in keys:
                    self._scripts["purge"](keys=[key], args=[arg], client=pipe)
                total += sum(int(x) for x in self._call(pipe.execute))
            if cursor == 0:
                return total


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
    same scripts on a ``redis.asyncio`` client, created in the event loop that first uses it
    (a new one for another loop). Close it with :meth:`aclose`."""

    def __init__(self, store: RedisStore) -> None:
        self._s = store
        self._client: redis.asyncio.Redis | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get(self) -> dict[str, AsyncScript]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            client = redis.asyncio.Redis.from_url(self._s._url, **self._s._options)
            self._client, self._loop = client, loop
            self._scripts = {n: client.register_script(src) for n, src in _SCRIPTS.items()}
        return self._scripts

    async def _await(self, aw: Awaitable[_T]) -> _T:
        try:
            return await aw
        except redis.RedisError as exc:
            raise self._s._translate(exc) from exc

    async def _run(self, name: str, key_hash: str, args: Sequence[Any], *, one_key: bool) -> Any:
        keys = self._s._keys(key_hash)
        return await self._await(
            self._get()[name](keys=keys[:1] if one_key else keys, args=list(args))
        )

    async def aclose(self) -> None:
        """Close this face's client. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            # aclose() since redis 5; close() before (and in older type stubs).
            closer = getattr(client, "aclose", None) or client.close
            await closer()

    async def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        args = self._s._claim_args(fingerprint, now, lease, retention)
        claimed, flat = await self._run("claim", key_hash, args, one_key=False)
        return bool(claimed), cast(KeyRecord, _record(key_hash, flat))

    async def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        args = self._s._take_over_args(fencing_token, now, lease)
        return _record(key_hash, await self._run("take_over", key_hash, args, one_key=False))

    async def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        args = self._s._complete_args(fencing_token, response, now, retention)
        return bool(await self._run("complete", key_hash, args, one_key=False) == 1)

    async def release(self, key_hash: str, fencing_token: int) -> bool:
        done = await self._run("release", key_hash, ["", fencing_token], one_key=True)
        return bool(done == 1)

    async def extend_lease(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> bool:
        args = [self._s._now(now), fencing_token, lease]
        return bool(await self._run("extend", key_hash, args, one_key=True) == 1)

    async def get(self, key_hash: str) -> KeyRecord | None:
        self._get()
        assert self._client is not None
        fields = await self._await(self._client.hgetall(self._s._keys(key_hash)[0]))
        return _from_fields(key_hash, _decoded(fields))
