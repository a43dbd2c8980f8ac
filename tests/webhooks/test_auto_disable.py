"""SPEC §6 "repeated failure over a window disables it with a reason": auto-disable needs a
run of failures that is both long enough (``disable_after``) and old enough
(``disable_window``, default 5 days), so a short outage never disables an endpoint nor parks
its deliveries; 410 Gone still disables at once."""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any

import pytest

from retrysafe import ConfigurationError, JobState, RetrysafeWarning
from retrysafe.webhooks import Schedule, WebhookPolicy, Webhooks, should_auto_disable
from retrysafe.webhooks._store import webhook_store

from .conftest import FAST_SCHEDULE, Receiver, add, run

#: Room for retries: a delivery never runs out of attempts while a test's outage lasts.
ROOMY = Schedule(name="default", attempts=10, base=0.01, cap=0.05, jitter=0.001)
HOUR = 3600.0
#: The longest lease (1 day, ``MAX_LEASE``): tests that move the clock by 1000 s per attempt
#: must not expire the lease of the next attempt, claimed while the previous one's hooks ran.
LONG_LEASE = 86_400.0


class SteppingClock:
    """Real time plus an offset the test moves forward (seconds)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def ticker(self, seconds: float) -> Any:
        """An ``on_attempt`` hook moving the clock ``seconds`` forward after each attempt."""

        def tick(*_: object) -> None:
            self.offset += seconds

        return tick


def disabled_lines(caplog: pytest.LogCaptureFixture, endpoint_id: str) -> list[str]:
    """The "endpoint … disabled: reason" warnings logged for ``endpoint_id``."""
    prefix = f"endpoint {endpoint_id} disabled"
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "retrysafe.webhooks" and r.getMessage().startswith(prefix)
    ]


# ---------------------------------------------------------------------- pure rule
def test_the_default_needs_50_failures_over_5_days() -> None:
    """The defaults: 50 consecutive failed attempts whose run spans 5 days (Svix's span)."""
    policy = WebhookPolicy()
    assert policy.disable_after == 50
    assert policy.disable_window_s == 5 * 86400.0
    kw = {"disable_after": policy.disable_after, "disable_window": policy.disable_window_s}
    t0 = 1_700_000_000.0
    assert not should_auto_disable(50, t0, t0 + 1.0, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(10**6, t0, t0 + 4.9 * 86400, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(49, t0, t0 + 30 * 86400, **kw)  # type: ignore[arg-type]
    assert should_auto_disable(50, t0, t0 + 5 * 86400, **kw)  # type: ignore[arg-type]


def test_the_window_boundary_is_inclusive() -> None:
    """A run spanning exactly the window disables; a hair less does not."""
    kw = {"disable_after": 3, "disable_window": HOUR}
    assert should_auto_disable(3, 100.0, 100.0 + HOUR, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(3, 100.0, 100.0 + HOUR - 0.001, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(3, None, 1e12, **kw)  # type: ignore[arg-type]


def test_the_window_takes_a_timedelta() -> None:
    """``disable_window`` is float seconds or a timedelta, like every duration."""
    policy = WebhookPolicy(disable_window=timedelta(hours=12))
    assert policy.disable_window_s == 12 * HOUR
    assert WebhookPolicy(disable_after=None).disable_after is None


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("disable_window", -1.0),
        ("disable_window", 0.0),
        ("disable_window", math.nan),
        ("disable_window", math.inf),
        ("disable_window", -math.inf),
        ("disable_window", timedelta(seconds=-5)),
        ("disable_window", "5 days"),
        ("disable_window", None),
        ("disable_window", True),
        ("disable_after", 0),
        ("disable_after", -1),
        ("disable_after", math.nan),
        ("disable_after", math.inf),
        ("disable_after", -math.inf),
        ("disable_after", 2.5),
        ("disable_after", 50.0),
        ("disable_after", True),
        ("disable_after", "50"),
    ],
)
def test_bad_auto_disable_values_are_refused(option: str, value: object) -> None:
    """A negative, zero, NaN, infinite or non-numeric window or count: ConfigurationError
    naming the option."""
    with pytest.raises(ConfigurationError, match=option) as caught:
        WebhookPolicy(**{option: value})  # type: ignore[arg-type]
    assert caught.value.option == option


def test_a_window_under_an_hour_warns() -> None:
    """A window shorter than an hour works but lets a short outage disable: it warns."""
    with pytest.warns(RetrysafeWarning, match="disable_window"):
        WebhookPolicy(disable_window=60.0)


# ---------------------------------------------------------------------- through a worker
def test_a_short_outage_neither_disables_nor_parks(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """The reported case: 50 events, refused with 503 50 times in a row within a second, then
    the endpoint heals. With the default auto-disable rule the endpoint stays enabled,
    nothing is parked, and every event is delivered."""
    policy = WebhookPolicy(schedules=(ROOMY,), timeout=2.0)  # default disable rule
    with Webhooks(store_url, allow_private=True, policy=policy) as hooks:
        path = receiver.plan("/blip", *([503] * 50), 200)
        ep = add(hooks, receiver, base_url, path)
        for i in range(50):
            hooks.send("a.b", {"n": i})
        run(hooks, concurrency=8)
        endpoint = hooks.get_endpoint(ep)
        assert endpoint.enabled and endpoint.disabled_reason is None
        deliveries = hooks.deliveries(endpoint_id=ep)
        assert len(deliveries) == 50
        assert {d.state for d in deliveries} == {JobState.SUCCEEDED}
        # 50 refusals in a row (a run as long as the default count), then all delivered.
        statuses = [a.status for d in deliveries for a in hooks.attempts(d.id)]
        assert statuses.count(503) == 50 and statuses.count(200) == 50
        assert endpoint.failure_count == 0 and endpoint.first_failure_at is None


def test_failures_past_the_count_and_the_window_disable_once(
    store_url: str, receiver: Receiver, base_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Failures 1000 s apart with ``disable_after=3`` over 1 h: the 3rd and 4th failures
    (past the count, inside the window) keep the endpoint enabled; the 5th (past both)
    disables it, once, with the reason logged and stored; the parked delivery is replayed
    when the endpoint is enabled again."""
    clock = SteppingClock()
    policy = WebhookPolicy(schedules=(ROOMY,), timeout=2.0, disable_after=3, disable_window=HOUR)
    caplog.set_level(logging.INFO, logger="retrysafe.webhooks")
    with Webhooks(store_url, allow_private=True, policy=policy, clock=clock) as hooks:
        path = receiver.plan("/down", 500)
        ep = add(hooks, receiver, base_url, path)
        event = hooks.send("a.b", {})
        run(hooks, on_attempt=clock.ticker(1000.0), lease=LONG_LEASE)
        assert len(receiver.requests(path)) == 5
        endpoint = hooks.get_endpoint(ep)
        reason = "5 consecutive failed attempts over 67 min"
        assert not endpoint.enabled and endpoint.disabled_reason == reason
        assert disabled_lines(caplog, ep) == [f"endpoint {ep} disabled: {reason}"]
        (d,) = hooks.deliveries(endpoint_id=ep)
        assert d.state is JobState.CANCELLED
        receiver.plan(path, 200)
        hooks.enable_endpoint(ep, replay_missed=True)
        run(hooks)
        (d,) = hooks.deliveries(endpoint_id=ep)
        assert d.state is JobState.SUCCEEDED and d.event_id == event.id


def test_a_success_seen_by_another_worker_resets_the_run(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """A success resets the failure run even when the failures were recorded by another
    worker after this worker's last success (nothing cached per process)."""
    policy = WebhookPolicy(
        schedules=(FAST_SCHEDULE,), timeout=2.0, disable_after=6, disable_window=HOUR
    )
    with (
        Webhooks(store_url, allow_private=True, policy=policy) as first,
        Webhooks(store_url, allow_private=True, policy=policy) as second,
    ):
        path = receiver.plan("/wobbly", 200)
        ep = add(first, receiver, base_url, path)
        options: dict[str, Any] = {"poll_interval": 0.01, "budget": None}
        worker_a = first.worker(**options)
        worker_b = second.worker(**options)
        first.send("a.b", {"n": 1})
        worker_a.run_until_idle()  # a success: worker A knows the run is empty
        receiver.plan(path, 500)
        first.send("a.b", {"n": 2})
        worker_b.run_until_idle()  # four failures, recorded by worker B
        assert first.get_endpoint(ep).failure_count == FAST_SCHEDULE.attempts
        receiver.plan(path, 200)
        first.send("a.b", {"n": 3})
        worker_a.run_until_idle()  # a success, seen by worker A
        endpoint = first.get_endpoint(ep)
        assert (endpoint.failure_count, endpoint.first_failure_at) == (0, None)


@pytest.mark.parametrize("where", ["record", "after"])
def test_a_success_ends_a_run_that_began_during_its_attempt(
    store_url: str,
    receiver: Receiver,
    base_url: str,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failures recorded by another worker while this attempt was in flight (after the
    endpoint was read for its signature) are ended by its 2xx: the reset is decided by the
    store after the answer, not by what the attempt read before it; by the record itself
    (SQL stores) or, on an outbox store of one's own, by a write after it."""
    if where == "after":
        from retrysafe.webhooks import _sender

        monkeypatch.setattr(_sender, "delivery_outbox", lambda store: (store, False))
    policy = WebhookPolicy(schedules=(FAST_SCHEDULE,), timeout=5.0)
    with Webhooks(store_url, allow_private=True, policy=policy) as hooks:
        path = receiver.plan("/overlap", 200)
        ep = add(hooks, receiver, base_url, path)
        other = webhook_store(hooks.store)
        now = time.time()
        receiver.before_answer[path] = lambda: [
            other.record_endpoint_failure(ep, now=now) for _ in range(3)
        ]
        hooks.send("a.b", {"n": 1})
        hooks.worker(poll_interval=0.01, budget=None).run_until_idle()
        assert len(receiver.requests(path)) == 1
        endpoint = hooks.get_endpoint(ep)
        assert (endpoint.failure_count, endpoint.first_failure_at) == (0, None)


def test_a_success_is_never_recorded_without_the_end_of_its_run(
    store_url: str,
    receiver: Receiver,
    base_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The record of a 2xx and the end of its endpoint's failure run are one transaction:
    when the statement ending the run fails, the success is not recorded either (no lease
    lost, nothing half written), and the worker sends the delivery again, with its same
    webhook-id; that record ends the run."""
    from retrysafe import RetryPolicy
    from retrysafe.stores._connector import Statement
    from retrysafe.webhooks import _store

    # A statement that fails when it runs (an integer overflow), once.
    broken = Statement(
        "end_delivery_runs",
        {
            "sqlite": ("SELECT abs(-9223372036854775807 - 1)",),
            "postgres": (b"SELECT abs((-9223372036854775807 - 1)::bigint)",),
        },
    )
    statements, failures = _store._SQL, [1]

    class FailingOnce:
        def __getitem__(self, name: str) -> Any:
            if name == "end_delivery_runs" and failures[0]:
                failures[0] -= 1
                return broken
            return statements[name]

    monkeypatch.setattr(_store, "_SQL", FailingOnce())
    with Webhooks(store_url, allow_private=True) as hooks:
        path = receiver.plan("/ok-once-more", 200)
        ep = add(hooks, receiver, base_url, path)
        webhook_store(hooks.store).record_endpoint_failure(ep, now=time.time())
        hooks.send("a.b", {"n": 1})
        pol = RetryPolicy(timeout=2.0, wait_initial=0.01, wait_max=0.02)
        stats = hooks.worker(policy=pol, poll_interval=0.01, budget=None).run_until_idle()
        (d,) = hooks.deliveries(endpoint_id=ep)
        assert d.state is JobState.SUCCEEDED and stats.lease_lost == 0
        assert failures == [0] and hooks.get_endpoint(ep).failure_count == 0
        seen = receiver.requests(path)
        assert len(seen) == 2 and len({r.headers["webhook-id"] for r in seen}) == 1
        assert [a.outcome for a in hooks.attempts(d.id)] == ["success"]


def test_410_gone_disables_at_once_with_the_default_window(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """410 Gone needs no run and no window: the first 410 disables the endpoint."""
    policy = WebhookPolicy(schedules=(ROOMY,), timeout=2.0)
    with Webhooks(store_url, allow_private=True, policy=policy) as hooks:
        path = receiver.plan("/gone", 410)
        ep = add(hooks, receiver, base_url, path)
        hooks.send("a.b", {"n": 1})
        run(hooks)
        endpoint = hooks.get_endpoint(ep)
        assert not endpoint.enabled
        assert endpoint.disabled_reason == "410 Gone at attempt 1"
        assert len(receiver.requests(path)) == 1
