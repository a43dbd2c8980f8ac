"""SPEC §3 decision table and §4 storage rule, as pure functions."""

from __future__ import annotations

import pytest

from retrysafe.core import (
    Claim,
    InProgress,
    InvalidKey,
    Keyed,
    KeyRecord,
    KeyReused,
    KeyState,
    MissingKey,
    NotProtected,
    Replay,
    ReplayUnavailable,
    StoredResponse,
    TakeOver,
    Unkeyed,
    check_key,
    decide,
    should_store,
)

FP = "a" * 64
OTHER = "b" * 64
NOW = 1_000_000.0
METHODS = frozenset({"POST", "PATCH"})


def _record(
    state: KeyState = KeyState.RUNNING,
    *,
    fingerprint: str = FP,
    lease_left: float = 30.0,
    expires_in: float = 3600.0,
    response: StoredResponse | None = None,
) -> KeyRecord:
    return KeyRecord(
        key_hash="h" * 64,
        fingerprint=fingerprint,
        state=state,
        fencing_token=3,
        lease_expires_at=NOW + lease_left,
        expires_at=NOW + expires_in,
        response=response,
    )


def test_unprotected_method_is_not_protected() -> None:
    """GET (not in the protected set) passes through whatever its headers."""
    assert check_key("GET", "k", protected_methods=METHODS, key_required=True) == NotProtected()


def test_missing_key_on_required_route() -> None:
    """No key where one is required: MissingKey (400 missing-key)."""
    assert check_key("POST", None, protected_methods=METHODS, key_required=True) == MissingKey()


def test_missing_key_on_optional_route() -> None:
    """No key where it is optional: Unkeyed (run unprotected)."""
    assert check_key("POST", None, protected_methods=METHODS, key_required=False) == Unkeyed()


def test_malformed_key() -> None:
    """A malformed key: InvalidKey carrying the reason."""
    check = check_key("PATCH", "a b", protected_methods=METHODS, key_required=False)
    assert isinstance(check, InvalidKey)
    assert "visible ASCII" in check.error.reason


def test_valid_key() -> None:
    """A valid key, in either form, gives Keyed with the parsed key."""
    assert check_key("POST", '"k1"', protected_methods=METHODS, key_required=False) == Keyed("k1")


def test_absent_key_is_claimed() -> None:
    """No record: claim."""
    assert decide(None, FP, NOW) == Claim()


def test_expired_record_is_claimed() -> None:
    """A record past its retention counts as absent, whatever its fingerprint."""
    assert decide(_record(fingerprint=OTHER, expires_in=0.0), FP, NOW) == Claim()


def test_completed_same_fingerprint_replays() -> None:
    """Completed with the same fingerprint: replay the stored response."""
    stored = StoredResponse(201, (("location", "/x/1"),), b"{}")
    assert decide(_record(KeyState.COMPLETED, response=stored), FP, NOW) == Replay(stored)


def test_completed_empty_body_replays() -> None:
    """An empty stored body is still a replayable response."""
    stored = StoredResponse(204, (), b"")
    assert decide(_record(KeyState.COMPLETED, response=stored), FP, NOW) == Replay(stored)


def test_completed_unreplayable_keeps_status() -> None:
    """Completed but too large to keep: ReplayUnavailable with the original status."""
    stored = StoredResponse(201, (), b"", replayable=False)
    decision = decide(_record(KeyState.COMPLETED, response=stored), FP, NOW)
    assert decision == ReplayUnavailable(201)


@pytest.mark.parametrize("state", [KeyState.RUNNING, KeyState.COMPLETED])
def test_other_fingerprint_is_key_reused(state: KeyState) -> None:
    """Completed or running under another fingerprint: KeyReused with both fingerprints."""
    stored = StoredResponse(200, (), b"") if state is KeyState.COMPLETED else None
    decision = decide(_record(state, fingerprint=OTHER, response=stored), FP, NOW)
    assert decision == KeyReused(OTHER, FP)


def test_running_with_valid_lease_is_in_progress() -> None:
    """Running, lease valid: InProgress with a Retry-After of 1–5 s."""
    decision = decide(_record(lease_left=2.5), FP, NOW)
    assert decision == InProgress(2.5, 3)
    long_lease = decide(_record(lease_left=60.0), FP, NOW)
    assert isinstance(long_lease, InProgress)
    assert long_lease.retry_after == 5


def test_running_with_expired_lease_is_taken_over() -> None:
    """Running, lease expired (owner crashed): TakeOver from the current fencing token."""
    assert decide(_record(lease_left=0.0), FP, NOW) == TakeOver(3)


@pytest.mark.parametrize(
    ("status", "stored"),
    [
        (200, True),
        (201, True),
        (204, True),
        (302, True),
        (400, True),
        (404, True),
        (409, True),
        (422, True),
        (408, False),
        (429, False),
        (500, False),
        (503, False),
    ],
)
def test_should_store(status: int, stored: bool) -> None:
    """2xx, 3xx, 4xx are stored except 408 and 429; 5xx is released."""
    assert should_store(status) is stored


def test_should_store_server_errors_when_asked() -> None:
    """``store_server_errors`` stores 5xx (Stripe) but never 408/429."""
    assert should_store(503, store_server_errors=True)
    assert not should_store(429, store_server_errors=True)


def test_409_with_retry_after_is_not_stored() -> None:
    """An upstream's 409 + Retry-After (request in progress) describes the attempt: not stored;
    a plain 409 conflict is a final answer and is stored."""
    assert not should_store(409, retry_after=True)
    assert should_store(409)
