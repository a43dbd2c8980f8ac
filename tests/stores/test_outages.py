"""Store outages mid-run (SPEC §3 fail-closed row, §5, §9): the middleware answers 503
``store-unavailable`` while its store is unreachable and heals by itself; the outbox Worker
waits an outage out; four worker processes on one PostgreSQL outbox survive one of them being
SIGKILLed.

PostgreSQL outages are real: ``pg_terminate_backend`` on the store's own server-side
connections, recognised by a unique ``application_name`` set in the store URL, so no other
session is touched. Redis outages are ``CLIENT PAUSE WRITE`` on a private ``redis-server`` of
the session (never the shared one: other test workers would stall), always followed by
``CLIENT UNPAUSE``.
A Redis Cluster outage is a master of the local test cluster SIGKILLed and restarted.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from retrysafe import JobState, Outbox, RetryPolicy, Worker
from retrysafe._serving import ServerThread
from retrysafe.core import key_hash
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import MemoryStore

from ._redis_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 10.0  # seconds a test may keep retrying after an outage before it fails
FAST = RetryPolicy(attempts=4, wait_initial=0.01, wait_max=0.05, timeout=2.0, poll_interval=0.01)


def _with_app_name(url: str) -> tuple[str, str]:
    """``url`` with a unique ``application_name``; (url, name)."""
    name = f"rs-test-{uuid.uuid4().hex[:12]}"
    return f"{url}{'&' if '?' in url else '?'}application_name={name}", name


def _terminate(pg_url: str, app_name: str) -> int:
    """Terminate every server-side connection named ``app_name``; how many were killed."""
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND application_name = %s",
            (app_name,),
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


def _is_store_unavailable(r: httpx.Response) -> bool:
    return (
        r.status_code == 503
        and r.headers.get("content-type", "").startswith("application/problem+json")
        and "store-unavailable" in r.json()["type"]
        and int(r.headers["retry-after"]) >= 0
    )


@dataclass
class Orders:
    """POST /orders: one effect per body ``ref``; ``during`` runs inside the handler."""

    effects: Counter[str] = field(default_factory=Counter)
    during: Any = None

    def app(self) -> Starlette:
        async def create(request: Request) -> JSONResponse:
            body = await request.json()
            if body.get("kill") and self.during is not None:
                await asyncio.to_thread(self.during)
            self.effects[body["ref"]] += 1
            return JSONResponse({"ref": body["ref"], "run": self.effects[body["ref"]]}, 201)

        return Starlette(routes=[Route("/orders", create, methods=["POST"])])


@dataclass
class PgServed:
    orders: Orders
    client: httpx.AsyncClient
    kill: Any  # () -> int: terminate the store's connections


@pytest.fixture
async def pg_served(pg_url: str, pg_schema: str) -> AsyncIterator[PgServed]:
    """The middleware on a PostgresStore whose connections carry a unique application_name."""
    from retrysafe.stores import PostgresStore

    url, name = _with_app_name(pg_url)
    store = PostgresStore(url, schema=pg_schema, connect_timeout=2.0)
    orders = Orders()
    middleware = IdempotencyMiddleware(orders.app(), store=store)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield PgServed(orders, client, lambda: _terminate(pg_url, name))
    aclose = getattr(middleware.store, "aclose", None)
    if aclose is not None:
        await aclose()
    store.close()


async def _post_until_served(
    client: httpx.AsyncClient, body: dict[str, Any], key: str
) -> list[httpx.Response]:
    """POST until the answer is not a 503 (bounded); every answer, in order."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + DEADLINE
    while True:
        r = await client.post("/orders", json=body, headers={"Idempotency-Key": key})
        answers.append(r)
        if r.status_code != 503 or time.monotonic() > deadline:
            return answers
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_dropped_pg_connections_between_requests_fail_closed_then_heal(
    pg_served: PgServed,
) -> None:
    """Connections killed between requests: 503 store-unavailable (or success), never a 500
    or a second effect; the replay and a new key then work without any manual action. (A
    completed key's replay may be served at once: a claim that cannot be written falls back to
    reading the record, and the pool has dropped its dead connections by then.)"""
    key, other = str(uuid.uuid4()), str(uuid.uuid4())
    first = await pg_served.client.post(
        "/orders", json={"ref": "a"}, headers={"Idempotency-Key": key}
    )
    assert first.status_code == 201
    assert pg_served.kill() >= 1
    again = await _post_until_served(pg_served.client, {"ref": "a"}, key)
    assert pg_served.kill() >= 1
    fresh = await _post_until_served(pg_served.client, {"ref": "b"}, other)
    for r in again[:-1] + fresh[:-1]:
        assert _is_store_unavailable(r), (r.status_code, r.text)
    assert len(fresh) > 1  # the dead connections did fail the new key's claim
    assert again[-1].status_code == 201 and again[-1].headers["idempotent-replayed"] == "true"
    assert again[-1].content == first.content
    assert fresh[-1].status_code == 201 and "idempotent-replayed" not in fresh[-1].headers
    assert pg_served.orders.effects == {"a": 1, "b": 1}


@pytest.mark.anyio
async def test_dropped_pg_connections_during_a_request_never_duplicate_the_effect(
    pg_served: PgServed,
) -> None:
    """Connections killed while the handler runs: the response is still recorded (the
    completion is retried on a new connection), so the repeat replays it; one effect."""
    kills: list[int] = []
    pg_served.orders.during = lambda: kills.append(pg_served.kill())
    key = str(uuid.uuid4())
    body = {"ref": "c", "kill": True}
    answers = await _post_until_served(pg_served.client, body, key)
    pg_served.orders.during = None
    repeat = await _post_until_served(pg_served.client, body, key)
    assert kills and kills[0] >= 1
    for r in answers[:-1] + repeat[:-1]:
        assert _is_store_unavailable(r), (r.status_code, r.text)
    assert answers[-1].status_code == 201
    assert repeat[-1].status_code == 201 and repeat[-1].headers["idempotent-replayed"] == "true"
    assert repeat[-1].content == answers[-1].content
    assert pg_served.orders.effects == {"c": 1}


@pytest.fixture
def effect_server() -> Iterator[tuple[Orders, str]]:
    """A real HTTP endpoint behind the middleware (memory store): one effect per key."""
    orders = Orders()
    with ServerThread(IdempotencyMiddleware(orders.app(), store=MemoryStore())) as server:
        yield orders, server.url + "/orders"


def test_worker_on_pg_survives_its_connections_being_killed_mid_run(
    pg_url: str, pg_schema: str, effect_server: tuple[Orders, str]
) -> None:
    """The outbox Worker's PostgreSQL connections are killed five times while it delivers:
    every job still ends SUCCEEDED with exactly one effect."""
    from retrysafe.stores import PostgresStore

    orders, endpoint = effect_server
    url, name = _with_app_name(pg_url)
    checker = PostgresStore(pg_url, schema=pg_schema)  # never killed: submits and checks
    store = PostgresStore(url, schema=pg_schema, connect_timeout=2.0)  # the worker's, killed
    try:
        outbox = Outbox(checker, policy=FAST)
        # Enough jobs that the kills land mid-run on a fast host too (150 were all delivered
        # before the first kill, 0.15 s in, once: no outage to survive).
        jobs = [outbox.submit(endpoint, json={"ref": f"job-{i}"}) for i in range(400)]
        worker = Worker(store, policy=FAST, concurrency=4, poll_interval=0.01)
        thread = threading.Thread(target=worker.run_until_idle, daemon=True)
        thread.start()
        killed = 0
        for pause in (0.05, 0.1, 0.1, 0.1, 0.1):
            time.sleep(pause)
            killed += _terminate(pg_url, name)
        thread.join(timeout=25)
        assert not thread.is_alive(), "the worker did not finish"
        assert killed >= 1 and worker.stats.store_outages >= 1
        states = Counter(outbox.get(j.id).state for j in jobs)
        assert states == {JobState.SUCCEEDED: len(jobs)}
        assert orders.effects == {f"job-{i}": 1 for i in range(len(jobs))}
    finally:
        store.close()
        checker.close()


# ---------------------------------------------------------------------------------- Redis


@pytest.fixture
def redis_admin(private_redis: str) -> Iterator[Any]:
    """A client of this session's private Redis for CLIENT PAUSE; always unpauses
    afterwards."""
    import redis

    client = redis.Redis.from_url(private_redis)
    try:
        yield client
    finally:
        client.client_unpause()
        client.close()


@pytest.mark.anyio
async def test_paused_redis_answers_503_with_retry_after_and_the_key_works_after(
    private_redis: str, redis_prefix: str, redis_admin: Any
) -> None:
    """While Redis is paused (CLIENT PAUSE WRITE) requests get 503 store-unavailable with
    Retry-After and nothing runs; after the pause the same key runs once and then replays."""
    from retrysafe.stores import RedisStore

    store = RedisStore(private_redis, prefix=redis_prefix, socket_timeout=0.3)
    orders = Orders()
    middleware = IdempotencyMiddleware(orders.app(), store=store)
    transport = httpx.ASGITransport(app=middleware)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            warm = await client.post("/orders", json={"ref": "w"}, headers={"Idempotency-Key": "w"})
            assert warm.status_code == 201
            # Writes (every claim script) paused, not ALL: Redis 7.0 pauses CLIENT UNPAUSE
            # too under ALL, so only WRITE can be lifted as soon as both requests answered.
            # Long, so a loaded machine's two 0.3 s timeouts always fall inside it.
            redis_admin.client_pause(10_000, all=False)
            try:
                paused = [await client.post("/orders", json={"ref": "p"}, headers=key)]
                paused.append(await client.post("/orders", json={"ref": "p"}, headers=key))
            finally:
                redis_admin.client_unpause()
            assert all(_is_store_unavailable(r) for r in paused), [r.text for r in paused]
            assert orders.effects["p"] == 0
            first = await _post_until_served(client, {"ref": "p"}, key["Idempotency-Key"])
            again = await client.post("/orders", json={"ref": "p"}, headers=key)
    finally:
        aclose = getattr(middleware.store, "aclose", None)
        if aclose is not None:
            await aclose()
        store.close()
    assert first[-1].status_code == 201 and "idempotent-replayed" not in first[-1].headers
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first[-1].content
    assert orders.effects == {"w": 1, "p": 1}


@pytest.mark.anyio
async def test_cluster_master_killed_mid_run_fails_closed_then_heals_after_restart(
    redis_cluster: LocalCluster, redis_cluster_prefix: str
) -> None:
    """A Redis Cluster master SIGKILLed mid-run: while it is down, requests whose keys live on
    its slots get 503 store-unavailable (never a 500, never a second effect) and the other
    masters keep serving; restarted on its port with its nodes.conf, it rejoins and every key
    works again without manual action — a key completed before the crash still replays."""
    from retrysafe.stores import RedisStore

    victim = redis_cluster.nodes[1]
    keys: dict[str, str] = {}
    while len(keys) < 4:  # two keys on the victim's slots, two elsewhere
        key = str(uuid.uuid4())
        record = f"{redis_cluster_prefix}k:{{{key_hash('', key)}}}"
        here = "v" if redis_cluster.owner(record) is victim else "o"
        for name in (f"done-{here}", f"new-{here}"):
            if name not in keys:
                keys[name] = key
                break
    store = RedisStore(redis_cluster.url, prefix=redis_cluster_prefix, socket_timeout=0.5)
    orders = Orders()
    middleware = IdempotencyMiddleware(orders.app(), store=store)
    transport = httpx.ASGITransport(app=middleware)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def post(name: str) -> httpx.Response:
                headers = {"Idempotency-Key": keys[name]}
                return await client.post("/orders", json={"ref": name}, headers=headers)

            before = {name: await post(name) for name in ("done-v", "done-o")}
            assert all(r.status_code == 201 for r in before.values())
            victim.kill()
            try:
                elsewhere = await post("new-o")
                down = [await post("done-v"), await post("new-v")]
            finally:
                victim.start()  # same port, same nodes.conf and AOF
            # The restarted master answers CLUSTERDOWN until the cluster agrees it is back
            # (about 2 s): redis-py retries, so this one is served late or answered 503.
            rejoining = await post("new-v")
            redis_cluster.wait_ok()
            healed = {name: await post(name) for name in ("new-v", "done-v", "done-o")}
            after = {name: await post(name) for name in keys}
    finally:
        aclose = getattr(middleware.store, "aclose", None)
        if aclose is not None:
            await aclose()
        store.close()
        if victim.proc is None or victim.proc.poll() is not None:
            victim.start()
        redis_cluster.wait_ok()
    assert all(_is_store_unavailable(r) for r in down), [(r.status_code, r.text) for r in down]
    assert elsewhere.status_code == 201, elsewhere.text
    assert rejoining.status_code == 201 or _is_store_unavailable(rejoining), rejoining.text
    first_run = rejoining if rejoining.status_code == 201 else healed["new-v"]
    assert first_run.status_code == 201 and "idempotent-replayed" not in first_run.headers
    assert healed["done-v"].headers["idempotent-replayed"] == "true"
    assert healed["done-v"].content == before["done-v"].content
    assert healed["done-o"].headers["idempotent-replayed"] == "true"
    for r in after.values():
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true", r.text
    assert orders.effects == {name: 1 for name in keys}


# ------------------------------------------------------------------- four worker processes


def test_four_pg_workers_one_sigkilled_deliver_every_job_once(pg_url: str) -> None:
    """300 jobs, four ``retrysafe worker`` processes on one PostgreSQL outbox behind the chaos
    proxy, one SIGKILLed a third of the way: every job SUCCEEDED, no duplicate, none lost."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pg_workers.py"),
            "--jobs",
            "300",
            "--workers",
            "4",
            "--timeout",
            "1",
            "--lease",
            "3",
            "--max-seconds",
            # Usually done in ~8 s; the bound is generous because the suite runs on two xdist
            # workers and a loaded 2-core machine slows four worker processes a lot. The
            # benchmark stops its workers and drops its database itself.
            "50",
            "--pg",
            pg_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["killed_worker"] is not None
    assert result["succeeded"] == result["jobs"] == 300
    assert result["duplicates"] == result["lost"] == 0
