"""The dead-letter queue: list and filter, show attempts, replay with the same webhook-id,
purge; re-enabling an endpoint replays what it missed."""

from __future__ import annotations

import pytest

from retrysafe import JobNotFoundError, JobState, WebhookError
from retrysafe.webhooks import EndpointNotFoundError, Webhooks

from .conftest import Receiver, add, run


def test_dead_letters_keep_their_attempts_and_filter(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Exhausted and rejected deliveries are listed with every attempt; filters narrow."""
    down = add(hooks, receiver, base_url, receiver.plan("/down", 503))
    add(hooks, receiver, base_url, receiver.plan("/no", 400))
    add(hooks, receiver, base_url, receiver.plan("/ok", 200))
    hooks.send("a.one", {})
    hooks.send("a.two", {})
    run(hooks)
    dlq = hooks.dead_letters()
    assert len(dlq) == 4
    assert {d.state for d in dlq} == {JobState.UNKNOWN, JobState.REJECTED}
    only_down = hooks.dead_letters(endpoint_id=down)
    assert len(only_down) == 2 and all(d.state is JobState.UNKNOWN for d in only_down)
    assert len(hooks.dead_letters(event_type="a.one")) == 2
    attempts = hooks.attempts(only_down[0].id)
    assert [a.status for a in attempts] == [503, 503, 503, 503]


def test_replay_one_uses_the_same_webhook_id(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """A replayed dead letter is delivered with the event's original webhook-id."""
    path = receiver.plan("/later", 503, 503, 503, 503, 200)
    add(hooks, receiver, base_url, path)
    event = hooks.send("a.b", {"v": 1})
    run(hooks)
    (dead,) = hooks.dead_letters()
    (requeued,) = hooks.replay(dead.id[:8])
    assert requeued.state is JobState.PENDING
    run(hooks)
    assert hooks.delivery(dead.id).state is JobState.SUCCEEDED
    seen = receiver.requests(path)
    assert len(seen) == 5 and {s.headers["webhook-id"] for s in seen} == {event.id}
    assert seen[-1].verified


def test_replay_many_and_purge(hooks: Webhooks, receiver: Receiver, base_url: str) -> None:
    """Replay every dead letter of an endpoint; purge removes the rest and their attempts."""
    ep = add(hooks, receiver, base_url, receiver.plan("/d", 500))
    for i in range(3):
        hooks.send("a.b", {"i": i})
    run(hooks)
    assert len(hooks.dead_letters()) == 3
    receiver.plan("/d", 200)
    assert len(hooks.replay(endpoint_id=ep)) == 3
    run(hooks)
    assert hooks.dead_letters() == []
    receiver.plan("/d", 404)
    hooks.send("a.b", {"i": 9})
    run(hooks)
    assert hooks.purge(endpoint_id=ep) == 1
    assert hooks.dead_letters() == []
    assert len(hooks.deliveries()) == 3  # succeeded ones are never purged


def test_replay_refuses_what_is_not_a_dead_letter(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Replaying a succeeded or unknown delivery id is a clear error, nothing changes."""
    add(hooks, receiver, base_url, "/fine")
    hooks.send("a.b", {})
    run(hooks)
    (d,) = hooks.deliveries()
    with pytest.raises(WebhookError, match="succeeded"):
        hooks.replay(d.id)
    with pytest.raises(JobNotFoundError):
        hooks.replay("ffffffff")


def test_disabled_endpoint_keeps_events_and_replays_them_on_enable(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Events sent while an endpoint is disabled are kept and delivered after re-enabling."""
    path = receiver.plan("/paused", 200)
    ep = add(hooks, receiver, base_url, path)
    hooks.disable_endpoint(ep, reason="maintenance")
    ids = [hooks.send("a.b", {"i": i}).id for i in range(3)]
    run(hooks)
    assert receiver.requests(path) == []
    assert {d.state for d in hooks.deliveries()} == {JobState.CANCELLED}
    endpoint = hooks.enable_endpoint(ep, replay_missed=True)
    assert endpoint.enabled and endpoint.disabled_reason is None
    run(hooks)
    seen = receiver.requests(path)
    assert sorted(s.headers["webhook-id"] for s in seen) == sorted(ids)
    assert all(s.verified for s in seen)


def test_endpoint_crud(hooks: Webhooks, base_url: str) -> None:
    """Endpoints are listed, updated (URL moves unsent deliveries), deleted with them."""
    ep = hooks.add_endpoint(base_url + "/a", description="first", event_types=["x.*"])
    assert [e.id for e in hooks.list_endpoints()] == [ep.id]
    hooks.disable_endpoint(ep.id)
    hooks.send("x.y", {})
    updated = hooks.update_endpoint(ep.id[:6], url=base_url + "/b", schedule="svix")
    assert updated.url.endswith("/b") and updated.schedule == "svix"
    (d,) = hooks.deliveries()
    assert d.url.endswith("/b")
    hooks.delete_endpoint(ep.id)
    assert hooks.list_endpoints() == [] and hooks.deliveries() == []
    with pytest.raises(EndpointNotFoundError):
        hooks.get_endpoint(ep.id)
    with pytest.raises(EndpointNotFoundError):
        hooks.disable_endpoint("ep_nope")


def test_replaying_a_disabled_endpoint_is_an_error(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """replay(endpoint_id=…) of a disabled endpoint raises WebhookError, like replaying one
    of its deliveries by id, and re-queues nothing."""
    ep = add(hooks, receiver, base_url, receiver.plan("/gone", 400))
    hooks.send("a.b", {})
    run(hooks)
    (dead,) = hooks.dead_letters()
    hooks.disable_endpoint(ep, reason="maintenance")
    with pytest.raises(WebhookError, match="disabled"):
        hooks.replay(endpoint_id=ep)
    with pytest.raises(WebhookError, match="disabled"):
        hooks.replay(dead.id)
    assert [d.id for d in hooks.dead_letters()] == [dead.id]
