"""The KeyStore contract (stores/_base.py), run against every store."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores import AsyncKeyStore, KeyStore, as_async_key_store

H = "a" * 64
FP = "f" * 64
NOW = 1_000_000.0
RESP = StoredResponse(
    201, (("content-type", "application/json"), ("location", "/p/1")), b'{"id":1}'
)


async def _aclose(store: AsyncKeyStore) -> None:
    """Close an async face that owns connections (PostgreSQL and Redis faces do)."""
    aclose = getattr(store, "aclose", None)
    if aclose is not None:
        await aclose()


def test_claim_absent_key(key_store: KeyStore) -> None:
    """Claiming an absent key inserts a running record with fencing token 1."""
    claimed, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert claimed
    assert (rec.state, rec.fencing_token, rec.fingerprint) == (KeyState.RUNNING, 1, FP)
    assert rec.lease_expires_at == NOW + 10
    assert rec.expires_at == NOW + 100


def test_claim_existing_key_returns_it_untouched(key_store: KeyStore) -> None:
    """A second claim returns the existing record and changes nothing."""
    key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    claimed, rec = key_store.claim(H, "other", now=NOW + 1, lease=10, retention=100)
    assert not claimed
    assert rec.fingerprint == FP and rec.fencing_token == 1


def test_claim_after_retention_replaces_with_higher_token(key_store: KeyStore) -> None:
    """An expired record counts as absent; the new claim gets a larger fencing token."""
    _, first = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    key_store.complete(H, first.fencing_token, RESP, now=NOW, retention=100)
    claimed, rec = key_store.claim(H, "new", now=NOW + 100, lease=10, retention=100)
    assert claimed and rec.fencing_token > first.fencing_token
    assert rec.response is None and rec.state is KeyState.RUNNING


def test_complete_stores_the_response(key_store: KeyStore) -> None:
    """The owner completes the key; the response reads back byte for byte."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.complete(H, rec.fencing_token, RESP, now=NOW + 1, retention=50)
    got = key_store.get(H)
    assert got is not None and got.state is KeyState.COMPLETED
    assert got.response == RESP and got.expires_at == NOW + 51


def test_empty_body_response_round_trips(key_store: KeyStore) -> None:
    """A 204 with an empty body is a stored response, not an absent one."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    key_store.complete(H, rec.fencing_token, StoredResponse(204, (), b""), now=NOW, retention=100)
    got = key_store.get(H)
    assert got is not None and got.response == StoredResponse(204, (), b"")


def test_unreplayable_flag_round_trips(key_store: KeyStore) -> None:
    """replayable=False survives storage."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    resp = StoredResponse(200, (), b"", replayable=False)
    key_store.complete(H, rec.fencing_token, resp, now=NOW, retention=100)
    got = key_store.get(H)
    assert got is not None and got.response is not None and not got.response.replayable


def test_release_deletes_only_for_the_owner(key_store: KeyStore) -> None:
    """release with a stale token does nothing; with the right token the key reads absent."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert not key_store.release(H, rec.fencing_token + 1)
    assert key_store.get(H) is not None
    assert key_store.release(H, rec.fencing_token)
    assert key_store.get(H) is None


def test_release_never_deletes_a_completed_record(key_store: KeyStore) -> None:
    """A completed key stays even if its owner calls release afterwards."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    key_store.complete(H, rec.fencing_token, RESP, now=NOW, retention=100)
    assert not key_store.release(H, rec.fencing_token)
    assert key_store.get(H) is not None


def test_released_key_reads_absent_and_reclaims_with_a_larger_token(
    key_store: KeyStore,
) -> None:
    """A released key reads back as None; claiming it succeeds with a larger token."""
    _, first = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.release(H, first.fencing_token)
    assert key_store.get(H) is None
    claimed, rec = key_store.claim(H, "other", now=NOW + 1, lease=10, retention=100)
    assert claimed and rec.fencing_token > first.fencing_token
    assert (rec.state, rec.fingerprint, rec.response) == (KeyState.RUNNING, "other", None)
    got = key_store.get(H)
    assert got is not None and got.fencing_token == rec.fencing_token


def test_released_key_matches_no_fenced_write(key_store: KeyStore) -> None:
    """After release the owner's take_over, complete, extend and release all fail."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.release(H, rec.fencing_token)
    assert key_store.take_over(H, rec.fencing_token, now=NOW + 50, lease=10) is None
    assert not key_store.complete(H, rec.fencing_token, RESP, now=NOW + 1, retention=100)
    assert not key_store.extend_lease(H, rec.fencing_token, now=NOW + 1, lease=10)
    assert not key_store.release(H, rec.fencing_token)
    assert key_store.get(H) is None


def test_fenced_out_owner_cannot_overwrite_after_release_and_reclaim(
    key_store: KeyStore,
) -> None:
    """Claim, take-over, release, new claim: the new token beats every earlier one, and the
    first (hung) owner's complete, release and extend fail and change nothing (SPEC §3)."""
    _, a = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    b = key_store.take_over(H, a.fencing_token, now=NOW + 11, lease=10)
    assert b is not None
    assert key_store.release(H, b.fencing_token)  # B's handler answered 5xx
    claimed, c = key_store.claim(H, FP, now=NOW + 12, lease=10, retention=100)
    assert claimed and c.fencing_token > max(a.fencing_token, b.fencing_token)
    assert not key_store.complete(H, a.fencing_token, RESP, now=NOW + 13, retention=100)
    assert not key_store.release(H, a.fencing_token)
    assert not key_store.extend_lease(H, a.fencing_token, now=NOW + 13, lease=50)
    assert key_store.get(H) == c
    assert key_store.complete(
        H, c.fencing_token, StoredResponse(200, (), b"c"), now=NOW + 14, retention=100
    )
    got = key_store.get(H)
    assert got is not None and got.response == StoredResponse(200, (), b"c")


def test_take_over_requires_an_expired_lease(key_store: KeyStore) -> None:
    """take_over fails while the lease is valid and succeeds after it expired."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.take_over(H, rec.fencing_token, now=NOW + 5, lease=10) is None
    new = key_store.take_over(H, rec.fencing_token, now=NOW + 10, lease=10)
    assert new is not None and new.fencing_token == rec.fencing_token + 1
    assert new.lease_expires_at == NOW + 20


def test_fenced_out_owner_cannot_overwrite(key_store: KeyStore) -> None:
    """After a takeover the old owner's complete, release and extend all fail."""
    _, old = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    new = key_store.take_over(H, old.fencing_token, now=NOW + 11, lease=10)
    assert new is not None
    assert not key_store.complete(H, old.fencing_token, RESP, now=NOW + 12, retention=100)
    assert not key_store.release(H, old.fencing_token)
    assert not key_store.extend_lease(H, old.fencing_token, now=NOW + 12, lease=10)
    assert key_store.complete(H, new.fencing_token, RESP, now=NOW + 12, retention=100)
    got = key_store.get(H)
    assert got is not None and got.fencing_token == new.fencing_token


def test_only_one_of_two_takeovers_wins(key_store: KeyStore) -> None:
    """Two takeovers from the same expired token: exactly one succeeds."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    a = key_store.take_over(H, rec.fencing_token, now=NOW + 11, lease=10)
    b = key_store.take_over(H, rec.fencing_token, now=NOW + 11, lease=10)
    assert (a is None) != (b is None)


def test_extend_lease(key_store: KeyStore) -> None:
    """The owner can move its lease forward."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.extend_lease(H, rec.fencing_token, now=NOW + 5, lease=10)
    got = key_store.get(H)
    assert got is not None and got.lease_expires_at == NOW + 15


def test_purge_removes_only_expired(key_store: KeyStore) -> None:
    """purge_keys deletes records past retention, in batches, and keeps live ones."""
    for i in range(25):
        key_store.claim(f"{i:064x}", FP, now=NOW, lease=1, retention=10)
    key_store.claim(H, FP, now=NOW, lease=1, retention=1000)
    assert key_store.purge_keys(now=NOW + 10, batch=7) == 25
    assert key_store.get(H) is not None
    assert key_store.purge_keys(now=NOW + 10) == 0


def test_purge_keeps_released_keys_until_retention_ends(key_store: KeyStore) -> None:
    """A purge before a released key's retention ended keeps its token history."""
    _, first = key_store.claim(H, FP, now=NOW, lease=1, retention=10)
    assert key_store.release(H, first.fencing_token)
    key_store.purge_keys(now=NOW + 9)
    claimed, rec = key_store.claim(H, FP, now=NOW + 9, lease=1, retention=10)
    assert claimed and rec.fencing_token > first.fencing_token


def test_purge_removes_released_keys_past_retention(key_store: KeyStore) -> None:
    """purge_keys deletes released keys (tombstones) once their retention ended."""
    for i in range(25):
        _, rec = key_store.claim(f"{i:064x}", FP, now=NOW, lease=1, retention=10)
        assert key_store.release(rec.key_hash, rec.fencing_token)
    key_store.claim(H, FP, now=NOW, lease=1, retention=1000)
    # Redis deletes a released record at once (its per-key token counter, with a native
    # TTL, carries the history), so only the tombstone-keeping stores have rows to purge.
    tombstones = 0 if getattr(key_store, "dialect", "") == "redis" else 25
    assert key_store.purge_keys(now=NOW + 10, batch=7) == tombstones
    assert key_store.purge_keys(now=NOW + 10) == 0
    assert key_store.get(H) is not None
    assert all(key_store.get(f"{i:064x}") is None for i in range(25))


def test_concurrent_claims_have_one_winner(key_store: KeyStore) -> None:
    """Of 32 threads claiming one absent key at once, exactly one wins."""
    barrier = threading.Barrier(32)

    def claim(_: int) -> bool:
        barrier.wait()
        return key_store.claim(H, FP, now=NOW, lease=10, retention=100)[0]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(claim, range(32)))
    assert results.count(True) == 1


@pytest.mark.anyio
async def test_async_face_keeps_the_contract(key_store: KeyStore) -> None:
    """The async face claims, completes and fences like the sync store."""
    store = as_async_key_store(key_store)
    try:
        claimed, rec = await store.claim(H, FP, now=NOW, lease=10, retention=100)
        assert claimed
        assert not (await store.claim(H, FP, now=NOW, lease=10, retention=100))[0]
        assert not await store.complete(H, rec.fencing_token + 1, RESP, now=NOW, retention=100)
        assert await store.complete(H, rec.fencing_token, RESP, now=NOW, retention=100)
        got = await store.get(H)
        assert got is not None and got.response == RESP
        assert await store.take_over(H, rec.fencing_token, now=NOW + 50, lease=10) is None
        assert not await store.extend_lease(H, rec.fencing_token, now=NOW, lease=10)
        assert not await store.release(H, rec.fencing_token)
    finally:
        await _aclose(store)


@pytest.mark.anyio
async def test_async_face_fences_takeovers(key_store: KeyStore) -> None:
    """On the async face a takeover fences the old owner out of extend, release and
    complete."""
    store = as_async_key_store(key_store)
    try:
        _, old = await store.claim(H, FP, now=NOW, lease=10, retention=100)
        new = await store.take_over(H, old.fencing_token, now=NOW + 10, lease=10)
        assert new is not None and new.fencing_token == old.fencing_token + 1
        assert not await store.extend_lease(H, old.fencing_token, now=NOW + 11, lease=10)
        assert await store.extend_lease(H, new.fencing_token, now=NOW + 11, lease=10)
        assert not await store.release(H, old.fencing_token)
        assert await store.release(H, new.fencing_token)
        assert await store.get(H) is None
    finally:
        await _aclose(store)


@pytest.mark.anyio
async def test_concurrent_async_claims_have_one_winner(key_store: KeyStore) -> None:
    """Of 16 claims of one absent key issued at once on the async face, exactly one wins and
    every loser sees the winner's token."""
    store = as_async_key_store(key_store)
    try:
        results = await asyncio.gather(
            *(store.claim(H, FP, now=NOW, lease=10, retention=100) for _ in range(16))
        )
    finally:
        await _aclose(store)
    assert [claimed for claimed, _ in results].count(True) == 1
    assert {rec.fencing_token for _, rec in results} == {1}
