"""Queues: several outboxes share one store file, and each sees, sends, reconciles and purges
only its own jobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from retrysafe import JobNotFoundError, JobState, Outbox, RetryPolicy, Worker

from .conftest import FAST, Script, Step

ONE = RetryPolicy(attempts=1, wait_initial=0.01, timeout=2.0)


@pytest.fixture
def emails(outbox: Outbox) -> Iterator[Outbox]:
    """A second outbox, queue ``"emails"``, on the ``outbox`` fixture's store."""
    with Outbox(outbox.store, policy=FAST, queue="emails") as other:
        yield other


def test_job_records_its_queue(emails: Outbox) -> None:
    """A job carries the queue of the outbox it was submitted to, also in to_dict()."""
    job = emails.submit("http://example.test/x", json={})
    assert job.queue == "emails" and job.to_dict()["queue"] == "emails"
    assert emails.get(job.id).queue == "emails"


def test_worker_sends_only_its_own_queue(
    outbox: Outbox, emails: Outbox, script: Script, base_url: str
) -> None:
    """A default-queue worker sends the default job and leaves the other queue's PENDING."""
    mine = outbox.submit(base_url + "/mine", json={})
    theirs = emails.submit(base_url + "/theirs", json={})
    outbox.worker(poll_interval=0.01).run_until_idle()
    assert [s.key for s in script.requests("/mine")] == [mine.key]
    assert script.requests("/theirs") == []
    assert emails.get(theirs.id).state is JobState.PENDING


def test_worker_of_a_named_queue_sends_only_that_queue(
    outbox: Outbox, emails: Outbox, script: Script, base_url: str
) -> None:
    """Worker(queue="emails") sends the emails job and leaves the default job PENDING."""
    mine = outbox.submit(base_url + "/mine", json={})
    theirs = emails.submit(base_url + "/theirs", json={})
    Worker(outbox.store, policy=FAST, queue="emails", poll_interval=0.01).run_until_idle()
    assert [s.key for s in script.requests("/theirs")] == [theirs.key]
    assert script.requests("/mine") == []
    assert outbox.get(mine.id).state is JobState.PENDING


def test_reconcile_leaves_another_queues_unknown_jobs_alone(
    outbox: Outbox, emails: Outbox, script: Script, base_url: str
) -> None:
    """emails.reconcile() re-sends the emails UNKNOWN job only; the default one stays."""
    script.plan("/mine", Step(503), Step(200))
    script.plan("/theirs", Step(503), Step(200))
    mine = outbox.submit(base_url + "/mine", json={})
    theirs = emails.submit(base_url + "/theirs", json={})
    outbox.worker(policy=ONE, poll_interval=0.01).run_until_idle()
    emails.worker(policy=ONE, poll_interval=0.01).run_until_idle()
    report = emails.reconcile()
    assert [j.id for j in report.jobs] == [theirs.id] and report.succeeded == 1
    assert len(script.requests("/mine")) == 1
    assert outbox.get(mine.id).state is JobState.UNKNOWN


def test_listing_counting_and_purging_stay_in_the_queue(outbox: Outbox, emails: Outbox) -> None:
    """jobs(), dead_letters(), counts() and purge() of one queue ignore the other's jobs."""
    mine = outbox.submit("http://example.test/mine", json={})
    theirs = emails.submit("http://example.test/theirs", json={})
    outbox.cancel(mine.id)
    emails.cancel(theirs.id)
    assert [j.id for j in outbox.jobs()] == [mine.id]
    assert sum(emails.counts().values()) == 1
    assert emails.purge(states=[JobState.CANCELLED]) == 1
    assert outbox.get(mine.id).state is JobState.CANCELLED


def test_another_queues_job_is_not_found_by_id_or_prefix(outbox: Outbox, emails: Outbox) -> None:
    """get() of a job in another queue raises JobNotFoundError naming its queue; a prefix
    resolves only among the outbox's own queue."""
    theirs = emails.submit("http://example.test/theirs", json={})
    with pytest.raises(JobNotFoundError, match="'emails' queue"):
        outbox.get(theirs.id)
    with pytest.raises(JobNotFoundError, match="no job"):
        outbox.get(theirs.id[:8])
    assert emails.get(theirs.id[:8]).id == theirs.id


def test_queues_of_one_file_see_each_other_across_connections(
    sqlite_path: Path, emails: Outbox
) -> None:
    """An outbox opened by URL on the same file sees the emails job only in that queue."""
    theirs = emails.submit("http://example.test/theirs", json={})
    with Outbox(f"sqlite:///{sqlite_path}", queue="emails") as again:
        assert [j.id for j in again.jobs()] == [theirs.id]
    with Outbox(f"sqlite:///{sqlite_path}") as default:
        assert default.jobs() == []
