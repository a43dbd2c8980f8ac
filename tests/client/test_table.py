"""Every row of the SPEC §5 table against a real local HTTP server."""

from __future__ import annotations

import time

import pytest

from retrysafe import JobState, Outbox, RetryPolicy
from retrysafe._serving import free_port
from retrysafe.core import KEY_REUSED_PROBLEM

from .conftest import Script, Step, run_bounded


def _deliver(outbox: Outbox, url: str, **policy: object) -> tuple[JobState, list[str], set[str]]:
    job = outbox.submit(url, json={"text": "hello"})
    opts: dict[str, object] = {
        "attempts": 4,
        "wait_initial": 0.01,
        "wait_max": 0.05,
        "timeout": 2.0,
        "poll_interval": 0.01,
    }
    opts.update(policy)
    outbox.worker(policy=RetryPolicy(**opts), concurrency=2).run_until_idle()  # type: ignore[arg-type]
    final = outbox.get(job.id)
    attempts = outbox.attempts(job.id)
    assert final.key == job.key
    return final.state, [a.outcome for a in attempts], {a.key for a in attempts}


def test_2xx_succeeds(outbox: Outbox, script: Script, base_url: str) -> None:
    """2xx → SUCCEEDED after one attempt."""
    script.plan("/ok", Step(201))
    state, outcomes, _ = _deliver(outbox, base_url + "/ok")
    assert (state, outcomes) == (JobState.SUCCEEDED, ["success"])


def test_replayed_2xx_succeeds_and_is_flagged(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """A replayed 2xx is SUCCEEDED too, and the attempt records replayed=True."""
    script.plan("/replayed", Step(200, headers={"Idempotent-Replayed": "true"}))
    job = outbox.submit(base_url + "/replayed", json={})
    outbox.worker().run_until_idle()
    assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert [a.replayed for a in outbox.attempts(job.id)] == [True]


def test_connection_refused_retries_with_same_key_then_unknown(outbox: Outbox) -> None:
    """Connection refused (not sent) → retried with the same key; exhausted → UNKNOWN."""
    state, outcomes, keys = _deliver(outbox, f"http://127.0.0.1:{free_port()}/x", attempts=3)
    assert state is JobState.UNKNOWN
    assert outcomes == ["connect_error"] * 3
    assert len(keys) == 1


def test_read_timeout_after_sending_retries_with_same_key(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """A read timeout after sending → PENDING, retried with the same key → SUCCEEDED."""
    script.plan("/slow", Step(201, sleep=1.0), Step(201))
    state, outcomes, keys = _deliver(outbox, base_url + "/slow", timeout=0.3)
    assert (state, outcomes) == (JobState.SUCCEEDED, ["transport_error", "success"])
    assert len(keys) == 1
    assert len({s.key for s in script.requests("/slow")}) == 1


def test_truncated_answer_retries_with_same_key(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """A truncated answer (connection dropped mid-body) → retried with the same key."""
    script.plan("/cut", Step(truncate=True), Step(201))
    state, outcomes, keys = _deliver(outbox, base_url + "/cut")
    assert (state, outcomes) == (JobState.SUCCEEDED, ["transport_error", "success"])
    assert len(keys) == 1


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (408, "request_timeout"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (429, "rate_limited"),
    ],
)
def test_retryable_status_retries_with_same_key(
    outbox: Outbox, script: Script, base_url: str, status: int, outcome: str
) -> None:
    """408, 429 and 5xx → PENDING, retried with the same key → SUCCEEDED."""
    path = script.plan(f"/r{status}", Step(status), Step(200))
    state, outcomes, keys = _deliver(outbox, base_url + path)
    assert (state, outcomes) == (JobState.SUCCEEDED, [outcome, "success"])
    assert len(keys) == 1


def test_409_in_progress_is_polled_not_counted(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """409 request-in-progress is polled (same key) and never counts against `attempts`."""
    script.plan("/busy", *[Step(409, headers={"Retry-After": "0"})] * 5, Step(201))
    job = outbox.submit(base_url + "/busy", json={})
    outbox.worker(
        policy=RetryPolicy(attempts=2, wait_initial=0.01, wait_max=0.02, poll_interval=0.01)
    ).run_until_idle()
    final = outbox.get(job.id)
    attempts = outbox.attempts(job.id)
    assert final.state is JobState.SUCCEEDED
    assert [a.counted for a in attempts] == [False] * 5 + [True]
    assert {a.key for a in attempts} == {job.key}
    assert final.polls == 5


def test_422_key_reused_is_rejected_and_keeps_the_problem(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """422 key-reused → REJECTED; the problem body (both fingerprints) is kept as the error."""
    problem = {
        "type": KEY_REUSED_PROBLEM,
        "title": "key reused",
        "stored_fingerprint": "aaa",
        "request_fingerprint": "bbb",
    }
    script.plan(
        "/reused", Step(422, headers={"content-type": "application/problem+json"}, body=problem)
    )
    job = outbox.submit(base_url + "/reused", json={})
    outbox.worker().run_until_idle()
    final = outbox.get(job.id)
    assert final.state is JobState.REJECTED
    assert [a.outcome for a in outbox.attempts(job.id)] == ["key_reused"]
    assert final.last_error is not None and "aaa" in final.last_error and "bbb" in final.last_error


@pytest.mark.parametrize("ctype", ["application/problem+json", "application/json"])
@pytest.mark.parametrize(("status", "state"), [(422, JobState.REJECTED), (503, JobState.UNKNOWN)])
def test_an_error_body_nested_past_the_stack_is_classified_by_its_status(
    outbox: Outbox, script: Script, base_url: str, ctype: str, status: int, state: JobState
) -> None:
    """A JSON error body nested deeper than Python can parse (5,000 arrays) is no problem
    document: the answer is classified by its status, each attempt is recorded, and the job
    ends (it went back to PENDING unrecorded, to be sent again forever, when the parser's
    RecursionError escaped)."""
    deep = b"[" * 5000 + b"]" * 5000
    step = Step(status, headers={"content-type": ctype}, body=deep)
    path = script.plan(f"/deep{status}{len(ctype)}", *[step] * 3)
    job = outbox.submit(base_url + path, json={})
    worker = outbox.worker(policy=RetryPolicy(attempts=3, wait_initial=0.01, wait_max=0.02))

    run_bounded(worker)  # the bug this pins down sent the job forever
    final = outbox.get(job.id)
    attempts = outbox.attempts(job.id)
    assert final.state is state
    assert len(attempts) == len(script.requests(path)) == (1 if status == 422 else 3)
    assert final.last_error is not None and final.last_error.startswith("[[[")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422])
def test_other_4xx_is_rejected_without_retry(
    outbox: Outbox, script: Script, base_url: str, status: int
) -> None:
    """Other 4xx → REJECTED after one attempt: the request must be fixed."""
    path = script.plan(f"/c{status}", Step(status))
    state, outcomes, _ = _deliver(outbox, base_url + path)
    assert (state, outcomes) == (JobState.REJECTED, ["client_error"])
    assert len(script.requests(path)) == 1


def test_exhausted_attempts_park_the_job_unknown_in_the_dlq(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """Attempts exhausted without a definitive answer → UNKNOWN, listed with its attempts."""
    script.plan("/down", Step(503))
    state, outcomes, _ = _deliver(outbox, base_url + "/down", attempts=3)
    assert state is JobState.UNKNOWN
    assert outcomes == ["server_error"] * 3
    [dead] = outbox.dead_letters()
    assert len(outbox.attempts(dead.id)) == 3


def test_deadline_exhausted_parks_the_job_unknown(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """A deadline that passes between retries → UNKNOWN, even with attempts left."""
    script.plan("/late", Step(503, headers={"Retry-After": "1"}))
    job = outbox.submit(base_url + "/late", json={}, deadline=0.5)
    outbox.worker(
        policy=RetryPolicy(attempts=50, wait_initial=0.01, wait_max=0.02)
    ).run_until_idle()
    assert outbox.get(job.id).state is JobState.UNKNOWN
    assert len(outbox.attempts(job.id)) == 1


def test_a_deadline_that_passes_before_the_first_attempt_says_it_was_never_sent(
    outbox: Outbox, base_url: str
) -> None:
    """A job whose deadline passed while it waited (a backlog, a destination at its limit)
    ends UNKNOWN with no attempt, and its last_error says it was never sent."""
    job = outbox.submit(base_url + "/never", json={}, deadline=0.05)
    time.sleep(0.1)
    outbox.worker(policy=RetryPolicy(attempts=3)).run_until_idle()
    got = outbox.get(job.id)
    assert (got.state, got.attempts, got.sends) == (JobState.UNKNOWN, 0, 0)
    assert got.last_error == "deadline passed before its first attempt: never sent"
    assert outbox.attempts(job.id) == []


def test_reconcile_resends_unknown_with_the_same_key(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """reconcile re-sends UNKNOWN jobs with the same key: replay → SUCCEEDED, 4xx → REJECTED."""
    script.plan("/flaky", Step(503), Step(503), Step(200, headers={"Idempotent-Replayed": "true"}))
    script.plan("/gone", Step(503), Step(503), Step(404))
    script.plan("/dead", Step(503))
    a = outbox.submit(base_url + "/flaky", json={})
    b = outbox.submit(base_url + "/gone", json={})
    c = outbox.submit(base_url + "/dead", json={})
    outbox.worker(policy=RetryPolicy(attempts=2, wait_initial=0.01, wait_max=0.02)).run_until_idle()
    assert {outbox.get(j.id).state for j in (a, b, c)} == {JobState.UNKNOWN}
    report = outbox.reconcile()
    assert (report.succeeded, report.rejected, report.unknown) == (1, 1, 1)
    assert outbox.get(a.id).state is JobState.SUCCEEDED
    assert outbox.get(b.id).state is JobState.REJECTED
    assert outbox.get(c.id).state is JobState.UNKNOWN
    assert [x.replayed for x in outbox.attempts(a.id)] == [False, False, True]
    for job in (a, b, c):
        assert {s.key for s in script.requests(job.url.split(base_url)[1])} == {job.key}
