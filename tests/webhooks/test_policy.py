"""SPEC §6 policy: one test per row, pure and through a real receiver and the chaos proxy."""

from __future__ import annotations

import random
from typing import Any

import pytest

from retrysafe import JobState
from retrysafe._serving import free_port
from retrysafe.chaos import ChaosProxy, FaultRates
from retrysafe.client._policy import Step
from retrysafe.core import classify_response, classify_transport_error
from retrysafe.webhooks import (
    DEFAULT,
    SVIX,
    Schedule,
    WebhookPolicy,
    Webhooks,
    decide,
    should_auto_disable,
)

from .conftest import FAST_SCHEDULE, Receiver, add, run
from .test_auto_disable import LONG_LEASE, SteppingClock

_DEFAULT_STEP = Step(JobState.PENDING, 0.0, 0.0, True, "retry")


def step(status: int | None, *, attempts: int = 0, **kw: object) -> Step:
    classification = (
        classify_transport_error(sent=True) if status is None else classify_response(status)
    )
    options: dict[str, object] = {
        "schedule": DEFAULT,
        "attempts": attempts,
        "now": 1000.0,
        "retry_after": None,
        "retry_after_max": 3600.0,
        "endpoint_enabled": True,
        "default": _DEFAULT_STEP,
        "rng": random.Random(1),
    }
    options.update(kw)
    return decide(classification, **options)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- pure rows
@pytest.mark.parametrize("status", [500, 502, 503, 408, 429, None])
def test_retryable_answers_are_retried(status: int | None) -> None:
    """5xx, 408, 429 and transport errors are retried on the schedule."""
    s = step(status)
    assert s.state is JobState.PENDING and 1.0 <= s.delay < 2.0


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422])
def test_other_4xx_stop(status: int) -> None:
    """Other 4xx are rejected at once, never retried."""
    assert step(status).state is JobState.REJECTED


def test_default_schedule_is_1s_doubling_with_millisecond_jitter() -> None:
    """DEFAULT waits base 1 s × 2ⁿ plus < 1 s of whole-millisecond jitter, 6 attempts."""
    rng = random.Random(3)
    delays = [DEFAULT.delay(n, rng) for n in range(5)]
    for n, d in enumerate(delays):
        assert 2**n <= d < 2**n + 1
        assert round(d * 1000) == pytest.approx(d * 1000)
    assert DEFAULT.attempts == 6


def test_svix_schedule() -> None:
    """SVIX: immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h."""
    rng = random.Random(0)
    waits = [int(SVIX.delay(n, rng)) for n in range(7)]
    assert waits == [5, 300, 1800, 7200, 18000, 36000, 36000]
    assert SVIX.attempts == 8


def test_exhausted_schedule_goes_to_the_dlq() -> None:
    """The last allowed attempt failing parks the delivery as UNKNOWN."""
    assert step(503, attempts=DEFAULT.attempts - 1).state is JobState.UNKNOWN


def test_retry_after_raises_the_wait_up_to_a_cap() -> None:
    """429 with Retry-After waits at least that long, capped at retry_after_max."""
    assert step(429, retry_after=120.0).delay == 120.0
    assert step(429, retry_after=99999.0, retry_after_max=600.0).delay == 600.0


def test_disabled_endpoint_parks_instead_of_retrying() -> None:
    """A retry for an endpoint disabled meanwhile is parked (CANCELLED), not lost."""
    assert step(503, endpoint_enabled=False).state is JobState.CANCELLED


def test_auto_disable_needs_the_count_and_the_window() -> None:
    """A failure run disables only when it is long enough and spans the window."""
    kw = {"disable_after": 5, "disable_window": 60.0}
    assert not should_auto_disable(4, 0.0, 100.0, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(5, 50.0, 100.0, **kw)  # type: ignore[arg-type]
    assert should_auto_disable(5, 40.0, 100.0, **kw)  # type: ignore[arg-type]
    assert not should_auto_disable(10**6, 0.0, 1e9, disable_after=None, disable_window=0)


# ---------------------------------------------------------------------- real receiver
@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_retryable_row_through_a_real_receiver(
    hooks: Webhooks, receiver: Receiver, base_url: str, status: int
) -> None:
    """The receiver answers ``status`` twice, then 200: delivered on the third attempt."""
    path = receiver.plan(f"/r{status}", status, status, 200)
    add(hooks, receiver, base_url, path)
    hooks.send("a.b", {})
    run(hooks)
    (d,) = hooks.deliveries()
    assert d.state is JobState.SUCCEEDED and d.sends == 3
    assert len(receiver.requests(path)) == 3


def test_403_forever_is_attempted_once_and_recorded(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """An endpoint answering 403 forever gets one attempt; the delivery is a dead letter."""
    path = receiver.plan("/forbidden", 403)
    add(hooks, receiver, base_url, path)
    hooks.send("a.b", {})
    run(hooks)
    assert len(receiver.requests(path)) == 1
    (d,) = hooks.dead_letters()
    assert d.state is JobState.REJECTED and d.last_status == 403
    assert [a.status for a in hooks.attempts(d.id)] == [403]


def test_410_disables_the_endpoint_and_parks_its_other_deliveries(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """410 Gone: rejected, the endpoint disabled with a reason, later events kept parked."""
    path = receiver.plan("/gone", 410)
    ep = add(hooks, receiver, base_url, path)
    hooks.send("a.b", {"n": 1})
    run(hooks)
    endpoint = hooks.get_endpoint(ep)
    assert not endpoint.enabled and "410" in (endpoint.disabled_reason or "")
    hooks.send("a.b", {"n": 2})
    run(hooks)
    assert len(receiver.requests(path)) == 1
    states = sorted(d.state.value for d in hooks.deliveries(endpoint_id=ep))
    assert states == ["cancelled", "rejected"]


def test_a_run_of_failures_disables_the_endpoint(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """After ``disable_after`` consecutive failed attempts spanning ``disable_window`` (the
    clock moves 2000 s per attempt: 3 failures span 4000 s >= 1 h) the endpoint is
    disabled, with the count and the span as its reason."""
    clock = SteppingClock()
    policy = WebhookPolicy(
        schedules=(FAST_SCHEDULE,), timeout=2.0, disable_after=3, disable_window=3600.0
    )
    with Webhooks(store_url, allow_private=True, policy=policy, clock=clock) as hooks:
        path = receiver.plan("/down", 500)
        ep = add(hooks, receiver, base_url, path)
        hooks.send("a.b", {"n": 1})
        hooks.send("a.b", {"n": 2})
        run(hooks, concurrency=1, on_attempt=clock.ticker(2000.0), lease=LONG_LEASE)
        endpoint = hooks.get_endpoint(ep)
        assert not endpoint.enabled
        assert endpoint.disabled_reason == "3 consecutive failed attempts over 67 min"
        assert len(receiver.requests(path)) == 3
        assert {d.state for d in hooks.deliveries()} <= {JobState.CANCELLED}


def test_a_success_resets_the_failure_run(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """Failures separated by a success never add up to a disable: with the clock moving
    1000 s per attempt, the four failures would span 4000 s >= the 1 h window and reach the
    count of 3 if the success between them did not end the run."""
    clock = SteppingClock()
    policy = WebhookPolicy(
        schedules=(FAST_SCHEDULE,), timeout=2.0, disable_after=3, disable_window=3600.0
    )
    with Webhooks(store_url, allow_private=True, policy=policy, clock=clock) as hooks:
        path = receiver.plan("/wobbly", 500, 500, 200, 500, 500, 200)
        ep = add(hooks, receiver, base_url, path)
        hooks.send("a.b", {"n": 1})
        run(hooks, on_attempt=clock.ticker(1000.0), lease=LONG_LEASE)
        hooks.send("a.b", {"n": 2})
        run(hooks, on_attempt=clock.ticker(1000.0), lease=LONG_LEASE)
        assert hooks.get_endpoint(ep).enabled
        assert len(receiver.requests(path)) == 6


def test_connection_refused_is_retried_then_dead_lettered(hooks: Webhooks) -> None:
    """Nothing listening: every attempt is a connect error, retried, then UNKNOWN in the DLQ."""
    hooks.add_endpoint(f"http://127.0.0.1:{free_port()}/nobody")
    hooks.send("a.b", {})
    run(hooks)
    (d,) = hooks.dead_letters()
    assert d.state is JobState.UNKNOWN and d.sends == FAST_SCHEDULE.attempts
    assert {a.outcome for a in hooks.attempts(d.id)} == {"connect_error"}


# ---------------------------------------------------------------------- chaos proxy
@pytest.mark.parametrize(
    ("rates", "outcome"),
    [
        (FaultRates(error_before_forward=1.0), "server_error"),
        (FaultRates(error_after_commit=1.0), "server_error"),
        (FaultRates(reset_before_forward=1.0), "transport_error"),
        (FaultRates(lose_after_commit=1.0), "transport_error"),
    ],
    ids=["503-before", "503-after-commit", "reset", "lost-answer"],
)
def test_faults_through_the_chaos_proxy_are_retried(
    hooks: Webhooks, receiver: Receiver, base_url: str, rates: FaultRates, outcome: str
) -> None:
    """Two faulty attempts through the proxy, then it heals: delivered, same webhook-id.

    The proxy heals itself as it logs its second request, right after answering it: the
    worker's ``on_attempt`` runs after the webhook hooks' own store writes, and with a 10 ms
    retry the third attempt can start before it (CI saw four sends on PostgreSQL)."""
    seen_by_proxy: list[dict[str, Any]] = []

    def heal_after_two(record: dict[str, Any]) -> None:
        seen_by_proxy.append(record)
        if len(seen_by_proxy) == 2:
            proxy.heal()

    proxy = ChaosProxy(base_url, rates=rates, seed=1, on_record=heal_after_two)
    with proxy:
        endpoint = hooks.add_endpoint(proxy.url + "/via-proxy")
        receiver.secrets["/via-proxy"] = endpoint.secrets[0][0]
        event = hooks.send("a.b", {"x": 1})
        run(hooks)
    (d,) = hooks.deliveries()
    assert d.state is JobState.SUCCEEDED and d.sends == 3
    outcomes = [a.outcome for a in hooks.attempts(d.id)]
    assert outcomes == [outcome, outcome, "success"]
    seen = receiver.requests("/via-proxy")
    assert seen and all(s.verified and s.headers["webhook-id"] == event.id for s in seen)


# ---------------------------------------------------------------------- rate limit
def test_rate_gate_spaces_attempts() -> None:
    """At 2/s, back-to-back attempts get slots 0.5 s apart; an idle endpoint goes at once."""
    from retrysafe.webhooks import rate_gate

    waits = []
    tat = 0.0
    for _ in range(3):
        wait, tat = rate_gate(tat, 100.0, rate=2.0)
        waits.append(wait)
    assert waits == [0.0, 0.5, 1.0]
    assert rate_gate(tat, 200.0, rate=2.0)[0] == 0.0


def test_rate_limited_endpoint_is_never_sent_faster(
    hooks: Webhooks, receiver: Receiver, base_url: str
) -> None:
    """Five events to an endpoint limited to 10/s arrive ~100 ms apart, deferred not lost."""
    path = receiver.plan("/slow", 200)
    add(hooks, receiver, base_url, path, rate_limit=10.0)
    for i in range(5):
        hooks.send("a.b", {"i": i})
    run(hooks, concurrency=8)
    assert len(receiver.requests(path)) == 5
    # When the worker started each attempt (after the gate's wait), not when it arrived: a
    # loaded machine may delay one request's arrival and squeeze the next gap.
    times = sorted(
        a.started_at for d in hooks.deliveries() for a in hooks.outbox.store.list_attempts(d.id)
    )
    assert len(times) == 5
    # Slots are 100 ms apart; one attempt claimed late (a loaded machine) can shorten the gap
    # to the next, but never the whole run: five attempts at 10/s span at least 400 ms.
    assert times[-1] - times[0] >= 0.39
    assert {d.state for d in hooks.deliveries()} == {JobState.SUCCEEDED}
    assert all(d.sends == 1 for d in hooks.deliveries())  # deferrals are not attempts


def test_a_retry_due_after_the_deadline_goes_to_the_dlq() -> None:
    """The schedule plugs into the one retry rule, so the delivery's deadline is honoured: a
    retry that would be due after it ends the delivery UNKNOWN (the DLQ), not PENDING."""
    s = step(503, deadline_at=1000.5)  # the schedule's first wait is >= 1 s
    assert (s.state, s.reason) == (JobState.UNKNOWN, "deadline exhausted")
    assert step(503, deadline_at=1005.0).state is JobState.PENDING


@pytest.mark.parametrize(
    "make",
    [
        lambda: Schedule(name=""),
        lambda: Schedule(name="  "),
        lambda: Schedule(name="far", delays=(5.0, 1e300)),
        lambda: Schedule(name="far", cap=1e10),
        lambda: Schedule(name="far", base=-1.0),
        lambda: Schedule(name="far", jitter=float("nan")),
        lambda: WebhookPolicy(schedules=(FAST_SCHEDULE, FAST_SCHEDULE)),
        lambda: Schedule(name="fast\n"),
        lambda: Schedule(name="a b"),
        lambda: Schedule(name="x" * 65),
        lambda: Schedule(name="x", attempts=2, delays=(1.0, 2.0, 3.0, 4.0)),
        lambda: Schedule(name="x", base="5"),  # type: ignore[arg-type]
        lambda: Schedule(name="x", delays=("5",)),  # type: ignore[arg-type]
        lambda: Schedule(name="x", cap=True),
        lambda: Schedule(name="x", attempts=True),
        lambda: WebhookPolicy(timeout=1e300),
        lambda: WebhookPolicy(timeout=0),
        lambda: WebhookPolicy(timeout="5"),  # type: ignore[arg-type]
        lambda: WebhookPolicy(retry_after_max=float("nan")),
        lambda: WebhookPolicy(retry_after_max=1e9 + 1),
    ],
    ids=[
        "empty-name",
        "blank-name",
        "delay-1e300",
        "cap-1e10",
        "negative",
        "nan",
        "twice",
        "newline-name",
        "spaced-name",
        "long-name",
        "attempts-against-delays",
        "string-base",
        "string-delay",
        "bool-cap",
        "bool-attempts",
        "timeout-1e300",
        "timeout-0",
        "timeout-string",
        "retry-after-nan",
        "retry-after-past-1e9",
    ],
)
def test_a_schedule_that_cannot_work_is_refused(make: Any) -> None:
    """A schedule without a name (or one no command line could type), with a wait past
    MAX_SCHEDULE_SECONDS (a delivery waited for ever behind a delay of 1e300 s) or that is no
    number, with attempts its delays contradict (2 asked, 5 made), or two schedules of one
    name: refused at once."""
    from retrysafe import ConfigurationError

    with pytest.raises(ConfigurationError):
        make()


def test_explicit_delays_make_the_attempts() -> None:
    """With delays, attempts follows them: left out, or given as that same number; the
    delays are kept as float seconds."""
    assert Schedule(name="x", delays=(1, 2, 3, 4)).attempts == 5
    given = Schedule(name="x", attempts=5, delays=(1, 2, 3, 4))
    assert (given.attempts, given.delays) == (5, (1.0, 2.0, 3.0, 4.0))
    assert Schedule(name="x", attempts=3, delays=(1.0, 2.0)).attempts == 3


def test_a_worker_warns_of_an_endpoint_whose_schedule_its_policy_lacks(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint registered with a schedule of another program's policy ("fast") is
    delivered on the default schedule by a worker whose policy lacks it: the worker says so
    once, at its start, naming the endpoint, the schedule and the one used instead."""
    import logging

    fast = Schedule(name="fast", attempts=3, base=0.01, cap=0.02, jitter=0.0)
    mine = WebhookPolicy(schedules=(DEFAULT, fast))
    with Webhooks(store_url, allow_private=True, policy=mine) as hooks:
        ep = hooks.add_endpoint("http://127.0.0.1:9/x", schedule="fast")
        known = hooks.add_endpoint("http://127.0.0.1:9/y")
    with Webhooks(store_url, allow_private=True) as other, caplog.at_level(logging.WARNING):
        other.worker()
    lines = [r.getMessage() for r in caplog.records if "schedule" in r.getMessage()]
    assert len(lines) == 1 and ep.id in lines[0] and "'fast'" in lines[0], lines
    assert "follow 'default'" in lines[0] and known.id not in lines[0]
