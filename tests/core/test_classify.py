"""SPEC §5: every row of the client decision table, as a pure function."""

from __future__ import annotations

import pytest

from retrysafe.core import (
    KEY_REUSED_PROBLEM,
    Action,
    AttemptOutcome,
    Committed,
    classify_response,
    classify_transport_error,
)


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_succeeds(status: int) -> None:
    """2xx (replayed or not): the effect committed; stop, SUCCEEDED."""
    c = classify_response(status)
    assert (c.outcome, c.committed, c.action) == (
        AttemptOutcome.SUCCESS,
        Committed.YES,
        Action.SUCCEED,
    )


def test_refused_before_sending_retries() -> None:
    """Connection refused / DNS failure: nothing was sent; retry with the same key."""
    c = classify_transport_error(sent=False)
    assert (c.committed, c.action) == (Committed.NO, Action.RETRY)


def test_timeout_after_sending_is_unknown_and_retries() -> None:
    """Timeout, reset or truncation after sending: commit unknown; retry with the same key."""
    c = classify_transport_error(sent=True)
    assert (c.committed, c.action) == (Committed.UNKNOWN, Action.RETRY)


def test_408_retries() -> None:
    """408: probably not committed; retry, honouring Retry-After."""
    c = classify_response(408)
    assert (c.committed, c.action, c.honour_retry_after) == (
        Committed.PROBABLY_NOT,
        Action.RETRY,
        True,
    )


def test_409_polls() -> None:
    """409 request-in-progress: poll on its own schedule, never a failure."""
    c = classify_response(409)
    assert (c.outcome, c.action) == (AttemptOutcome.IN_PROGRESS, Action.POLL)


def test_422_key_reused_rejects() -> None:
    """422 key-reused is a client bug: stop, REJECTED."""
    c = classify_response(422, problem_type=KEY_REUSED_PROBLEM)
    assert (c.outcome, c.action) == (AttemptOutcome.KEY_REUSED, Action.REJECT)


def test_429_waits_and_retries() -> None:
    """429: not committed; wait at least Retry-After, retry."""
    c = classify_response(429)
    assert (c.committed, c.action, c.honour_retry_after) == (Committed.NO, Action.RETRY, True)


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_5xx_retries(status: int) -> None:
    """5xx: maybe committed; retry with the same key."""
    c = classify_response(status)
    assert (c.committed, c.action) == (Committed.UNKNOWN, Action.RETRY)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422, 451])
def test_other_4xx_rejects(status: int) -> None:
    """Other 4xx: the request must be fixed; REJECTED."""
    c = classify_response(status)
    assert (c.outcome, c.action) == (AttemptOutcome.CLIENT_ERROR, Action.REJECT)
