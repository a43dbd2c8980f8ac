"""A PostgreSQL store recovers by itself (issue 11): once the server killed its connections, at
most the operation that found a dead one fails, and the next one works; a read-only server is
unavailable (503, waited out), not broken.

Connections are killed with ``pg_terminate_backend``, only the store's own (recognised by a
unique ``application_name``), as in ``test_outages.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from _relay import PgRelay
from retrysafe import ConfigurationError, JobState, StoreUnavailableError
from retrysafe.stores import PostgresStore
from retrysafe.stores._keys import AsyncSQLKeyStore

H = "e" * 64
POOL = 4  # idle connections in each pool when the server kills them


def _backends(pg_url: str, name: str) -> set[int]:
    """The server-side connections named ``name`` (their pids)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchall()
    return {int(pid) for (pid,) in rows}


def _kill(pg_url: str, pids: set[int]) -> Callable[[], bool]:
    """Terminate ``pids``; returns the condition "they are all gone"."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def gone() -> bool:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (list(pids),)
            ).fetchone()
        return rows is not None and rows[0] == 0

    return gone


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.02)


async def _await_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """:func:`_wait_for` that lets the event loop run (the async pool connects on it)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def named(pg_url: str, pg_schema: str) -> Iterator[tuple[PostgresStore, str]]:
    """A store whose pools keep ``POOL`` connections, all named by a unique application_name."""
    name = f"rs-test-{uuid.uuid4().hex[:12]}"
    url = f"{pg_url}{'&' if '?' in pg_url else '?'}application_name={name}"
    store = PostgresStore(url, schema=pg_schema, clock="caller", min_size=POOL, max_size=8)
    yield store, name
    store.close()


def _outcome(fn: Callable[[], object]) -> str:
    try:
        fn()
    except StoreUnavailableError:
        return "unavailable"
    return "ok"


def test_after_the_server_killed_its_idle_connections_the_next_operation_works(
    pg_url: str, named: tuple[PostgresStore, str]
) -> None:
    """Every idle pool connection killed: at most the first operation fails (unavailable),
    and every one after it works (the pool does not hand out the other dead ones)."""
    store, name = named
    _wait_for(lambda: len(_backends(pg_url, name)) >= POOL, f"{POOL} pool connections")
    _wait_for(_kill(pg_url, _backends(pg_url, name)), "the connections to end")
    outcomes = [_outcome(lambda: store.get(H)) for _ in range(POOL + 2)]
    assert outcomes[0] in ("ok", "unavailable")
    assert outcomes[1:] == ["ok"] * (POOL + 1)


@pytest.mark.anyio
async def test_the_async_face_after_its_idle_connections_were_killed_works_again(
    pg_url: str, named: tuple[PostgresStore, str]
) -> None:
    """The same for the async face's pool (the middleware's and the worker's)."""
    store, name = named
    keys = store.asyncio_key_store()
    try:
        await keys.get(H)  # opens the async pool: POOL more connections
        await _await_for(
            lambda: len(_backends(pg_url, name)) >= 2 * POOL, f"{2 * POOL} connections"
        )
        gone = await asyncio.to_thread(lambda: _kill(pg_url, _backends(pg_url, name)))
        await _await_for(gone, "the connections to end")
        outcomes = []
        for _ in range(POOL + 2):
            try:
                await keys.get(H)
            except StoreUnavailableError:
                outcomes.append("unavailable")
            else:
                outcomes.append("ok")
        assert outcomes[0] in ("ok", "unavailable")
        assert outcomes[1:] == ["ok"] * (POOL + 1)
    finally:
        await keys.aclose()


def test_a_read_only_server_is_unavailable_and_writes_once_it_is_writable(
    pg_url: str, pg_schema: str
) -> None:
    """A server that refuses writes (a standby; here ``default_transaction_read_only``) makes
    a claim unavailable (503, waited out), not a store failure; writable again, it works."""
    store = PostgresStore(pg_url, schema=pg_schema, clock="caller", min_size=1, max_size=1)
    try:
        with store.connector.connection() as conn:  # the pool's only connection
            conn.execute("SET default_transaction_read_only = on")
        with pytest.raises(StoreUnavailableError, match="read-only transaction"):
            store.claim(H, "fp", now=1.0, lease=10, retention=100)
        assert store.get(H) is None
        with store.connector.connection() as conn:
            conn.execute("SET default_transaction_read_only = off")
        assert store.claim(H, "fp", now=1.0, lease=10, retention=100)[0]
    finally:
        store.close()


# ----------------------------------------------------------- a store that does not answer


@pytest.fixture
def locked(pg_url: str, pg_schema: str) -> Iterator[Callable[[], None]]:
    """Creates the schema, then holds an ACCESS EXCLUSIVE lock on the key table from another
    session until the test calls the function it gets (or ends)."""
    PostgresStore(pg_url, schema=pg_schema).close()
    holder = psycopg.connect(pg_url)
    holder.execute(f"LOCK TABLE {pg_schema}.idempotency_keys IN ACCESS EXCLUSIVE MODE".encode())
    yield holder.rollback
    holder.close()


def test_a_lock_held_elsewhere_makes_the_store_unavailable_within_its_statement_timeout(
    pg_url: str, pg_schema: str, locked: Callable[[], None]
) -> None:
    """A statement waiting on a lock ends with StoreUnavailableError (503 + Retry-After at
    the middleware) after ``statement_timeout``, on both faces, instead of waiting as long
    as the lock is held (a client hung 19 s here before); once it is released, the store
    works."""
    store = PostgresStore(pg_url, schema=pg_schema, statement_timeout=0.5)

    async def claim_async() -> float:
        keys = store.asyncio_key_store()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="statement timeout"):
                await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
            return time.monotonic() - started
        finally:
            await keys.aclose()

    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="statement timeout"):
            store.claim(H, "fp", now=1.0, lease=10, retention=100)
        assert time.monotonic() - started < 4.0
        assert asyncio.run(claim_async()) < 4.0
        locked()
        assert store.claim(H, "fp", now=1.0, lease=10, retention=100)[0]
    finally:
        store.close()


def test_statement_timeout_is_checked_and_the_urls_own_wins(pg_url: str, pg_schema: str) -> None:
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ConfigurationError, match="statement_timeout"):
            PostgresStore(pg_url, schema=pg_schema, statement_timeout=bad)  # type: ignore[arg-type]
    url = pg_url + ("&" if "?" in pg_url else "?") + "options=-c%20statement_timeout%3D7000"
    for store_url, expected in ((pg_url, "2500ms"), (url, "7s")):
        store = PostgresStore(store_url, schema=pg_schema, statement_timeout=2.5)
        try:
            with store.connector.connection() as conn:
                row = conn.execute("SHOW statement_timeout").fetchone()
            assert row is not None and row[0] == expected
        finally:
            store.close()
    store = PostgresStore(pg_url, schema=pg_schema, statement_timeout=None)
    try:
        with store.connector.connection() as conn:
            row = conn.execute("SHOW statement_timeout").fetchone()
        assert row is not None and row[0] == "0"  # the server's default here
    finally:
        store.close()


def test_the_async_face_gives_up_on_a_network_that_swallows_the_answer(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's statement_timeout cannot reach a client whose network loses everything:
    the async face stops waiting ``statement_timeout`` + its margin after sending, with
    StoreUnavailableError, and gives the answer to no one later."""
    from retrysafe.stores import _postgres

    monkeypatch.setattr(_postgres, "_CLIENT_MARGIN", 0.5)
    relay = PgRelay(pg_url)
    url = relay.url(pg_url)
    store = PostgresStore(url, schema=pg_schema, statement_timeout=0.5, connect_timeout=2)

    async def main() -> float:
        # The group-commit face (a batch's deadline) and one without it (each operation's).
        faces = [
            store.asyncio_key_store(),
            AsyncSQLKeyStore(_postgres.AsyncPostgresConnector(store.connector)),
        ]
        for keys in faces:
            assert await keys.get(H) is None  # the pool is open and works
        relay.swallow.set()
        waited = 0.0
        for keys in faces:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="no answer within 1 s"):
                await keys.claim(H, "fp", now=1.0, lease=10, retention=100)
            waited = max(waited, time.monotonic() - started)
        relay.close()  # the abandoned claims' clean-up ends with the connections
        for keys in faces:
            await keys.aclose()
        return waited

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) < 3.0  # a regression hangs: bounded
    finally:
        relay.close()
        store.close()


def test_the_sync_face_gives_up_on_a_network_that_swallows_the_answer(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for the sync face (the WSGI middleware's, the CLI's): psycopg's sync calls
    take no timeout, so a WSGI request waited as long as the server stayed silent (a fresh
    user's check: 45 and 100 s behind a proxy that stopped forwarding). It now stops
    waiting ``statement_timeout`` + the margin after sending, with StoreUnavailableError,
    in a plain operation and in a transaction; the store works again once the network
    does."""
    from retrysafe.stores import _postgres

    monkeypatch.setattr(_postgres, "_CLIENT_MARGIN", 0.5)
    relay = PgRelay(pg_url)
    url = relay.url(pg_url)
    store = PostgresStore(url, schema=pg_schema, statement_timeout=0.5, connect_timeout=2)
    try:
        from retrysafe.stores._keys import get

        tx = store.connector.begin()  # a transaction's connection, taken while all is well
        assert store.get(H) is None  # the pool is open and works
        relay.swallow.set()
        outcomes: list[object] = []

        def silent_server() -> None:  # in a thread: a regression hangs, bounded below
            for call in (
                lambda: store.claim(H, "fp", now=1.0, lease=10, retention=100),
                lambda: tx.run(get(store.clock, H)),
            ):
                started = time.monotonic()
                try:
                    call()
                except StoreUnavailableError as exc:
                    outcomes.append((str(exc), time.monotonic() - started))
                else:
                    outcomes.append("answered")
            # Giving the broken connection back checks none of the others on the silent
            # server (an unbounded query each: it hung here once).
            with contextlib.suppress(StoreUnavailableError):
                tx.rollback()

        caller = threading.Thread(target=silent_server, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "the sync face waited on a silent server for 30 s"
    finally:
        relay.close()
        store.close()
    assert len(outcomes) == 2, outcomes
    for outcome in outcomes:
        assert isinstance(outcome, tuple) and "no answer within 1 s" in outcome[0], outcome
        assert outcome[1] < 3.0, outcome


def test_a_server_back_after_an_outage_is_used_again_within_seconds(
    pg_url: str, pg_schema: str
) -> None:
    """psycopg_pool reconnects a slot 1, 2, 4, 8 … s apart, so after an outage of 8 s both
    faces noticed the server back 5.5-8 s late (their next attempt came 13.5-16.5 s after
    the first failure), and a worker said "available again" that much later (a fresh user's
    report: 4-17 s). A slot now gives up after RECONNECT_WINDOW and the next operation opens
    a fresh one at once: operations issued every 0.1 s through the outage work again within
    a few seconds of the server's return, on the sync face and the async one alike."""
    relay = PgRelay(pg_url)
    store = PostgresStore(relay.url(pg_url), schema=pg_schema, clock="caller", connect_timeout=2)
    outage = 8.0
    back_at: dict[str, float] = {}
    up = threading.Event()

    def until_back(face: str, operation: Callable[[], object]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if _outcome(operation) == "ok" and up.is_set():
                back_at[face] = time.monotonic()
                return
            time.sleep(0.1)

    async def async_face() -> None:
        keys = store.asyncio_key_store()
        assert await keys.get(H) is None  # its pool is open

        async def get() -> None:
            await keys.get(H)

        await asyncio.to_thread(ready.wait)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                await get()
            except StoreUnavailableError:
                pass
            else:
                if up.is_set():
                    back_at["async"] = time.monotonic()
                    break
            await asyncio.sleep(0.1)
        await keys.aclose()

    ready = threading.Event()
    try:
        assert store.get(H) is None
        loop_thread = threading.Thread(target=asyncio.run, args=(async_face(),), daemon=True)
        loop_thread.start()
        time.sleep(0.5)  # the async face's pool opened
        relay.down()
        ready.set()
        sync_thread = threading.Thread(
            target=until_back, args=("sync", lambda: store.get(H)), daemon=True
        )
        sync_thread.start()
        time.sleep(outage)
        relay.refuse.clear()
        up.set()
        returned = time.monotonic()
        sync_thread.join(60)
        loop_thread.join(60)
    finally:
        relay.close()
        store.close()
    late = {face: round(at - returned, 1) for face, at in back_at.items()}
    assert set(late) == {"sync", "async"}, late
    assert all(seconds < 4.0 for seconds in late.values()), late


def test_an_upper_case_schema_name_is_refused(pg_url: str) -> None:
    """PostgreSQL folds the unquoted name in search_path (``App`` → ``app``) while the schema
    is created quoted (``"App"``): such a store could read one schema and create another."""
    with pytest.raises(ConfigurationError, match="lower-case"):
        PostgresStore(pg_url, schema="App")



@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_submit_whose_answer_is_lost_names_the_key_to_submit_again_with(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    """A submission whose write reached PostgreSQL and committed, its answer lost on the way
    back, raised StoreUnavailableError saying nothing was recorded, with a key the caller
    never saw: a retry made a second job under a fresh key, and the endpoint a second effect
    (a fresh user's check, 3 of 3). It now raises SubmitOutcomeUnknownError, a
    StoreUnavailableError naming the job's id and key; submitting again with that key
    returns the stored job, and nothing is recorded twice."""
    from retrysafe import AsyncOutbox, Outbox, SubmitOutcomeUnknownError
    from retrysafe.stores import _postgres

    monkeypatch.setattr(_postgres, "_CLIENT_MARGIN", 0.5)
    relay = PgRelay(pg_url)
    store = PostgresStore(relay.url(pg_url), schema=pg_schema, statement_timeout=0.5)
    url, body = "http://example.test/charge", {"order": 7}

    async def flow(submit: Callable[..., Any]) -> None:
        async def call(**kw: Any) -> str:
            job = submit(url, **kw)
            return str((await job if face == "async" else job).id)

        await call(json={"warm": 1}, key="warm")  # the schema and the pool, while all is well
        relay.lose_answers.set()
        with pytest.raises(SubmitOutcomeUnknownError) as caught:
            await call(json=body)
        relay.lose_answers.clear()
        lost = caught.value
        assert isinstance(lost, StoreUnavailableError)
        assert repr(lost.key) in str(lost) and "may have been recorded" in str(lost)
        with psycopg.connect(pg_url) as conn:
            rows = conn.execute(
                f"SELECT id FROM {pg_schema}.outbox_jobs WHERE idempotency_key = %s".encode(),
                (lost.key,),
            ).fetchall()
        assert rows == [(lost.job_id,)]  # the write committed: the job is there
        deadline = time.monotonic() + 20
        while True:  # the broken connection is dropped; the next submit gets a fresh one
            try:
                assert await call(json=body, key=lost.key) == lost.job_id
                break
            except StoreUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def main() -> None:
        if face == "sync":
            await flow(Outbox(store).submit)
        else:
            async with AsyncOutbox(store) as outbox:
                await flow(outbox.submit)

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert Outbox(store).counts()[JobState.PENDING] == 2  # the warm-up's, and one more
    finally:
        relay.close()
        store.close()


def test_a_webhook_event_whose_answer_is_lost_names_the_id_to_send_again_with(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for ``Webhooks.send``: an event recorded with its answer lost said nothing
    was recorded, and a second send under a fresh id reached every endpoint twice, with two
    webhook-ids the receivers cannot match. It raises SubmitOutcomeUnknownError whose key
    is the event id; sending again with it returns the stored event."""
    from retrysafe import SubmitOutcomeUnknownError
    from retrysafe.stores import _postgres
    from retrysafe.webhooks import Webhooks

    monkeypatch.setattr(_postgres, "_CLIENT_MARGIN", 0.5)
    relay = PgRelay(pg_url)
    store = PostgresStore(relay.url(pg_url), schema=pg_schema, statement_timeout=0.5)
    try:
        with Webhooks(store, allow_private=True) as hooks:
            hooks.add_endpoint("http://127.0.0.1:9/hook")
            store_of = hooks.dispatcher.store
            listed = store_of.list_endpoints

            def then_lose_answers() -> Any:  # the endpoints are read; the write's answer lost
                endpoints = listed()
                relay.lose_answers.set()
                return endpoints

            monkeypatch.setattr(store_of, "list_endpoints", then_lose_answers)
            with pytest.raises(SubmitOutcomeUnknownError) as caught:
                hooks.send("invoice.paid", {"id": 7})
            relay.lose_answers.clear()
            monkeypatch.setattr(store_of, "list_endpoints", listed)
            lost = caught.value
            assert lost.job_id is None and f"event_id={lost.key!r}" in str(lost)
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert hooks.send("invoice.paid", {"id": 7}, event_id=lost.key).id == lost.key
                    break
                except StoreUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert len(hooks.deliveries()) == 1  # one event, one delivery: nothing twice
    finally:
        relay.close()
        store.close()


def test_a_submit_that_got_no_connection_is_no_unknown_outcome(
    pg_url: str, pg_schema: str
) -> None:
    """A submission that never got a connection (the server refusing them: the pool's
    timeout) sent nothing: the store's own StoreUnavailableError, not "may have been
    recorded" with a job id that will never exist (a fresh user's check). The one pooled
    connection, cut under its statement, may have carried it: that one is unknown."""
    from retrysafe import Outbox, SubmitOutcomeUnknownError

    relay = PgRelay(pg_url)
    store = PostgresStore(relay.url(pg_url), schema=pg_schema, connect_timeout=1, max_size=1)
    errors: list[StoreUnavailableError] = []
    try:
        Outbox(store).counts()  # the schema and the pool's one connection
        relay.down()
        for _ in range(3):
            with pytest.raises(StoreUnavailableError) as caught:
                Outbox(store).submit("http://example.test/x", json={})
            errors.append(caught.value)
            if not isinstance(caught.value, SubmitOutcomeUnknownError):
                break
    finally:
        relay.close()
        store.close()
    assert not isinstance(errors[-1], SubmitOutcomeUnknownError), errors
    assert len(errors) <= 2, errors
    with psycopg.connect(pg_url) as conn:
        query = f"SELECT count(*) FROM {pg_schema}.outbox_jobs".encode()
        assert conn.execute(query).fetchone() == (0,)
