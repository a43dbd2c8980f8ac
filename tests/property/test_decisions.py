"""SPEC §3 and §5, fuzzed: the server's decision and the client's classification are total
functions — every input, however odd, gets exactly one of the documented answers, and the
one its table row names."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from retrysafe import InvalidKeyError, JobState, RetryPolicy
from retrysafe.client import next_step
from retrysafe.core import (
    KEY_REUSED_PROBLEM,
    Action,
    AttemptOutcome,
    Claim,
    Classification,
    Committed,
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
    classify_response,
    classify_transport_error,
    decide,
    parse_key,
    releases_unfinished,
    should_store,
)

NOW = 1_700_000_000.0
FPS = st.sampled_from(["a" * 64, "b" * 64])
times = st.one_of(
    st.floats(NOW - 1e6, NOW + 1e6),
    st.sampled_from([NOW, NOW - 1e-9, NOW + 1e-9, NOW + 0.5, NOW + 5.0, NOW + 5.0001, 0.0]),
    st.floats(-1e300, 1e300),
)
responses = st.one_of(
    st.none(),
    st.builds(
        StoredResponse,
        status=st.integers(100, 599),
        headers=st.just(()),
        body=st.binary(max_size=4),
        replayable=st.booleans(),
    ),
)
records = st.one_of(
    st.none(),
    st.builds(
        KeyRecord,
        key_hash=st.just("k" * 64),
        fingerprint=FPS,
        state=st.sampled_from(KeyState),
        fencing_token=st.integers(1, 2**63 - 1),
        lease_expires_at=times,
        expires_at=times,
        response=responses,
    ),
)
statuses = st.one_of(st.integers(-1000, 10_000), st.sampled_from([0, 99, 100, 408, 409, 429]))


@given(record=records, fp=FPS, now=st.one_of(st.just(NOW), times))
def test_decide_gives_the_one_answer_its_row_names(
    record: KeyRecord | None, fp: str, now: float
) -> None:
    """Any stored record, fingerprint and time (finite) get exactly the §3 answer of their row:
    absent or expired → claim; other fingerprint → key-reused; completed → replay, or replay
    unavailable; running with a valid lease → in progress (Retry-After 1–5 s); running with
    an expired lease → take over with its token."""
    got = decide(record, fp, now)
    if record is None or record.expires_at <= now:
        assert got == Claim()
    elif record.fingerprint != fp:
        assert got == KeyReused(record.fingerprint, fp)
    elif record.state is KeyState.COMPLETED:
        r = record.response
        if r is not None and r.replayable:
            assert got == Replay(r)
        else:
            assert got == ReplayUnavailable(500 if r is None else r.status)
    elif record.lease_expires_at <= now:
        assert got == TakeOver(record.fencing_token)
    else:
        assert isinstance(got, InProgress)
        assert got.lease_remaining == record.lease_expires_at - now > 0
        assert 1 <= got.retry_after <= 5
        assert got.retry_after == min(5, max(1, math.ceil(got.lease_remaining)))


def test_a_lease_that_never_ends_is_in_progress() -> None:
    """A running record with ``lease_expires_at = inf`` is in progress, Retry-After 5."""
    record = KeyRecord("k" * 64, "a" * 64, KeyState.RUNNING, 1, math.inf, math.inf)
    assert decide(record, "a" * 64, NOW) == InProgress(math.inf, 5)


@given(
    method=st.one_of(st.sampled_from(["POST", "PATCH", "GET", "PUT", "DELETE"]), st.text()),
    header=st.one_of(st.none(), st.text(), st.text('abc" \\\t', max_size=6)),
    protected=st.sets(st.sampled_from(["POST", "PATCH", "PUT", "DELETE"])),
    required=st.booleans(),
)
def test_check_key_gives_the_one_answer_its_row_names(
    method: str, header: str | None, protected: set[str], required: bool
) -> None:
    """Any method and header get exactly one of the first §3 rows: not protected, missing
    key (required) or unkeyed (optional), invalid key carrying the parser's error, or keyed
    with the parsed key."""
    got = check_key(method, header, protected_methods=protected, key_required=required)
    if method not in protected:
        assert got == NotProtected()
    elif header is None:
        assert got == (MissingKey() if required else Unkeyed())
    else:
        try:
            want: object = Keyed(parse_key(header))
        except InvalidKeyError as exc:
            want = exc.reason
        if isinstance(want, Keyed):
            assert got == want
        else:
            assert isinstance(got, InvalidKey) and got.error.reason == want


@given(status=statuses, store_5xx=st.booleans(), retry_after=st.booleans())
def test_should_store_follows_spec_section_4(
    status: int, store_5xx: bool, retry_after: bool
) -> None:
    """2xx–4xx are stored except 408, 429 and a 409 with Retry-After; 5xx only with
    ``store_server_errors``; nothing below 100."""
    got = should_store(status, store_server_errors=store_5xx, retry_after=retry_after)
    if status in (408, 429) or (status == 409 and retry_after):
        assert got is False
    elif status >= 500:
        assert got is store_5xx
    else:
        assert got is (100 <= status < 500)


@given(status=statuses, store_5xx=st.booleans())
def test_an_unfinished_answer_releases_only_when_it_says_not_done(
    status: int, store_5xx: bool
) -> None:
    """Nothing started, 408, 429, or a 5xx that is not stored: release; else keep the key."""
    got = releases_unfinished(status, store_server_errors=store_5xx)
    assert got is (status in (0, 408, 429) or (status >= 500 and not store_5xx))


# ------------------------------------------------------------------------- §5
SUCCESS = Classification(AttemptOutcome.SUCCESS, Committed.YES, Action.SUCCEED)
CLIENT_ERROR = Classification(AttemptOutcome.CLIENT_ERROR, Committed.NO, Action.REJECT)


@given(
    status=statuses,
    problem=st.one_of(st.none(), st.just(KEY_REUSED_PROBLEM), st.text(max_size=8)),
)
def test_classify_response_gives_the_one_answer_its_row_names(
    status: int, problem: str | None
) -> None:
    """Every status code (any integer) gets exactly its §5 row."""
    got = classify_response(status, problem_type=problem)
    if 200 <= status < 300:
        want = SUCCESS
    elif not 200 <= status <= 599:  # no such status, or a final 1xx: a malformed answer
        want = Classification(AttemptOutcome.TRANSPORT_ERROR, Committed.UNKNOWN, Action.RETRY)
    elif status == 408:
        want = Classification(
            AttemptOutcome.REQUEST_TIMEOUT, Committed.PROBABLY_NOT, Action.RETRY, True
        )
    elif status == 409:
        want = Classification(AttemptOutcome.IN_PROGRESS, Committed.IN_PROGRESS, Action.POLL, True)
    elif status == 429:
        want = Classification(AttemptOutcome.RATE_LIMITED, Committed.NO, Action.RETRY, True)
    elif status >= 500:
        want = Classification(AttemptOutcome.SERVER_ERROR, Committed.UNKNOWN, Action.RETRY, True)
    elif status == 422 and problem == KEY_REUSED_PROBLEM:
        want = Classification(AttemptOutcome.KEY_REUSED, Committed.UNKNOWN, Action.REJECT)
    else:
        want = CLIENT_ERROR
    assert got == want


@given(sent=st.booleans())
def test_a_transport_error_retries_and_commits_only_if_sent(sent: bool) -> None:
    """No answer: retry; the effect is unknown once bytes left, certainly not before."""
    got = classify_transport_error(sent=sent)
    assert got.action is Action.RETRY and not got.honour_retry_after
    assert got.committed is (Committed.UNKNOWN if sent else Committed.NO)


@given(
    # A complete answer (its status), or none: a transport error before or after sending.
    seen=st.tuples(st.one_of(st.none(), statuses), st.booleans()),
    attempts=st.integers(0, 6),
    polls=st.integers(0, 6),
    limit=st.integers(1, 6),
    poll_limit=st.integers(1, 6),
    deadline=st.one_of(st.none(), st.floats(-10.0, 120.0)),
    retry_after=st.one_of(st.none(), st.floats(0.0, 1e6)),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_attempt_moves_its_job_to_the_state_its_row_names(
    seen: tuple[int | None, bool],
    attempts: int,
    polls: int,
    limit: int,
    poll_limit: int,
    deadline: float | None,
    retry_after: float | None,
    seed: int,
) -> None:
    """Whatever an attempt saw, the job ends in the §5 table's state: 2xx SUCCEEDED, a fix-me
    4xx or key-reused REJECTED, anything else PENDING due in the future — or UNKNOWN once
    attempts, polls or the deadline run out. Never a silent failure."""
    status, sent = seen
    c = classify_response(status) if status is not None else classify_transport_error(sent=sent)
    policy = RetryPolicy(attempts=limit, polls=poll_limit, wait_initial=0.5, wait_max=10.0)
    deadline_at = None if deadline is None else NOW + deadline
    step = next_step(
        c,
        policy=policy,
        attempts=attempts,
        polls=polls,
        now=NOW,
        deadline_at=deadline_at,
        previous_delay=0.0,
        retry_after=retry_after,
        rng=random.Random(seed),
    )
    if c.action is Action.SUCCEED:
        assert step.state is JobState.SUCCEEDED
    elif c.action is Action.REJECT:
        assert step.state is JobState.REJECTED
    else:
        exhausted = polls + 1 >= poll_limit if c.action is Action.POLL else attempts + 1 >= limit
        if exhausted:
            assert step.state is JobState.UNKNOWN
        elif step.state is JobState.UNKNOWN:  # the next attempt would start too late
            longest = max(policy.wait_max_s, policy.retry_after_max_s, policy.poll_interval_s)
            assert step.reason == "deadline exhausted"
            assert deadline_at is not None and deadline_at <= NOW + longest
        else:
            assert step.state is JobState.PENDING
            assert step.due_at >= NOW and (deadline_at is None or step.due_at < deadline_at)
    assert step.counted is (c.action is not Action.POLL)
