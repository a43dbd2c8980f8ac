"""The server's decision table (SPEC §3) as pure functions over values.

Drivers (the ASGI and WSGI middleware, the gateway) call :func:`check_key` before touching the
store, claim the key, and when the claim finds an existing record call :func:`decide`. Neither
function does I/O or reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from retrysafe._exceptions import InvalidKeyError
from retrysafe.core._keys import parse_key
from retrysafe.core._records import KeyRecord, KeyState, StoredResponse

__all__ = [
    "RACE_LIMIT",
    "Claim",
    "Decision",
    "InProgress",
    "InvalidKey",
    "KeyCheck",
    "KeyReused",
    "Keyed",
    "MissingKey",
    "NotProtected",
    "Replay",
    "ReplayUnavailable",
    "TakeOver",
    "Unkeyed",
    "check_key",
    "decide",
    "key_retention",
    "releases_unfinished",
    "should_store",
]


# ----------------------------------------------------------------------------- key check
@dataclass(frozen=True, slots=True)
class NotProtected:
    """The method is not protected (e.g. GET): pass straight through."""


@dataclass(frozen=True, slots=True)
class MissingKey:
    """Protected request without a key on a route that requires one: 400 ``missing-key``."""


@dataclass(frozen=True, slots=True)
class InvalidKey:
    """The key header is malformed: 400 ``invalid-key``."""

    error: InvalidKeyError


@dataclass(frozen=True, slots=True)
class Unkeyed:
    """Protected request without a key on a route where the key is optional: run, log."""


@dataclass(frozen=True, slots=True)
class Keyed:
    """Protected request with a valid key."""

    key: str


KeyCheck = NotProtected | MissingKey | InvalidKey | Unkeyed | Keyed


#: How many races in a row a claimant loses (another claimant claimed, released, purged or took
#: over the record between two of its statements) before it gives up. One limit for every store
#: and every claimant: a race needs another writer to win each time, so 8 in a row means a
#: retry storm or a bug, and waiting longer would not help.
RACE_LIMIT = 8


def key_retention(retention: float, lease: float) -> float:
    """Seconds a claimed record must live: at least its lease, so a key is never forgotten
    while its first attempt may still run (SPEC §3 "retention"). Stores keep what they are
    given; every claimant passes this.
    """
    return max(retention, lease)


def check_key(
    method: str,
    header: str | None,
    *,
    protected_methods: Collection[str],
    key_required: bool,
) -> KeyCheck:
    """First rows of SPEC §3: is the request protected, and is its key present and valid?

    Args:
        method: request method, upper case.
        header: the ``Idempotency-Key`` header value, or None when absent.
        protected_methods: upper-case methods that are protected (default POST, PATCH).
        key_required: whether this route requires a key.
    """
    if method not in protected_methods:
        return NotProtected()
    if header is None:
        return MissingKey() if key_required else Unkeyed()
    try:
        return Keyed(parse_key(header))
    except InvalidKeyError as exc:
        return InvalidKey(exc)


# ----------------------------------------------------------------------------- decision
@dataclass(frozen=True, slots=True)
class Claim:
    """No live record: claim the key and run the handler."""


@dataclass(frozen=True, slots=True)
class Replay:
    """Completed with the same fingerprint: send the stored response, do not run the handler."""

    response: StoredResponse


@dataclass(frozen=True, slots=True)
class ReplayUnavailable:
    """Completed, but the response exceeded the replay limit; the handler must not run again."""

    status: int


@dataclass(frozen=True, slots=True)
class KeyReused:
    """The key belongs to a different request: 422 ``key-reused`` (status configurable)."""

    stored_fingerprint: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class InProgress:
    """Another attempt holds a valid lease: 409 ``request-in-progress`` with ``Retry-After``.

    Attributes:
        lease_remaining: seconds until the owner's lease expires (> 0).
        retry_after: whole seconds to advertise in ``Retry-After`` (1–5).
    """

    lease_remaining: float
    retry_after: int


@dataclass(frozen=True, slots=True)
class TakeOver:
    """The owner's lease expired (it crashed or hung): take over from ``fencing_token``."""

    fencing_token: int


Decision = Claim | Replay | ReplayUnavailable | KeyReused | InProgress | TakeOver


def decide(record: KeyRecord | None, fingerprint: str, now: float) -> Decision:
    """Decide what to do with a protected, keyed request given what the store holds (SPEC §3).

    Args:
        record: the store's record for the key hash, or None.
        fingerprint: the incoming request's fingerprint.
        now: current Unix time, seconds.

    Returns:
        One of :class:`Claim`, :class:`Replay`, :class:`ReplayUnavailable`, :class:`KeyReused`,
        :class:`InProgress`, :class:`TakeOver`.
    """
    if record is None or record.expires_at <= now:
        return Claim()
    if record.fingerprint != fingerprint:
        # Same key, other method/path/query/body: a client bug (IETF draft §2.7, Stripe).
        return KeyReused(record.fingerprint, fingerprint)
    if record.state is KeyState.COMPLETED:
        response = record.response
        if response is None:  # defensive: a completed record always has a response
            return ReplayUnavailable(500)
        if not response.replayable:
            return ReplayUnavailable(response.status)
        return Replay(response)
    remaining = record.lease_expires_at - now
    if remaining <= 0:
        return TakeOver(record.fencing_token)
    # A lease that never ends (inf) is still "try again in 5 s", never an OverflowError.
    retry_after = 5 if not math.isfinite(remaining) else max(1, min(5, math.ceil(remaining)))
    return InProgress(remaining, retry_after)


def should_store(
    status: int, *, store_server_errors: bool = False, retry_after: bool = False
) -> bool:
    """Whether a handler's response completes the key (SPEC §4).

    2xx, 3xx and 4xx are stored, except 408 and 429, which describe the attempt rather than
    the operation. 5xx releases the key so the next attempt runs the handler again, unless
    ``store_server_errors`` is set (Stripe's behaviour, for handlers that cannot re-run safely).

    ``retry_after``: the response carries ``Retry-After``. A 409 with it is an upstream's
    "request in progress, try again" (IETF draft §2.6; a gateway in front of a protected
    service sees one): it describes the attempt too, so it is not stored.
    """
    if status in (408, 429) or (status == 409 and retry_after):
        return False
    if status >= 500:
        return store_server_errors
    return 100 <= status < 500


def releases_unfinished(status: int, *, store_server_errors: bool = False) -> bool:
    """Whether a handler that did not finish its response may release its key (SPEC §4).

    An unfinished response — the handler raised, or returned without ending its response —
    says "not done" only when nothing had started (``status`` 0: the exception came first) or
    the started status itself says "not done" (a 5xx unless ``store_server_errors``, 408,
    429). Any other started response means the effect may have happened: the key stays
    claimed as outcome-unknown, so a retry does not run the effect again while the lease lasts.

    Args:
        status: the status the handler had started its response with, or 0.
        store_server_errors: 5xx answers are stored (then a started 5xx is not "not done").
    """
    if status == 0 or status in (408, 429):
        return True
    return status >= 500 and not store_server_errors
