"""The Redis key store's async face on its lean transport (SPEC §9, ``stores/_redis_wire.py``):
one pipelined connection per event loop that keeps every promise of the key-store contract
(tests/stores/test_key_store_contract.py runs the contract on it) and fails and heals like the
redis-py client it replaces: a flushed script cache, a killed connection, a cancelled caller,
a refused login."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from retrysafe import StoreUnavailableError
from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores import RedisStore, _redis

hiredis = pytest.importorskip("hiredis")
from retrysafe.stores._redis_wire import RedisWire, wire_options  # noqa: E402

pytestmark = pytest.mark.anyio
RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')


@pytest.fixture
async def face(redis_url: str, redis_prefix: str) -> AsyncIterator[Any]:
    """The async face of a RedisStore on the caller's clock (tests drive ``now``)."""
    store = RedisStore(redis_url, prefix=redis_prefix, clock="caller", socket_timeout=2.0)
    face = store.asyncio_key_store()
    yield face
    await face.aclose()
    store.close()


def _admin(redis_url: str) -> Any:
    import redis

    return redis.Redis.from_url(redis_url)


def test_plain_urls_get_the_lean_transport_and_the_rest_redis_py() -> None:
    """redis:// with host, port, db, user and password is served by the lean transport;
    TLS, Unix sockets and any other connection option stay with redis-py."""
    assert wire_options("redis://127.0.0.1:6379/0") == {"host": "127.0.0.1", "port": 6379, "db": 0}
    assert wire_options("redis://u:p@h:7/3") == {
        "username": "u", "password": "p", "host": "h", "port": 7, "db": 3
    }  # fmt: skip
    assert wire_options("rediss://h:6379/0") is None
    assert wire_options("unix:///tmp/redis.sock") is None
    assert wire_options("redis://h:6379/0?socket_keepalive=true") is None
    assert wire_options("redis://h:6379/0?protocol=3") is None


async def test_the_async_face_runs_on_the_lean_transport(face: Any) -> None:
    """A plain redis:// store's async face talks over one RedisWire per event loop."""
    await face.get("absent")
    assert isinstance(face._wire, RedisWire)
    first = face._wire
    await face.get("absent")
    assert face._wire is first


async def test_claims_pipelined_on_one_connection_keep_the_contract(face: Any) -> None:
    """200 claims issued at once travel pipelined on one connection: every distinct key is
    claimed once, and of 20 claims of one key exactly one wins."""
    now = time.time()
    distinct = await asyncio.gather(
        *(face.claim(f"k{i}", "fp", now=now, lease=10, retention=60) for i in range(180))
    )
    same = await asyncio.gather(
        *(face.claim("one", "fp", now=now, lease=10, retention=60) for _ in range(20))
    )
    assert all(claimed for claimed, _ in distinct)
    assert sum(claimed for claimed, _ in same) == 1
    winner = next(record for claimed, record in same if claimed)
    assert all(record.fencing_token == winner.fencing_token for _, record in same)


async def test_a_flushed_script_cache_is_refilled_by_the_next_call(
    face: Any, redis_url: str
) -> None:
    """After SCRIPT FLUSH (a restarted or failed-over server), each script is sent once with
    EVAL and the key works as before: claim, complete, replay."""
    now = time.time()
    admin = _admin(redis_url)
    try:
        admin.script_flush()
        claimed, record = await face.claim("h", "fp", now=now, lease=10, retention=60)
        assert claimed and record.fencing_token == 1
        admin.script_flush()
        assert await face.complete("h", 1, RESPONSE, now=now, retention=60)
        sha = _redis._SHAS["complete"]
        assert admin.script_exists(sha) == [True]
    finally:
        admin.close()
    stored = await face.get("h")
    assert stored is not None and stored.state is KeyState.COMPLETED
    assert stored.response == RESPONSE


async def test_a_killed_connection_fails_as_unavailable_then_heals(
    face: Any, redis_url: str
) -> None:
    """When the server drops the connection the next call is at worst refused as
    unavailable (never a wrong answer), and the one after it works on a new connection."""
    now = time.time()
    await face.claim("before", "fp", now=now, lease=10, retention=60)
    own_id = await face._wire.call(("CLIENT", "ID"))
    admin = _admin(redis_url)
    try:
        assert admin.client_kill_filter(_id=own_id) == 1
    finally:
        admin.close()
    outcomes = []
    for _ in range(2):
        try:
            outcomes.append(await face.claim("after", "fp", now=now, lease=10, retention=60))
        except StoreUnavailableError:
            outcomes.append(None)
    assert outcomes[-1] is not None
    claimed = [o for o in outcomes if o is not None]
    assert claimed[0][0] is True and claimed[-1][1].fencing_token == 1
    assert await face._wire.call(("CLIENT", "ID")) != own_id


async def test_a_cancelled_caller_does_not_shift_the_replies_of_others(face: Any) -> None:
    """A caller cancelled while its command is in flight: its reply is read and dropped, and
    the calls after it get their own replies."""
    now = time.time()
    await face.claim("mine", "fp-mine", now=now, lease=10, retention=60)
    task = asyncio.ensure_future(face.get("mine"))
    await asyncio.sleep(0)  # the command is queued on the connection
    task.cancel()
    other = await face.claim("other", "fp-other", now=now, lease=10, retention=60)
    mine = await face.get("mine")
    assert other[0] is True and other[1].fingerprint == "fp-other"
    assert mine is not None and mine.fingerprint == "fp-mine"


async def test_a_server_that_stops_answering_fails_pending_calls_after_the_timeout(
    private_redis: str, redis_prefix: str
) -> None:
    """A paused server (CLIENT PAUSE): pending calls fail as unavailable after
    ``socket_timeout`` (not when the pause ends), and calls work again once it answers."""
    store = RedisStore(private_redis, prefix=redis_prefix, clock="caller", socket_timeout=0.3)
    face = store.asyncio_key_store()
    admin = _admin(private_redis)
    try:
        now = time.time()
        await face.get("warm")
        admin.client_pause(5000, all=False)  # writes (the claim script); lifted at once
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailableError, match="unavailable"):
                await face.claim("paused", "fp", now=now, lease=10, retention=60)
            waited = time.monotonic() - started
        finally:
            admin.client_unpause()
        assert 0.25 <= waited < 4.0  # the timeout (0.3 s), not the pause's end (5 s)
        # The timed-out claim was sent, so Redis may still run it once unpaused (its outcome
        # is unknown, as with any client): the key is then claimed by it, never twice.
        _, record = await face.claim("paused", "fp", now=now, lease=10, retention=60)
        assert record.fencing_token == 1 and record.state is KeyState.RUNNING
        assert (await face.claim("fresh", "fp", now=now, lease=10, retention=60))[0]
    finally:
        admin.close()
        await face.aclose()
        store.close()


async def test_a_refused_login_is_unavailable_and_names_no_password(
    redis_url: str, redis_prefix: str
) -> None:
    """A wrong password is refused as unavailable ("refused the login"); the message never
    shows the password."""
    url = redis_url.replace("redis://", "redis://:s3cret-pw@", 1)
    store = RedisStore(url, prefix=redis_prefix, check=False)
    face = store.asyncio_key_store()
    try:
        with pytest.raises(StoreUnavailableError, match="refused the login") as caught:
            await face.get("k")
        assert "s3cret-pw" not in str(caught.value)
    finally:
        await face.aclose()
        store.close()


async def test_an_unreachable_server_is_unavailable(redis_prefix: str) -> None:
    """Nothing listening: the call fails as unavailable, naming host and port."""
    store = RedisStore("redis://127.0.0.1:1/0", prefix=redis_prefix, check=False)
    face = store.asyncio_key_store()
    try:
        with pytest.raises(StoreUnavailableError, match=r"127\.0\.0\.1:1\b"):
            await face.get("k")
    finally:
        await face.aclose()
        store.close()


async def test_without_hiredis_the_async_face_uses_redis_py(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without hiredis the same operations run on redis-py's asyncio client."""
    monkeypatch.setattr(_redis, "wire_options", None)
    store = RedisStore(redis_url, prefix=redis_prefix, clock="caller")
    face = store.asyncio_key_store()
    try:
        now = time.time()
        claimed, record = await face.claim("h", "fp", now=now, lease=10, retention=60)
        assert claimed and await face.complete("h", record.fencing_token, RESPONSE, now=now,
                                               retention=60)  # fmt: skip
        assert face._wire is None and face._client is not None
        stored = await face.get("h")
        assert stored is not None and stored.response == RESPONSE
    finally:
        await face.aclose()
        store.close()


def test_the_lean_transport_works_on_uvloop(redis_url: str, redis_prefix: str) -> None:
    """On uvloop (uvicorn's loop wherever it is installed, as ``uvicorn[standard]`` does),
    whose transports do not subclass ``asyncio.Transport``, the async face claims, completes
    and reads: it once asserted that they did, and every request on a Redis store hung."""
    import uvloop

    async def go() -> tuple[bool, Any]:
        store = RedisStore(redis_url, prefix=redis_prefix, clock="caller", socket_timeout=2.0)
        face = store.asyncio_key_store()
        try:
            claimed, record = await asyncio.wait_for(
                face.claim("uv", "fp", now=time.time(), lease=10, retention=60), 5
            )
            assert claimed and isinstance(face._wire, RedisWire)
            await face.complete(
                "uv", record.fencing_token, RESPONSE, now=time.time(), retention=60
            )
            return claimed, await asyncio.wait_for(face.get("uv"), 5)
        finally:
            await face.aclose()
            store.close()

    claimed, record = uvloop.run(go())
    assert claimed and record is not None and record.state is KeyState.COMPLETED
    assert record.response == RESPONSE
