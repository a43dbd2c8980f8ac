"""An in-process store for unit tests. **Unsafe for production** (SPEC §9).

It lives in one process's memory: several API replicas each keep their own keys and a restart
forgets every key, so duplicates come back. Use :class:`~retrysafe.stores.SQLiteStore` (one
host) or PostgreSQL/Redis (many) for anything real.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection

from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._base import (
    AsyncKeyStore,
    KeyEntry,
    KeyPosition,
    SyncKeysFace,
    check_limit,
    listed_states,
    page_of,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    """Dict-backed :class:`~retrysafe.stores.KeyStore` (and
    :class:`~retrysafe.stores._base.KeyAdmin`); one lock makes each primitive atomic."""

    dialect = "memory"
    url = "memory://"

    def __init__(self) -> None:
        self._keys: dict[str, KeyRecord] = {}
        # Tombstones of released (or evicted) keys: key hash -> the last record. They read as
        # absent but keep the token sequence going (see KeyStore).
        self._released: dict[str, KeyRecord] = {}
        # When each record (or tombstone) was claimed: KeyRecord has no such field.
        self._created: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "MemoryStore()"

    def claim(
        self, key_hash: str, fingerprint: str, *, now: float, lease: float, retention: float
    ) -> tuple[bool, KeyRecord]:
        with self._lock:
            existing = self._keys.get(key_hash)
            if existing is not None and existing.expires_at > now:
                return False, existing
            if existing is not None:
                last = existing.fencing_token
            else:
                tombstone = self._released.pop(key_hash, None)
                last = 0 if tombstone is None else tombstone.fencing_token
            self._created[key_hash] = now
            record = KeyRecord(
                key_hash=key_hash,
                fingerprint=fingerprint,
                state=KeyState.RUNNING,
                fencing_token=last + 1,
                lease_expires_at=now + lease,
                expires_at=now + retention,
            )
            self._keys[key_hash] = record
            return True, record

    def _owned(self, key_hash: str, token: int) -> KeyRecord | None:
        rec = self._keys.get(key_hash)
        if rec is None or rec.fencing_token != token or rec.state is not KeyState.RUNNING:
            return None
        return rec

    def take_over(
        self, key_hash: str, fencing_token: int, *, now: float, lease: float
    ) -> KeyRecord | None:
        with self._lock:
            rec = self._owned(key_hash, fencing_token)
            if rec is None or rec.lease_expires_at > now:
                return None
            new = dataclasses.replace(
                rec, fencing_token=rec.fencing_token + 1, lease_expires_at=now + lease
            )
            self._keys[key_hash] = new
            return new

    def complete(
        self,
        key_hash: str,
        fencing_token: int,
        response: StoredResponse,
        *,
        now: float,
        retention: float,
    ) -> bool:
        with self._lock:
            rec = self._owned(key_hash, fencing_token)
            if rec is None:
                return False
            self._keys[key_hash] = dataclasses.replace(
                rec, state=KeyState.COMPLETED, response=response, expires_at=now + retention
            )
            return True

    def release(self, key_hash: str, fencing_token: int) -> bool:
        with self._lock:
            rec = self._owned(key_hash, fencing_token)
            if rec is None:
                return False
            del self._keys[key_hash]
            self._released[key_hash] = rec
            return True

    def extend_lease(self, key_hash: str, fencing_token: int, *, now: float, lease: float) -> bool:
        with self._lock:
            rec = self._owned(key_hash, fencing_token)
            if rec is None:
                return False
            self._keys[key_hash] = dataclasses.replace(rec, lease_expires_at=now + lease)
            return True

    def get(self, key_hash: str) -> KeyRecord | None:
        with self._lock:
            return self._keys.get(key_hash)

    def purge_keys(self, *, now: float, batch: int = 1000) -> int:
        with self._lock:
            dead = [k for k, r in self._keys.items() if r.expires_at <= now]
            for k in dead:
                del self._keys[k]
            gone = [k for k, r in self._released.items() if r.expires_at <= now]
            for k in gone:
                del self._released[k]
            for k in (*dead, *gone):
                self._created.pop(k, None)
            return len(dead) + len(gone)

    # ------------------------------------------------------------------ KeyAdmin
    def _entry(self, key_hash: str, rec: KeyRecord, *, released: bool, now: float) -> KeyEntry:
        response = None if released else rec.response
        return KeyEntry(
            key_hash=key_hash,
            state=(
                "expired"
                if rec.expires_at <= now
                else "released"
                if released
                else rec.state.value
            ),
            fingerprint="" if released else rec.fingerprint,
            fencing_token=rec.fencing_token,
            lease_expires_at=rec.lease_expires_at,
            expires_at=rec.expires_at,
            created_at=self._created.get(key_hash),
            status=None if response is None else response.status,
            headers=() if response is None else response.headers,
            body_size=None if response is None else len(response.body),
            replayable=True if response is None else response.replayable,
            body=None if response is None else response.body,
        )

    def _entries(self, now: float) -> list[KeyEntry]:
        return [
            *(self._entry(k, r, released=False, now=now) for k, r in self._keys.items()),
            *(self._entry(k, r, released=True, now=now) for k, r in self._released.items()),
        ]

    def list_keys(
        self,
        *,
        now: float,
        limit: int = 100,
        states: Collection[str] | None = None,
        after: KeyEntry | KeyPosition | None = None,
    ) -> list[KeyEntry]:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.list_keys`."""
        wanted = listed_states(states, limit)
        with self._lock:
            entries = self._entries(now)
        page = page_of(entries, limit=limit, states=wanted, after=after)
        return [dataclasses.replace(e, body=None) for e in page]

    def find_keys(self, prefix: str, *, now: float, limit: int = 2) -> list[KeyEntry]:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.find_keys`."""
        check_limit(limit)
        with self._lock:
            found = [e for e in self._entries(now) if prefix and e.key_hash.startswith(prefix)]
        return sorted(found, key=lambda e: e.key_hash)[:limit]

    def evict(self, key_hash: str, fencing_token: int) -> bool:
        """See :meth:`~retrysafe.stores._base.KeyAdmin.evict`: the record becomes a tombstone."""
        with self._lock:
            rec = self._keys.get(key_hash)
            if rec is None or rec.fencing_token != fencing_token:
                return False
            del self._keys[key_hash]
            self._released[key_hash] = rec
            return True

    def close(self) -> None:
        pass

    def asyncio_key_store(self) -> AsyncKeyStore:
        """The async face: each call is a dict operation, run inline."""
        return SyncKeysFace(self, in_thread=False)
