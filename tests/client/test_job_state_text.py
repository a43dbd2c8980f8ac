"""A job's state prints as its value."""

from __future__ import annotations

from retrysafe import JobState, Outbox


def test_a_job_state_prints_as_its_value(outbox: Outbox) -> None:
    """`print(job.state)` (the README's first example) shows `pending`, not
    `JobState.PENDING`; f-strings and str() agree, and the value still compares as a str."""
    job = outbox.submit("http://example.test/x", json={})
    assert str(job.state) == f"{job.state}" == "pending"
    assert job.state == "pending" and job.state is JobState.PENDING
