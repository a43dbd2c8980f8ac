"""Three `retrysafe gateway` processes sharing one store act as one (SPEC §9): the same key
sent to every replica at once runs the upstream once, and every replica replays it.

PostgreSQL gets a fresh database (``CREATE DATABASE``; the gateway CLI has no schema option),
dropped afterwards; Redis gets unique keys under the gateway's default prefix, deleted
afterwards. The replicas are real processes started by the CLI; the upstream is a Starlette app
in this process that counts its effects per request id and sleeps 200 ms per POST, so the
concurrent requests overlap.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe._serving import ServerThread, free_port
from retrysafe.core import key_hash

REPLICAS = 3
DEADLINE = 10.0  # seconds any one test may spend retrying 409s


@dataclass
class SharedStore:
    """The store URL every replica opens, and the idempotency keys the tests used there."""

    url: str
    keys: list[str] = field(default_factory=list)

    def new_key(self) -> str:
        key = f"replicas-{uuid.uuid4()}"
        self.keys.append(key)
        return key


@dataclass
class Upstream:
    """The protected service: POST /orders counts one effect per body ``ref``."""

    effects: Counter[str] = field(default_factory=Counter)

    def app(self) -> Starlette:
        async def create(request: Request) -> Response:
            body = await request.json()
            self.effects[body["ref"]] += 1
            n = self.effects[body["ref"]]
            await asyncio.sleep(0.2)  # long enough for the other replicas' requests to collide
            return JSONResponse({"ref": body["ref"], "run": n}, status_code=201)

        return Starlette(routes=[Route("/orders", create, methods=["POST"])])


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    service = Upstream()
    with ServerThread(service.app()) as server:
        yield service, server.url


def _fresh_database(pg_url: str) -> Iterator[str]:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    name = f"rs_replicas_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    params = conninfo_to_dict(pg_url)
    user, host, port = params.get("user", "postgres"), params.get("host"), params.get("port")
    password = f":{params['password']}" if params.get("password") else ""
    try:
        yield f"postgresql://{user}{password}@{host}:{port or 5432}/{name}"
    finally:
        with psycopg.connect(make_conninfo(pg_url), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module", params=["postgres", "redis"])
def shared_store(request: pytest.FixtureRequest) -> Iterator[SharedStore]:
    """One store for all replicas: a fresh PostgreSQL database, or Redis with unique keys."""
    if request.param == "postgres":
        for url in _fresh_database(request.getfixturevalue("pg_url")):
            yield SharedStore(url)
        return
    import redis

    store = SharedStore(request.getfixturevalue("redis_url"))
    yield store
    client = redis.Redis.from_url(store.url)
    for key in store.keys:
        h = key_hash("", key)  # the gateway's scope: no Authorization header
        client.delete(f"retrysafe:k:{{{h}}}", f"retrysafe:t:{{{h}}}")
    client.close()


def _wait_listening(port: int, proc: subprocess.Popen[str], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited: {proc.communicate()[1]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"gateway on port {port} did not start in {timeout} s")


@pytest.fixture(scope="module")
def replicas(shared_store: SharedStore, upstream: tuple[Upstream, str]) -> Iterator[list[str]]:
    """Three gateway processes on one shared store, in front of one upstream: their URLs."""
    ports = [free_port() for _ in range(REPLICAS)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "retrysafe",
                "gateway",
                "--upstream",
                upstream[1],
                "--listen",
                f"127.0.0.1:{port}",
                "--store",
                shared_store.url,
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for port in ports
    ]
    try:
        for port, proc in zip(ports, procs, strict=True):
            _wait_listening(port, proc)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _post_until_answered(url: str, key: str, ref: str) -> list[httpx.Response]:
    """POST until the answer is not a 409 in-progress (bounded); every response, in order."""
    answers: list[httpx.Response] = []
    deadline = time.monotonic() + DEADLINE
    with httpx.Client(timeout=10) as client:
        while True:
            r = client.post(url + "/orders", json={"ref": ref}, headers={"Idempotency-Key": key})
            answers.append(r)
            if r.status_code != 409 or time.monotonic() > deadline:
                return answers
            time.sleep(0.05)


def _send_concurrently(urls: list[str], key: str, ref: str) -> list[list[httpx.Response]]:
    """The same request to every URL at the same moment, one thread each."""
    results: list[list[httpx.Response]] = [[] for _ in urls]
    barrier = threading.Barrier(len(urls))

    def send(i: int) -> None:
        barrier.wait(timeout=10)
        results[i] = _post_until_answered(urls[i], key, ref)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE + 15)
    assert not any(t.is_alive() for t in threads), "a request thread did not finish"
    return results


def test_one_key_sent_to_every_replica_at_once_runs_the_upstream_once(
    replicas: list[str], shared_store: SharedStore, upstream: tuple[Upstream, str]
) -> None:
    """The same key at the same moment on three replicas: one upstream effect, and every
    answer is 201 — directly, or as a replay after 409 request-in-progress."""
    service, _ = upstream
    key, ref = shared_store.new_key(), uuid.uuid4().hex
    urls = [u for u in replicas for _ in range(2)]  # two concurrent requests per replica
    results = _send_concurrently(urls, key, ref)

    assert service.effects[ref] == 1
    finals = [answers[-1] for answers in results]
    assert [r.status_code for r in finals] == [201] * len(urls)
    assert all(r.json() == {"ref": ref, "run": 1} for r in finals)
    assert sum("idempotent-replayed" not in r.headers for r in finals) == 1
    assert sum(len(answers) > 1 for answers in results) >= 2, "the requests did not overlap"
    for answers in results:
        for r in answers[:-1]:
            assert r.status_code == 409
            assert r.json()["type"] == "urn:retrysafe:problem:request-in-progress"


def test_later_repeats_replay_on_every_replica(
    replicas: list[str], shared_store: SharedStore, upstream: tuple[Upstream, str]
) -> None:
    """Once completed through one replica, the key replays from every replica, marked."""
    service, _ = upstream
    key, ref = shared_store.new_key(), uuid.uuid4().hex
    first = _post_until_answered(replicas[0], key, ref)[-1]
    assert first.status_code == 201
    for url in replicas:
        for _ in range(2):
            r = httpx.post(
                url + "/orders", json={"ref": ref}, headers={"Idempotency-Key": key}, timeout=10
            )
            assert r.status_code == 201
            assert r.headers["idempotent-replayed"] == "true"
            assert r.json() == first.json()
    assert service.effects[ref] == 1
