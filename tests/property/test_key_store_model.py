"""The key-store contract (``retrysafe.stores.KeyStore``, SPEC §3, §9) as a model: random
sequences of claim / take_over / complete / release / extend_lease / get / purge_keys, with the
clock moved by hand (``now``), run on every store and compared after every step with a
plain-Python dict that follows the contract's docstring.

The model is exact: records, fencing tokens, lease ends and retention ends must match value for
value. Two documented differences between stores are part of it: a released key leaves a
tombstone row on SQLite, PostgreSQL and the memory store (``purge_keys`` counts it, and purging
it forgets the key's token history) while Redis deletes the record at once and keeps the token
history in a counter that outlives purges.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field, replace

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores import KeyStore

from .conftest import model_settings

NOW = 1_000_000.0
#: Purges with this ``now`` remove every record: the examples share one store and each
#: starts from an empty one.
END_OF_TIME = 1e18
FINGERPRINTS = st.sampled_from(["a" * 64, "b" * 64])
#: The owner's token (the model's current one for the key), or any other, mostly stale.
CURRENT = -1
TOKENS = st.one_of(st.just(CURRENT), st.just(CURRENT), st.integers(min_value=0, max_value=6))
#: Indexes into the machine's three key hashes (the third is never claimed at the start).
KEYS = st.integers(0, 2)
LEASES = st.one_of(st.sampled_from([0.5, 1.0, 10.0, 30.0]), st.floats(0.001, 120.0))
# At least an hour: Redis also gives each record a native TTL in real time, which must not
# fire while a run lasts (the caller's clock only moves the record's own times).
RETENTIONS = st.one_of(st.sampled_from([3600.0, 7200.0, 86400.0]), st.floats(3600.0, 1e6))
STEPS = st.one_of(
    st.sampled_from([0.0, 0.25, 1.0, 10.0, 30.0, 3600.0, 86400.0]),
    st.floats(0.0, 200_000.0),
)
HEADER_VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=12)
RESPONSES = st.builds(
    StoredResponse,
    status=st.sampled_from([200, 201, 204, 302, 400, 404, 422]),
    headers=st.lists(
        st.tuples(st.sampled_from(["content-type", "location", "etag"]), HEADER_VALUES),
        max_size=3,
    ).map(tuple),
    body=st.binary(max_size=48),
    replayable=st.booleans(),
)


@dataclass
class KeysModel:
    """What the contract says a store holds (see the module docstring)."""

    keeps_tombstones: bool
    records: dict[str, KeyRecord] = field(default_factory=dict)
    tombstones: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: The last token the store still remembers per key hash.
    last_token: dict[str, int] = field(default_factory=dict)

    def owned(self, key: str, token: int) -> KeyRecord | None:
        rec = self.records.get(key)
        if rec is None or rec.state is not KeyState.RUNNING or rec.fencing_token != token:
            return None
        return rec

    def current_token(self, key: str) -> int:
        rec = self.records.get(key)
        return rec.fencing_token if rec is not None else self.last_token.get(key, 0)

    def claim(
        self, key: str, fp: str, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        rec = self.records.get(key)
        if rec is not None and rec.expires_at > now:
            return False, rec
        token = self.last_token.get(key, 0) + 1
        new = KeyRecord(key, fp, KeyState.RUNNING, token, now + lease, now + retention)
        self.records[key] = new
        self.tombstones.pop(key, None)
        self.last_token[key] = token
        return True, new

    def take_over(self, key: str, token: int, now: float, lease: float) -> KeyRecord | None:
        rec = self.owned(key, token)
        if rec is None or rec.lease_expires_at > now:
            return None
        new = replace(rec, fencing_token=token + 1, lease_expires_at=now + lease)
        self.records[key] = new
        self.last_token[key] = token + 1
        return new

    def complete(
        self, key: str, token: int, response: StoredResponse, now: float, retention: float
    ) -> bool:
        rec = self.owned(key, token)
        if rec is None:
            return False
        self.records[key] = replace(
            rec, state=KeyState.COMPLETED, response=response, expires_at=now + retention
        )
        return True

    def release(self, key: str, token: int) -> bool:
        rec = self.owned(key, token)
        if rec is None:
            return False
        del self.records[key]
        if self.keeps_tombstones:
            self.tombstones[key] = (rec.fencing_token, rec.expires_at)
        return True

    def extend_lease(self, key: str, token: int, now: float, lease: float) -> bool:
        rec = self.owned(key, token)
        if rec is None:
            return False
        self.records[key] = replace(rec, lease_expires_at=now + lease)
        return True

    def purge(self, now: float) -> int:
        dead = [k for k, r in self.records.items() if r.expires_at <= now]
        gone = [k for k, (_, exp) in self.tombstones.items() if exp <= now]
        for k in dead:
            del self.records[k]
        for k in gone:
            del self.tombstones[k]
        if self.keeps_tombstones:  # the row carried the token history
            for k in dead + gone:
                self.last_token.pop(k, None)
        return len(dead) + len(gone)


class KeyStoreMachine(RuleBasedStateMachine):
    """Drives one store and the model side by side; subclassed per test with ``store``."""

    store: KeyStore
    keeps_tombstones: bool
    #: Smallest purge batch: Redis takes ``batch`` as its SCAN count over the whole database,
    #: so tiny batches there cost a round trip per key of every other test sharing it.
    min_batch = 1

    def __init__(self) -> None:
        super().__init__()
        salt = uuid.uuid4().hex  # fresh key hashes: Redis token counters outlive purges
        self.keys = [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(3)]
        self.model = KeysModel(self.keeps_tombstones)
        self.now = NOW

    @initialize(fps=st.lists(FINGERPRINTS, min_size=2, max_size=2), lease=LEASES)
    def start_with_two_claims(self, fps: list[str], lease: float) -> None:
        """Every example starts from an empty store with two of its keys claimed."""
        for key in self.keys:
            assert self.store.get(key) is None
        for key, fp in zip(self.keys[:2], fps, strict=True):
            self.claim_key(key, fp, lease, 3600.0)

    def _token(self, key: str, token: int) -> int:
        return self.model.current_token(key) if token == CURRENT else token

    @rule(dt=STEPS)
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule(i=KEYS, retention=st.booleans())
    def wait_until_the_lease_or_retention_ends(self, i: int, retention: bool) -> None:
        """Move the clock exactly to a record's lease end (its owner stopped renewing) or
        retention end: the boundaries where ``<=`` and ``<`` differ."""
        rec = self.model.records.get(self.keys[i])
        if rec is not None:
            self.now = max(self.now, rec.expires_at if retention else rec.lease_expires_at)

    def claim_key(self, key: str, fp: str, lease: float, retention: float) -> None:
        got = self.store.claim(key, fp, now=self.now, lease=lease, retention=retention)
        assert got == self.model.claim(key, fp, self.now, lease, retention)

    @rule(i=KEYS, fp=FINGERPRINTS, lease=LEASES, retention=RETENTIONS)
    def claim(self, i: int, fp: str, lease: float, retention: float) -> None:
        self.claim_key(self.keys[i], fp, lease, retention)

    @rule(i=KEYS, token=TOKENS, lease=LEASES, crashed=st.booleans())
    def take_over(self, i: int, token: int, lease: float, crashed: bool) -> None:
        """``crashed``: the owner stopped renewing, so first wait until its lease ends."""
        key, token = self.keys[i], self._token(self.keys[i], token)
        rec = self.model.records.get(key)
        if crashed and rec is not None:
            self.now = max(self.now, rec.lease_expires_at)
        got = self.store.take_over(key, token, now=self.now, lease=lease)
        assert got == self.model.take_over(key, token, self.now, lease)

    @rule(i=KEYS, token=TOKENS, response=RESPONSES, retention=RETENTIONS)
    def complete(self, i: int, token: int, response: StoredResponse, retention: float) -> None:
        key, token = self.keys[i], self._token(self.keys[i], token)
        got = self.store.complete(key, token, response, now=self.now, retention=retention)
        assert got == self.model.complete(key, token, response, self.now, retention)

    @rule(i=KEYS, token=TOKENS)
    def release(self, i: int, token: int) -> None:
        key, token = self.keys[i], self._token(self.keys[i], token)
        assert self.store.release(key, token) == self.model.release(key, token)

    @rule(i=KEYS, token=TOKENS, lease=LEASES)
    def extend_lease(self, i: int, token: int, lease: float) -> None:
        key, token = self.keys[i], self._token(self.keys[i], token)
        got = self.store.extend_lease(key, token, now=self.now, lease=lease)
        assert got == self.model.extend_lease(key, token, self.now, lease)

    @rule(batch=st.integers(1, 4))
    def purge(self, batch: int) -> None:
        batch = max(batch, self.min_batch)
        assert self.store.purge_keys(now=self.now, batch=batch) == self.model.purge(self.now)

    @invariant()
    def every_key_reads_as_the_model_says(self) -> None:
        for key in self.keys:
            assert self.store.get(key) == self.model.records.get(key), key

    def teardown(self) -> None:
        removed = self.store.purge_keys(now=END_OF_TIME)
        note(f"teardown purged {removed} records")


def test_every_key_store_follows_the_contract_model(key_store: KeyStore) -> None:
    """On every store, any sequence of the seven primitives with any clock moves gives the
    records, tokens, answers and purge counts of the contract's model (SPEC §3, §9)."""
    dialect = getattr(key_store, "dialect", "")

    class Machine(KeyStoreMachine):
        store = key_store
        keeps_tombstones = dialect != "redis"
        min_batch = 500 if dialect == "redis" else 1

    run_state_machine_as_test(Machine, settings=model_settings(0.5))  # type: ignore[no-untyped-call]
