"""The KeyStore contract (stores/_base.py), run against every store."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from retrysafe import ConfigurationError
from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores import AsyncKeyStore, KeyStore, as_async_key_store
from retrysafe.stores._base import KeyAdmin, KeyPosition

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


def test_a_claimed_record_is_the_record_the_store_holds(key_store: KeyStore) -> None:
    """What a first claim returns is what the store wrote, to the last bit of each time (a
    SQL store computes a first claim's times from the caller's, without reading them back),
    and so is a re-claim's."""
    now, lease, retention = 1_700_000_000.123456789, 0.1 + 0.2, 86_400.7
    claimed, rec = key_store.claim(H, FP, now=now, lease=lease, retention=retention)
    assert claimed and key_store.get(H) == rec
    assert (rec.lease_expires_at, rec.expires_at) == (now + lease, now + retention)
    later = now + retention + 1
    again, rec2 = key_store.claim(H, "fp-2", now=later, lease=lease, retention=retention)
    assert again and rec2.fencing_token == 2 and key_store.get(H) == rec2


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


# ---------------------------------------------------------------------- KeyAdmin (retrysafe keys)
def _admin(store: KeyStore) -> KeyAdmin:
    """The store's operator primitives (every store of the package offers them)."""
    assert isinstance(store, KeyAdmin)
    return store


def _keeps_tombstones(store: KeyStore) -> bool:
    """Redis forgets a released record at once; the other stores keep a tombstone."""
    return getattr(store, "dialect", "") != "redis"


def _hash(i: int) -> str:
    return f"{i:064x}"


def test_every_store_offers_the_operator_primitives(key_store: KeyStore) -> None:
    """Each store is a KeyAdmin: list_keys, find_keys and evict."""
    assert isinstance(key_store, KeyAdmin)


def test_list_keys_is_newest_first_and_carries_no_bodies(key_store: KeyStore) -> None:
    """Records come newest claim first with their stored answer's status, headers and body
    size, but never the body itself."""
    for i in range(3):
        key_store.claim(_hash(i), FP, now=NOW + i, lease=10, retention=100)
    key_store.complete(_hash(1), 1, RESP, now=NOW + 3, retention=100)
    listed = _admin(key_store).list_keys(now=NOW + 4)
    assert [e.key_hash for e in listed] == [_hash(2), _hash(1), _hash(0)]
    assert [e.created_at for e in listed] == [NOW + 2, NOW + 1, NOW]
    done = listed[1]
    assert (done.state, done.status, done.headers) == ("completed", 201, RESP.headers)
    assert (done.body_size, done.body, done.fingerprint, done.fencing_token) == (
        len(RESP.body),
        None,
        FP,
        1,
    )
    running = listed[0]
    assert (running.state, running.status, running.body_size) == ("running", None, None)
    assert (running.lease_expires_at, running.expires_at) == (NOW + 12, NOW + 102)


def test_list_keys_pages_by_keyset_without_gaps_or_repeats(key_store: KeyStore) -> None:
    """Pages of 3 continued from the previous page's last entry list all 8 records exactly
    once, in order, ties on the claim time broken by key hash."""
    for i in range(8):
        key_store.claim(_hash(i), FP, now=NOW + i // 2, lease=10, retention=100)
    admin = _admin(key_store)
    seen: list[str] = []
    page = admin.list_keys(now=NOW, limit=3)
    for _ in range(4):  # 3 + 3 + 2, then an empty page; a page that repeats fails below
        assert len(page) <= 3
        seen += [e.key_hash for e in page]
        if not page:
            break
        page = admin.list_keys(now=NOW, limit=3, after=page[-1])
    assert seen == [_hash(i) for i in (7, 6, 5, 4, 3, 2, 1, 0)]


def test_list_keys_continues_from_a_position_whose_record_is_gone(key_store: KeyStore) -> None:
    """A page continues from a KeyPosition (claim time, key hash) even after the record at
    that position was purged: the keyset names a place in the order, not a record."""
    for i in range(4):
        key_store.claim(_hash(i), FP, now=NOW + i, lease=10, retention=100 if i != 2 else 5)
    admin = _admin(key_store)
    first = admin.list_keys(now=NOW + 3, limit=2)
    assert [e.key_hash for e in first] == [_hash(3), _hash(2)]
    assert key_store.purge_keys(now=NOW + 50) >= 1  # _hash(2)'s retention ended at NOW + 7
    assert admin.find_keys(_hash(2), now=NOW + 50) == []
    rest = admin.list_keys(now=NOW + 50, after=KeyPosition(NOW + 2, _hash(2)))
    assert [e.key_hash for e in rest] == [_hash(1), _hash(0)]


def test_list_keys_filters_by_the_state_a_record_has_now(key_store: KeyStore) -> None:
    """running, completed, released and expired select disjoint records: an expired one is
    expired whatever was stored, a released one (a tombstone) is listed where the store keeps
    it."""
    running, completed, released, expired = (_hash(i) for i in range(4))
    key_store.claim(running, FP, now=NOW, lease=10, retention=100)
    key_store.claim(completed, FP, now=NOW, lease=10, retention=100)
    key_store.complete(completed, 1, RESP, now=NOW, retention=100)
    key_store.claim(released, FP, now=NOW, lease=10, retention=100)
    key_store.release(released, 1)
    key_store.claim(expired, FP, now=NOW - 100, lease=10, retention=50)
    admin = _admin(key_store)

    def hashes(*states: str) -> set[str]:
        return {e.key_hash for e in admin.list_keys(now=NOW, states=states)}

    assert hashes("running") == {running}
    assert hashes("completed") == {completed}
    assert hashes("expired") == {expired}
    assert hashes("released") == ({released} if _keeps_tombstones(key_store) else set())
    assert hashes("running", "expired") == {running, expired}
    everything = {e.key_hash: e.state for e in admin.list_keys(now=NOW)}
    assert everything.pop(released, "released") == "released"
    assert everything == {running: "running", completed: "completed", expired: "expired"}


def test_list_keys_refuses_a_bad_limit_or_state(key_store: KeyStore) -> None:
    """limit < 1 and an unknown state are ConfigurationErrors naming the option."""
    admin = _admin(key_store)
    with pytest.raises(ConfigurationError) as bad_limit:
        admin.list_keys(now=NOW, limit=0)
    assert bad_limit.value.option == "limit"
    with pytest.raises(ConfigurationError) as bad_state:
        admin.list_keys(now=NOW, states=["done"])
    assert bad_state.value.option == "states" and "done" in str(bad_state.value)


def test_find_keys_by_whole_hash_or_prefix(key_store: KeyStore) -> None:
    """A whole hash finds its record with the body; a prefix of two records finds both (in
    hash order); an empty, non-hex or unknown prefix finds none."""
    a, b = "ab" + "0" * 62, "ab" + "1" * 62
    for h in (a, b, "cd" + "0" * 62):
        key_store.claim(h, FP, now=NOW, lease=10, retention=100)
    key_store.complete(a, 1, RESP, now=NOW, retention=100)
    admin = _admin(key_store)
    (found,) = admin.find_keys(a, now=NOW)
    assert (found.key_hash, found.state, found.body, found.body_size) == (
        a,
        "completed",
        RESP.body,
        len(RESP.body),
    )
    assert [e.key_hash for e in admin.find_keys("ab", now=NOW)] == [a, b]
    assert [e.key_hash for e in admin.find_keys("ab1", now=NOW)] == [b]
    assert admin.find_keys("ab", now=NOW, limit=1)[0].key_hash == a
    assert admin.find_keys("", now=NOW) == []
    assert admin.find_keys("ef", now=NOW) == []
    assert admin.find_keys("a%", now=NOW) == []
    assert admin.find_keys("*", now=NOW) == []


def test_claim_records_when_the_record_was_claimed(key_store: KeyStore) -> None:
    """created_at is the claim's time; a take-over keeps it; a claim after expiry writes a new
    record with a new time."""
    admin = _admin(key_store)
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert admin.find_keys(H, now=NOW)[0].created_at == NOW
    taken = key_store.take_over(H, rec.fencing_token, now=NOW + 20, lease=10)
    assert taken is not None
    assert admin.find_keys(H, now=NOW + 20)[0].created_at == NOW
    key_store.claim(H, FP, now=NOW + 100, lease=10, retention=100)
    assert admin.find_keys(H, now=NOW + 100)[0].created_at == NOW + 100


def test_evict_forgets_a_completed_key_and_the_next_claim_runs_again(
    key_store: KeyStore,
) -> None:
    """Evicting a completed record makes it read as absent; the next claim succeeds with a
    larger token (the request would run the handler again)."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    key_store.complete(H, rec.fencing_token, RESP, now=NOW, retention=100)
    assert _admin(key_store).evict(H, rec.fencing_token)
    assert key_store.get(H) is None
    claimed, again = key_store.claim(H, FP, now=NOW + 1, lease=10, retention=100)
    assert claimed and again.fencing_token > rec.fencing_token and again.response is None


def test_evict_with_a_token_that_changed_changes_nothing(key_store: KeyStore) -> None:
    """After a take-over the token an operator read is stale: evict returns False and the
    record stays as it is."""
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    taken = key_store.take_over(H, rec.fencing_token, now=NOW + 10, lease=10)
    assert taken is not None
    assert not _admin(key_store).evict(H, rec.fencing_token)
    assert key_store.get(H) == taken


def test_an_evicted_owner_matches_no_fenced_write(key_store: KeyStore) -> None:
    """A running record evicted under its owner: the owner's complete, extend, release and
    take-over change nothing, before and after a new claim, whose token is larger (SPEC §3
    fencing)."""
    _, owner = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert _admin(key_store).evict(H, owner.fencing_token)
    t = owner.fencing_token
    assert not key_store.complete(H, t, RESP, now=NOW + 1, retention=100)
    assert not key_store.extend_lease(H, t, now=NOW + 1, lease=10)
    assert not key_store.release(H, t)
    assert key_store.take_over(H, t, now=NOW + 50, lease=10) is None
    claimed, new = key_store.claim(H, FP, now=NOW + 2, lease=10, retention=100)
    assert claimed and new.fencing_token > t
    assert not key_store.complete(H, t, RESP, now=NOW + 3, retention=100)
    assert key_store.get(H) == new


def test_evict_of_an_absent_or_released_key_is_false(key_store: KeyStore) -> None:
    """Nothing to forget: an unknown key hash, or a key released already."""
    admin = _admin(key_store)
    assert not admin.evict(H, 1)
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert key_store.release(H, rec.fencing_token)
    assert not admin.evict(H, rec.fencing_token)
    claimed, again = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    assert claimed and again.fencing_token > rec.fencing_token


def test_an_evicted_key_reads_as_released_until_its_retention_ends(key_store: KeyStore) -> None:
    """On every store (Redis too: a marker) an evicted record is found, and listed, as
    released with its token and claim time; a second evict is False; a new claim is what the
    key reads as again; a purge after the retention removes the evicted one."""
    admin = _admin(key_store)
    _, rec = key_store.claim(H, FP, now=NOW, lease=10, retention=100)
    key_store.complete(H, rec.fencing_token, RESP, now=NOW, retention=100)
    assert admin.evict(H, rec.fencing_token)
    (found,) = admin.find_keys(H, now=NOW + 1)
    assert (found.state, found.fencing_token, found.created_at) == ("released", 1, NOW)
    assert (found.status, found.body, found.fingerprint) == (None, None, "")
    assert [e.key_hash for e in admin.find_keys(H[:8], now=NOW + 1)] == [H]
    assert [e.key_hash for e in admin.list_keys(now=NOW + 1, states=["released"])] == [H]
    assert not admin.evict(H, rec.fencing_token)
    assert key_store.get(H) is None
    claimed, again = key_store.claim(H, FP, now=NOW + 2, lease=10, retention=100)
    assert claimed and again.fencing_token > rec.fencing_token
    (now_found,) = admin.find_keys(H, now=NOW + 3)
    assert (now_found.state, now_found.fencing_token) == ("running", again.fencing_token)
    assert [e.state for e in admin.list_keys(now=NOW + 3)] == ["running"]
    assert admin.evict(H, again.fencing_token)
    key_store.purge_keys(now=NOW + 500)
    assert admin.find_keys(H, now=NOW + 500) == []
    assert admin.list_keys(now=NOW + 500) == []
