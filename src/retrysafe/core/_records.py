"""Values shared by the core rules and the stores. Plain frozen data; no behaviour."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["KeyRecord", "KeyState", "StoredResponse"]


class KeyState(str, enum.Enum):
    """Where a claimed idempotency key stands."""

    RUNNING = "running"
    """Claimed; a handler holds the lease and has not finished."""
    COMPLETED = "completed"
    """Finished; the response is stored for replay until the retention window ends."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response kept for replay (SPEC §4).

    Attributes:
        status: HTTP status code.
        headers: the replayable headers only, as ``(lower-case name, value)`` pairs.
        body: the body bytes; empty when ``replayable`` is False.
        replayable: False when the body was larger than the replay limit: the key is still
            completed (the handler never re-runs) but a repeat cannot get the body back.
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    replayable: bool = True


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One idempotency key as a store holds it.

    Attributes:
        key_hash: SHA-256 hex of (scope, key); see :func:`retrysafe.core.key_hash`.
        fingerprint: SHA-256 hex of the request that claimed the key.
        state: running or completed.
        fencing_token: increases by one on every claim of this key hash (first claim: 1,
            takeover or re-claim after expiry: +1). Only the holder of the current token may
            complete or release the key.
        lease_expires_at: Unix time (seconds) after which a running claim may be taken over.
        expires_at: Unix time (seconds) after which the record counts as absent (retention).
        response: the stored response once completed, else None.
    """

    key_hash: str
    fingerprint: str
    state: KeyState
    fencing_token: int
    lease_expires_at: float
    expires_at: float
    response: StoredResponse | None = None
