"""The client's classification of one attempt (SPEC §5) as a pure function.

The sender maps what it saw — a status code, or a transport error before or after the request
was sent — to an outcome class (recorded with the attempt), whether the effect may have
committed, and the action: succeed, retry with backoff, poll (409), or reject.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from retrysafe.core._problems import PROBLEM_TYPE_PREFIX

__all__ = [
    "KEY_REUSED_PROBLEM",
    "Action",
    "AttemptOutcome",
    "Classification",
    "Committed",
    "classify_response",
    "classify_transport_error",
]

KEY_REUSED_PROBLEM = PROBLEM_TYPE_PREFIX + "key-reused"


class AttemptOutcome(str, enum.Enum):
    """Outcome class of one attempt, as recorded in the outbox (SPEC §5 rows)."""

    SUCCESS = "success"
    CONNECT_ERROR = "connect_error"
    TRANSPORT_ERROR = "transport_error"
    REQUEST_TIMEOUT = "request_timeout"
    IN_PROGRESS = "in_progress"
    KEY_REUSED = "key_reused"
    RATE_LIMITED = "rate_limited"
    SERVER_ERROR = "server_error"
    CLIENT_ERROR = "client_error"


class Action(str, enum.Enum):
    """What the sender does next."""

    SUCCEED = "succeed"
    RETRY = "retry"
    POLL = "poll"
    REJECT = "reject"


class Committed(str, enum.Enum):
    """Did the effect commit, as far as this attempt can tell?"""

    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"
    PROBABLY_NOT = "probably-not"
    IN_PROGRESS = "in-progress"


@dataclass(frozen=True, slots=True)
class Classification:
    """One row of the SPEC §5 table.

    Attributes:
        outcome: the attempt's outcome class.
        committed: whether the effect may have committed.
        action: succeed, retry, poll or reject.
        honour_retry_after: whether a ``Retry-After`` header should raise the next delay.
    """

    outcome: AttemptOutcome
    committed: Committed
    action: Action
    honour_retry_after: bool = False


def classify_response(status: int, *, problem_type: str | None = None) -> Classification:
    """Classify an attempt that received a complete HTTP response.

    Args:
        status: the response status code.
        problem_type: the ``type`` member of an ``application/problem+json`` body, if any
            (distinguishes retrysafe's ``key-reused`` 422 from other 422s in the record).
    """
    if 200 <= status < 300:
        return Classification(AttemptOutcome.SUCCESS, Committed.YES, Action.SUCCEED)
    if not 200 <= status <= 599:
        # No such status (RFC 9110 §15: three digits, 1xx–5xx), or a 1xx as the final answer
        # (RFC 9110 §15.2: 1xx answers are interim; a 101 switches protocols only for a
        # request that asked to upgrade, which no attempt does): an answer that breaks HTTP,
        # after the request was sent, as a malformed answer is. Whether the effect committed
        # is unknown, so it is retried with the same key (REJECTED would say it did not).
        return classify_transport_error(sent=True)
    if status == 408:
        return Classification(
            AttemptOutcome.REQUEST_TIMEOUT, Committed.PROBABLY_NOT, Action.RETRY, True
        )
    if status == 409:
        # IETF draft §2.6 / SPEC §3: a concurrent request holds the key. Poll, never a new key.
        return Classification(AttemptOutcome.IN_PROGRESS, Committed.IN_PROGRESS, Action.POLL, True)
    if status == 429:
        return Classification(AttemptOutcome.RATE_LIMITED, Committed.NO, Action.RETRY, True)
    if status >= 500:
        return Classification(AttemptOutcome.SERVER_ERROR, Committed.UNKNOWN, Action.RETRY, True)
    if status == 422 and problem_type == KEY_REUSED_PROBLEM:
        return Classification(AttemptOutcome.KEY_REUSED, Committed.UNKNOWN, Action.REJECT)
    # Other 4xx, and a 3xx (a redirect is never followed for a side-effecting call): fix the
    # request.
    return Classification(AttemptOutcome.CLIENT_ERROR, Committed.NO, Action.REJECT)


def classify_transport_error(*, sent: bool) -> Classification:
    """Classify an attempt that got no complete response.

    Args:
        sent: False when the failure happened before any byte of the request could reach the
            server (connection refused, DNS failure, connect timeout, pool timeout); True when
            it happened after sending began (read timeout, reset, truncated answer), so the
            effect may have committed.
    """
    if not sent:
        return Classification(AttemptOutcome.CONNECT_ERROR, Committed.NO, Action.RETRY)
    return Classification(AttemptOutcome.TRANSPORT_ERROR, Committed.UNKNOWN, Action.RETRY)
