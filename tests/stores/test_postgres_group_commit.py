"""Group commit on PostgreSQL (SPEC §9; ``stores/_postgres.py``): the key store's async face
runs the operations of one event-loop iteration in one pipelined transaction, and each of them
still behaves as if it had run alone — its own result, only once committed, its own error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from retrysafe import StoreError
from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores import _postgres

pytestmark = pytest.mark.anyio
RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}')


@pytest.fixture
def pg_store(pg_url: str, pg_schema: str) -> Iterator[Any]:
    from retrysafe.stores import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema, clock="caller")
    yield store
    store.close()


@pytest.fixture
async def face(pg_store: Any) -> AsyncIterator[Any]:
    face = pg_store.asyncio_key_store()
    yield face
    await face.aclose()


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch the group commit runs."""
    sizes: list[int] = []
    real = _postgres._drive_batch

    async def counting(conn: Any, ops: list[Any]) -> Any:
        sizes.append(len(ops))
        return await real(conn, ops)

    monkeypatch.setattr(_postgres, "_drive_batch", counting)
    return sizes


async def test_operations_issued_together_commit_together(face: Any, batches: list[int]) -> None:
    """Claims, completions, renewals and reads issued in one event-loop iteration run as one
    batch, and each gets its own answer."""
    assert face.connector.group_commit
    now = time.time()
    claims = await asyncio.gather(
        *(face.claim(f"k{i}", "fp", now=now, lease=10, retention=60) for i in range(12))
    )
    assert batches == [12] and all(claimed for claimed, _ in claims)
    done = await asyncio.gather(
        face.complete("k0", 1, RESPONSE, now=now, retention=60),
        face.extend_lease("k1", 1, now=now, lease=30),
        face.release("k2", 1),
        face.complete("k3", 99, RESPONSE, now=now, retention=60),  # not the owner's token
        face.get("k4"),
    )
    assert batches == [12, 5]
    assert list(done[:4]) == [True, True, True, False]
    assert done[4] is not None and done[4].state is KeyState.RUNNING


async def test_claims_of_one_key_in_one_batch_have_one_winner(
    face: Any, batches: list[int]
) -> None:
    """Sixteen claims of one absent key in one batch: one claims it, the others read the
    record it wrote (in the same transaction) and agree on its token."""
    now = time.time()
    results = await asyncio.gather(
        *(face.claim("same", f"fp{i}", now=now, lease=10, retention=60) for i in range(16))
    )
    assert batches == [16]
    winners = [record for claimed, record in results if claimed]
    assert len(winners) == 1
    assert {record.fencing_token for _, record in results} == {1}
    assert {record.fingerprint for _, record in results} == {winners[0].fingerprint}


async def test_an_answer_is_given_only_once_committed(face: Any, pg_store: Any) -> None:
    """A claim the face reports is already visible to every other connection."""
    now = time.time()
    results = await asyncio.gather(
        *(face.claim(f"v{i}", "fp", now=now, lease=10, retention=60) for i in range(5))
    )
    assert all(claimed for claimed, _ in results)
    for i in range(5):
        record = pg_store.get(f"v{i}")  # the sync store: its own pool connection
        assert record is not None and record.state is KeyState.RUNNING


async def test_a_failing_statement_fails_only_its_own_operation(
    face: Any, batches: list[int], pg_store: Any
) -> None:
    """A statement that fails (a NUL byte PostgreSQL text cannot hold) rolls its batch back;
    the batch's operations then run one by one, so only that one fails and the others land."""
    now = time.time()
    results = await asyncio.gather(
        face.claim("good-1", "fp", now=now, lease=10, retention=60),
        face.claim("bad", "f\x00p", now=now, lease=10, retention=60),
        face.claim("good-2", "fp", now=now, lease=10, retention=60),
        return_exceptions=True,
    )
    assert batches == [3]
    assert isinstance(results[1], StoreError)
    assert results[0][0] is True and results[2][0] is True  # type: ignore[index]
    assert pg_store.get("good-1") is not None and pg_store.get("bad") is None


async def test_a_cancelled_completion_still_lands(face: Any, pg_store: Any) -> None:
    """A completion whose caller was cancelled before its batch ran is still written (writes
    that finish a claim are never skipped); a cancelled read is simply dropped."""
    now = time.time()
    claimed, _ = await face.claim("c", "fp", now=now, lease=10, retention=60)
    assert claimed
    completing = asyncio.ensure_future(face.complete("c", 1, RESPONSE, now=now, retention=60))
    reading = asyncio.ensure_future(face.get("c"))
    await asyncio.sleep(0)  # both are queued for this iteration's batch
    completing.cancel()
    reading.cancel()
    await asyncio.sleep(0.2)
    stored = pg_store.get("c")
    assert stored is not None and stored.state is KeyState.COMPLETED


async def test_the_sync_face_and_other_features_do_not_batch(
    pg_store: Any, pg_url: str, pg_schema: str
) -> None:
    """Only the key store's async face groups commits; a plain async connector (the outbox's,
    the webhooks') runs each operation on its own, as before."""
    plain = pg_store.connector.async_connector()
    try:
        assert not plain.group_commit
    finally:
        await plain.aclose()
