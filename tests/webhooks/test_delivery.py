"""Sending: one event recorded once, one delivery per subscribed endpoint, every attempt
signed afresh and accepted by the official standardwebhooks verifier."""

from __future__ import annotations

import json
import logging
import random
import time
from typing import Any

import pytest

from retrysafe import JobState, PayloadError, StoreUnavailableError, WebhookError, stores
from retrysafe.client import outbox_store
from retrysafe.webhooks import WebhookPolicy, Webhooks, webhook_store
from retrysafe.webhooks._store import AsyncSQLWebhookStore

from .conftest import FAST, Receiver, add, run


def test_every_delivery_is_accepted_by_the_reference_verifier(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Each endpoint gets the event once, with its own valid signature and the same id."""
    paths = [receiver.plan(f"/ep{i}", 200) for i in range(3)]
    for p in paths:
        add(hooks, receiver, base_url, p)
    event = hooks.send("invoice.paid", {"amount": 42, "text": "é"})
    run(hooks)
    assert len(receiver.seen) == 3
    assert {s.path for s in receiver.seen} == set(paths)
    assert all(s.verified for s in receiver.seen)
    assert {s.headers["webhook-id"] for s in receiver.seen} == {event.id}
    assert all(json.loads(s.body) == {"amount": 42, "text": "é"} for s in receiver.seen)
    states = {d.state for d in hooks.deliveries(event_id=event.id)}
    assert states == {JobState.SUCCEEDED}


class SteppingClock:
    """Real time plus an offset the test moves forward (seconds)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def test_retries_carry_the_same_id_and_a_fresh_timestamp_and_signature(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """A 503 then 500 then 200: three attempts, one webhook-id, three timestamps, all valid."""

    path = receiver.plan("/flaky", 503, 500, 200)

    def clock() -> float:
        # 2 s later per request the receiver has seen: an attempt is signed after the
        # answer to the one before it, whenever the worker claims it again.
        return time.time() + 2.0 * len(receiver.requests(path))

    with Webhooks(store_url, allow_private=True, policy=FAST, clock=clock) as hooks:
        add(hooks, receiver, base_url, path)
        event = hooks.send("user.created", {"id": 1})
        run(hooks)
    seen = receiver.requests(path)
    assert len(seen) == 3
    assert all(s.verified for s in seen)
    assert {s.headers["webhook-id"] for s in seen} == {event.id}
    stamps = [int(s.headers["webhook-timestamp"]) for s in seen]
    assert stamps == sorted(stamps) and len(set(stamps)) == 3
    assert len({s.headers["webhook-signature"] for s in seen}) == 3


def test_event_types_select_endpoints(hooks: Webhooks, receiver: Receiver, base_url: str) -> None:
    """An endpoint gets only the types it subscribes to (exact, prefix.* or all)."""
    add(hooks, receiver, base_url, "/exact", event_types=["invoice.paid"])
    add(hooks, receiver, base_url, "/prefix", event_types=["invoice.*"])
    add(hooks, receiver, base_url, "/all")
    add(hooks, receiver, base_url, "/other", event_types=["user.created"])
    hooks.send("invoice.paid", {})
    hooks.send("invoice.voided", {})
    run(hooks)
    counts = {p: len(receiver.requests(p)) for p in ("/exact", "/prefix", "/all", "/other")}
    assert counts == {"/exact": 1, "/prefix": 2, "/all": 2, "/other": 0}


def test_the_same_event_id_is_recorded_once(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Sending an event id again adds nothing; another payload under it is refused."""
    add(hooks, receiver, base_url, "/once")
    first = hooks.send("a.b", {"x": 1}, event_id="evt_1")
    again = hooks.send("a.b", {"x": 1}, event_id="evt_1")
    assert again.created_at == first.created_at
    with pytest.raises(WebhookError, match="another payload"):
        hooks.send("a.b", {"x": 2}, event_id="evt_1")
    with pytest.raises(WebhookError, match=r"of type 'a\.b', not 'a\.c'$"):
        hooks.send("a.c", {"x": 1}, event_id="evt_1")
    with pytest.raises(WebhookError, match=r"not 'a\.c', with another payload$"):
        hooks.send("a.c", {"x": 2}, event_id="evt_1")
    run(hooks)
    assert len(receiver.requests("/once")) == 1


def test_the_same_payload_in_another_member_order_is_the_same_event(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """A producer that rebuilds its payload after a crash, members in another order, gets
    the recorded event back (payloads compared as the fingerprint's canonical JSON), and
    the body sent is the first one's, byte for byte."""
    add(hooks, receiver, base_url, "/order")
    first = hooks.send("a.b", {"b": 2, "a": {"y": [1, 2], "x": None}}, event_id="evt_o")
    again = hooks.send("a.b", {"a": {"x": None, "y": [1, 2]}, "b": 2}, event_id="evt_o")
    assert again == first
    with pytest.raises(WebhookError, match="another payload"):
        hooks.send("a.b", {"a": {"x": None, "y": [2, 1]}, "b": 2}, event_id="evt_o")
    run(hooks)
    (seen,) = receiver.requests("/order")
    assert seen.body == first.payload == b'{"b":2,"a":{"y":[1,2],"x":null}}'


def test_a_payload_over_max_payload_records_nothing(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """A payload whose JSON is longer than the policy's max_payload (1 MiB by default, what
    retrysafe's receiver reads) raises PayloadError and records nothing; a policy may raise
    the limit."""
    big = {"a": "x" * (1024 * 1024)}
    with Webhooks(store_url, allow_private=True) as hooks:
        add(hooks, receiver, base_url, "/big")
        over = r"over the limit of 1,048,576 \(WebhookPolicy\(max_payload=…\) raises it\)"
        with pytest.raises(PayloadError, match=over):
            hooks.send("a.b", big, event_id="evt_big")
        assert hooks.deliveries() == []
        exact = {"a": "x" * (1024 * 1024 - 8)}  # {"a":"…"} is 8 bytes more
        assert hooks.send("a.b", exact).payload.__len__() == 1024 * 1024
    policy = WebhookPolicy(max_payload=2 * 1024 * 1024)
    with Webhooks(store_url, allow_private=True, policy=policy) as hooks:
        assert hooks.send("a.b", big, event_id="evt_big").id == "evt_big"


def test_rotated_secret_signs_with_both(hooks: Webhooks, receiver: Receiver, base_url: str) -> None:
    """After a rotation a receiver holding either the old or the new secret verifies."""
    ep = add(hooks, receiver, base_url, "/rot")
    old = hooks.get_endpoint(ep).secrets[0][0]
    rotated = hooks.rotate_secret(ep)
    new = rotated.secrets[0][0]
    assert [s for s, _ in rotated.secrets] == [new, old]
    hooks.send("a.b", {})
    run(hooks)
    (seen,) = receiver.requests("/rot")
    assert len(seen.headers["webhook-signature"].split()) == 2
    assert seen.verified  # with the old secret
    from standardwebhooks.webhooks import Webhook

    Webhook(new).verify(seen.body, seen.headers)


def test_unserialisable_payload_records_nothing(
    hooks: Webhooks, receiver: Receiver, base_url: str, store_url: str
) -> None:
    """A payload that is not JSON raises PayloadError and leaves no event or delivery."""
    add(hooks, receiver, base_url, "/x")
    with pytest.raises(PayloadError):
        hooks.send("a.b", {"when": object()}, event_id="evt_bad")
    with pytest.raises(PayloadError):
        hooks.send("a.b", float("nan"), event_id="evt_bad")
    assert hooks.deliveries() == []
    store = stores.open_store(store_url)  # looked up now: on PostgreSQL, the test's schema
    try:
        assert webhook_store(store).get_event("evt_bad") is None
        assert sum(outbox_store(store).count_jobs(queue="webhooks").values()) == 0
    finally:
        store.close()


def test_attempts_are_structured_log_lines(
    hooks: Webhooks, receiver: Receiver, base_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every attempt logs event id, endpoint, attempt number, status, latency and outcome."""
    add(hooks, receiver, base_url, receiver.plan("/log", 500, 200))
    event = hooks.send("a.b", {})
    started = time.perf_counter()
    with caplog.at_level("INFO", logger="retrysafe.webhooks"):
        run(hooks)
    window_ms = (time.perf_counter() - started) * 1000.0
    records = [r for r in caplog.records if r.name == "retrysafe.webhooks"]
    data = [r.retrysafe for r in records]  # type: ignore[attr-defined]
    assert [(d["attempt"], d["status"], d["outcome"]) for d in data] == [
        (1, 500, "server_error"),
        (2, 200, "success"),
    ]
    assert all(d["event_id"] == event.id for d in data)
    # Each latency is the attempt's own (rounded to 0.1 ms), inside the run the test timed.
    assert all(0 <= d["latency_ms"] <= window_ms + 0.05 for d in data)
    assert all(d["endpoint_id"].startswith("ep_") for d in data)


def test_a_new_url_reaches_a_delivery_a_crashed_worker_left_in_flight(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """A delivery leased by a worker that died goes to the endpoint's new URL once its
    lease expires; the old URL receives nothing."""
    clock = SteppingClock()
    with Webhooks(store_url, allow_private=True, policy=FAST, clock=clock) as hooks:
        ep = add(hooks, receiver, base_url, receiver.plan("/old", 200))
        receiver.plan("/new", 200)
        receiver.secrets["/new"] = receiver.secrets["/old"]
        hooks.send("a.b", {"n": 1})
        (job,) = hooks.outbox.store.claim_jobs(
            queue="webhooks", token="crashed-worker", now=clock(), lease=30.0, limit=1
        )
        assert job.state is JobState.IN_FLIGHT
        hooks.update_endpoint(ep, url=base_url + "/new")
        clock.offset += 60.0  # the crashed worker's lease has expired
        run(hooks)
        (d,) = hooks.deliveries()
    assert receiver.requests("/old") == []
    (seen,) = receiver.requests("/new")
    assert seen.verified
    assert d.state is JobState.SUCCEEDED and d.url == base_url + "/new"


def test_a_brief_store_outage_in_the_delivery_hooks_loses_no_lease(
    store_url: str,
    receiver: Receiver,
    base_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store unavailable for a moment when the worker reads a delivery's endpoint (to sign
    the attempt, to schedule the retry after a 500) and when it counts the failure: the worker
    rides it out as it does for its own store calls. Each attempt is sent once and recorded,
    no lease is reported lost. Before, the worker gave the delivery up as if its lease had
    expired ("the store stayed unavailable until the lease expired") and it waited out the
    lease in flight (36 s in a fresh user's run; 5 s here)."""
    down = {"delivery_context": 2, "get_endpoint": 1, "record_endpoint_failure": 1}
    for name in down:
        original = getattr(AsyncSQLWebhookStore, name)

        async def flaky(
            self: Any, *args: Any, _name: str = name, _op: Any = original, **kw: Any
        ) -> Any:
            if down[_name] > 0:
                down[_name] -= 1
                raise StoreUnavailableError("the test's store outage")
            return await _op(self, *args, **kw)

        monkeypatch.setattr(AsyncSQLWebhookStore, name, flaky)
    caplog.set_level(logging.WARNING)
    with Webhooks(store_url, allow_private=True, policy=FAST) as hooks:
        path = receiver.plan("/blip", 500, 200)
        add(hooks, receiver, base_url, path)
        hooks.send("a.b", {"n": 1})
        stats = hooks.worker(
            poll_interval=0.01, rng=random.Random(7), budget=None, lease=5.0
        ).run_until_idle()
        (d,) = hooks.deliveries()
    assert d.state is JobState.SUCCEEDED
    assert [seen.verified for seen in receiver.requests(path)] == [True, True]
    assert stats.lease_lost == 0 and stats.attempts == 2
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "not recorded" in line], lines
    assert [line for line in lines if "failure run not updated" in line], lines
    assert down == {"delivery_context": 0, "get_endpoint": 0, "record_endpoint_failure": 0}
