"""Plain outbox jobs and webhook deliveries in one store: each worker, reconcile and listing
sees only its own queue, so a delivery is never sent unsigned and a plain job never by the
webhook worker."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from retrysafe import JobState, Outbox, RetryPolicy, reconcile
from retrysafe.cli import cli
from retrysafe.client import Job
from retrysafe.webhooks import Webhooks

from .conftest import Receiver, add, run

#: Plain jobs: two quick attempts.
PLAIN = RetryPolicy(attempts=2, wait_initial=0.01, wait_max=0.02, timeout=2.0)


@pytest.fixture
def plain(hooks: Webhooks, store_url: str) -> Iterator[Outbox]:
    """A plain outbox on the webhooks' store file."""
    with Outbox(store_url, policy=PLAIN) as outbox:
        yield outbox


def _deliver(outbox: Outbox) -> None:
    outbox.worker(poll_interval=0.01, budget=None).run_until_idle()


def _both_dead(hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str) -> Job:
    """One rejected delivery (to /hook) and one rejected plain job (to /plain)."""
    receiver.plan("/hook", 400)
    receiver.plan("/plain", 400)
    add(hooks, receiver, base_url, "/hook")
    hooks.send("a.b", {"n": 1})
    job = plain.submit(base_url + "/plain", json={"p": 1})
    run(hooks)
    _deliver(plain)
    return plain.get(job.id)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_plain_worker_never_sends_webhook_deliveries(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str
) -> None:
    """A plain outbox worker on a store holding webhook deliveries sends only plain jobs."""
    add(hooks, receiver, base_url, "/hook")
    hooks.send("a.b", {"n": 1})
    job = plain.submit(base_url + "/plain", json={"p": 1})
    _deliver(plain)
    assert len(receiver.requests("/plain")) == 1
    assert plain.get(job.id).state is JobState.SUCCEEDED
    assert receiver.requests("/hook") == []
    assert [d.state for d in hooks.deliveries()] == [JobState.PENDING]


def test_webhook_worker_never_sends_plain_jobs(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str
) -> None:
    """The webhook worker sends only deliveries (signed); a plain job stays PENDING."""
    add(hooks, receiver, base_url, "/hook")
    hooks.send("a.b", {"n": 1})
    job = plain.submit(base_url + "/plain", json={"p": 1})
    run(hooks)
    (seen,) = receiver.requests("/hook")
    assert seen.verified
    assert receiver.requests("/plain") == []
    assert plain.get(job.id).state is JobState.PENDING


def test_plain_reconcile_leaves_unknown_deliveries_alone(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str
) -> None:
    """Reconciling the plain outbox re-sends its UNKNOWN jobs, never UNKNOWN deliveries."""
    receiver.plan("/hook", 503)
    receiver.plan("/plain", 503)
    add(hooks, receiver, base_url, "/hook")
    hooks.send("a.b", {"n": 1})
    job = plain.submit(base_url + "/plain", json={"p": 1})
    run(hooks)
    _deliver(plain)
    (dead,) = hooks.dead_letters()
    assert dead.state is JobState.UNKNOWN and plain.get(job.id).state is JobState.UNKNOWN
    sent = len(receiver.requests("/hook"))
    receiver.plan("/hook", 200)
    receiver.plan("/plain", 200)
    report = plain.reconcile()
    assert [j.id for j in report.jobs] == [job.id] and report.succeeded == 1
    assert len(receiver.requests("/hook")) == sent
    assert hooks.delivery(dead.id).state is JobState.UNKNOWN


def test_reconcile_by_id_leaves_a_delivery_of_another_queue_alone(
    hooks: Webhooks, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """reconcile(ids=[a delivery's id]) in the default queue sends nothing."""
    receiver.plan("/hook", 503)
    add(hooks, receiver, base_url, "/hook")
    hooks.send("a.b", {"n": 1})
    run(hooks)
    (dead,) = hooks.dead_letters()
    sent = len(receiver.requests("/hook"))
    report = reconcile(store_url, policy=PLAIN, ids=[dead.id])
    assert report.jobs == ()
    assert len(receiver.requests("/hook")) == sent
    assert hooks.delivery(dead.id).state is JobState.UNKNOWN


def test_jobs_list_shows_no_webhook_deliveries(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """`retrysafe jobs list` lists and counts only plain jobs, not deliveries."""
    job = _both_dead(hooks, plain, receiver, base_url)
    code, out, err = _cli("jobs", "list", "--store", store_url, "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert [j["id"] for j in listed["jobs"]] == [job.id]
    assert listed["jobs"][0]["queue"] == "default"
    assert sum(listed["counts"].values()) == 1


def test_dlq_list_shows_no_webhook_dead_letters(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """`retrysafe dlq list` shows the plain dead letter, not the rejected delivery."""
    job = _both_dead(hooks, plain, receiver, base_url)
    code, out, err = _cli("dlq", "list", "--store", store_url, "--json")
    assert code == 0, err
    assert [j["id"] for j in json.loads(out)] == [job.id]


def test_webhooks_dlq_list_shows_only_deliveries(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """`retrysafe webhooks dlq list` shows the rejected delivery, not the plain job."""
    _both_dead(hooks, plain, receiver, base_url)
    (delivery,) = hooks.dead_letters()
    code, out, err = _cli("webhooks", "dlq", "list", "--store", store_url, "--json")
    assert code == 0, err
    assert [d["id"] for d in json.loads(out)] == [delivery.id]


def test_jobs_show_of_a_delivery_names_its_queue(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """`retrysafe jobs show <delivery id>` fails in one line naming the webhooks queue."""
    _both_dead(hooks, plain, receiver, base_url)
    (delivery,) = hooks.dead_letters()
    code, _, err = _cli("jobs", "show", delivery.id, "--store", store_url)
    assert code == 1
    assert "'webhooks' queue" in err and len(err.strip().splitlines()) == 1


def test_plain_purge_leaves_webhook_dead_letters(
    hooks: Webhooks, plain: Outbox, receiver: Receiver, base_url: str
) -> None:
    """Purging the plain dead letters deletes none of the webhook dead letters."""
    _both_dead(hooks, plain, receiver, base_url)
    assert plain.purge() == 1
    assert [d.state for d in hooks.dead_letters()] == [JobState.REJECTED]
