"""An in-process store for unit tests. **Unsafe for production** (SPEC §9).

It lives in one process's memory: several API replicas each keep their own keys and a restart
forgets every key, so duplicates come back. Use :class:`~retrysafe.stores.SQLiteStore` (one
host) or PostgreSQL/Redis (many) for anything real.
"""

from __future__ import annotations

import dataclasses
import threading

from retrysafe.core import KeyRecord, KeyState, StoredResponse
from retrysafe.stores._base import AsyncKeyStore, SyncKeysFace

__all__ = ["MemoryStore"]


class MemoryStore:
    """Dict-backed :class:`~retrysafe.stores.KeyStore`; one lock makes each primitive atomic."""

    dialect = "memory"
    url = "memory://"

    def __init__(self) -> None:
        self._keys: dict[str, KeyRecord] = {}
        # Tombstones of released keys: key hash -> (last fencing token, expires_at). They
        # read as absent but keep the token sequence going (see KeyStore).
        self._released: dict[str, tuple[int, float]] = {}
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
                last = self._released.pop(key_hash, (0, 0.0))[0]
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
            self._released[key_hash] = (rec.fencing_token, rec.expires_at)
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
            gone = [k for k, (_, exp) in self._released.items() if exp <= now]
            for k in gone:
                del self._released[k]
            return len(dead) + len(gone)

    def close(self) -> None:
        pass

    def asyncio_key_store(self) -> AsyncKeyStore:
        """The async face: each call is a dict operation, run inline."""
        return SyncKeysFace(self, in_thread=False)
