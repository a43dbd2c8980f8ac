"""The worker's safety properties: leases, cancellation, shutdown, budget, Retry-After, and
reconcile — each on both SQL stores (SQLite, and PostgreSQL on its server clock)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from retrysafe import AsyncOutbox, JobState, Outbox, RetryBudget, RetryPolicy, Worker
from retrysafe.client import outbox_store
from retrysafe.client._worker import GRACE_MARGIN

from .conftest import FAST, OutboxDatabase, Script, Step, run_bounded


@pytest.fixture
def outbox(sql_store: Any) -> Iterator[Outbox]:
    """An outbox on each SQL store in turn (this module's tests run on both)."""
    with Outbox(sql_store, policy=FAST) as ob:
        yield ob


def test_outbox_and_worker_deliver_every_job(outbox: Outbox, script: Script, base_url: str) -> None:
    """Jobs submitted to the outbox are delivered with their keys and end SUCCEEDED, a retried
    job keeping its key."""
    script.plan("/flaky", Step(503), Step(200))
    script.plan("/ok", Step(200))
    flaky = outbox.submit(base_url + "/flaky", json={"order": 1})
    oks = [outbox.submit(base_url + "/ok", json={"i": i}) for i in range(5)]
    stats = outbox.worker(poll_interval=0.01).run_until_idle()
    assert stats.succeeded == 6
    for job in [flaky, *oks]:
        assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert [s.key for s in script.requests("/flaky")] == [flaky.key, flaky.key]
    assert [a.status for a in outbox.attempts(flaky.id)] == [503, 200]


def test_two_workers_on_one_store_never_send_a_job_twice_at_once(
    outbox: Outbox, outbox_database: OutboxDatabase, script: Script, base_url: str
) -> None:
    """Two workers (own connections or pools) on one store: each job sent once, never in
    parallel (at most one in-flight request per key)."""
    script.plan("/pair", Step(200, sleep=0.02))
    jobs = [outbox.submit(base_url + "/pair", json={"i": i}) for i in range(60)]
    stores = [outbox_database.open(), outbox_database.open()]
    workers = [Worker(s, policy=FAST, concurrency=8, poll_interval=0.01) for s in stores]
    threads = [threading.Thread(target=w.run_until_idle) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(w.stats.succeeded > 0 for w in workers)
    assert sum(w.stats.succeeded for w in workers) == 60
    keys = [s.key or "" for s in script.requests("/pair")]
    assert sorted(keys) == sorted(j.key for j in jobs)  # each job sent exactly once
    assert max(script.max_in_flight.values()) == 1
    for s in stores:
        s.close()


def test_cancelled_worker_leaves_its_job_pending_with_the_same_key(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """Cancelling the worker mid-attempt: not retried, not counted; PENDING, same key."""
    script.plan("/hang", Step(200, sleep=5.0))
    job = outbox.submit(base_url + "/hang", json={})
    worker = outbox.worker()

    async def main() -> None:
        task = asyncio.create_task(worker.serve())
        assert await asyncio.to_thread(script.started.wait, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    final = outbox.get(job.id)
    assert final.state is JobState.PENDING
    assert final.key == job.key
    assert final.attempts == 0 and final.lease_token is None
    assert outbox.attempts(job.id) == []
    assert worker.stats.released == 1

def test_a_cancel_that_meets_a_wake_up_still_stops_the_worker(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """CI: Ctrl-C to `retrysafe worker` mid-attempt and the worker ran on (30 s, then the test
    gave up). The worker waited for a wake-up with ``asyncio.wait_for``, which on Python
    3.11 returns the result, dropping the cancellation, when its inner wait has finished by
    the time the cancellation lands: a wake-up (a slot freed, a job submitted) in the same
    turn of the loop as Ctrl-C lost the Ctrl-C. Here both come in one callback."""
    script.plan("/hang", Step(200, sleep=5.0))
    job = outbox.submit(base_url + "/hang", json={})
    worker = outbox.worker()

    async def main() -> bool:
        task = asyncio.create_task(worker.serve())
        assert await asyncio.to_thread(script.started.wait, 10)
        await asyncio.sleep(0.05)  # the worker waits for a wake-up now
        worker._wake_threadsafe()  # the wake-up, then the cancellation, in one turn
        task.cancel()
        await asyncio.wait({task}, timeout=3.0)
        if not task.done():
            worker.stop()
            await asyncio.wait({task}, timeout=10.0)
            return False
        return task.cancelled()

    assert asyncio.run(main()), "the cancellation was lost: the worker ran on"
    final = outbox.get(job.id)
    assert final.state is JobState.PENDING and final.key == job.key and final.attempts == 0



def test_graceful_stop_finishes_in_flight_attempts(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """stop() stops claiming and lets the in-flight attempt finish within the grace period."""
    script.plan("/finish", Step(201, sleep=0.3))
    job = outbox.submit(base_url + "/finish", json={})
    worker = outbox.worker(grace=5.0)

    async def main() -> None:
        task = asyncio.create_task(worker.serve())
        assert await asyncio.to_thread(script.started.wait, 10)
        worker.stop()
        await task

    asyncio.run(main())
    assert outbox.get(job.id).state is JobState.SUCCEEDED


def test_graceful_stop_releases_what_outlives_the_grace_period(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """An attempt still running when the grace period ends goes back to PENDING, same key."""
    script.plan("/outlive", Step(201, sleep=3.0))
    job = outbox.submit(base_url + "/outlive", json={})
    worker = outbox.worker(grace=0.1)

    async def main() -> None:
        task = asyncio.create_task(worker.serve())
        assert await asyncio.to_thread(script.started.wait, 10)
        worker.stop()
        await task

    asyncio.run(main())
    final = outbox.get(job.id)
    assert (final.state, final.key, final.attempts) == (JobState.PENDING, job.key, 0)
    assert final.last_error is not None and "may have been sent" in final.last_error


def test_by_default_the_grace_outlasts_the_attempt_timeout(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """The documented promise (SIGTERM: in-flight attempts finish) holds for any timeout: by
    default a stop waits out the attempt's own timeout, and the answer is recorded. (With a
    fixed 10 s grace, a slower attempt under a longer timeout was cut off and released.)"""
    slow = RetryPolicy(timeout=30.0)
    worker = outbox.worker(policy=slow)
    assert worker.grace == 30.0 + GRACE_MARGIN
    assert outbox.worker(policy=RetryPolicy(timeout=2.0)).grace == 2.0 + GRACE_MARGIN
    assert outbox.worker(grace=0).grace == 0


def test_retry_budget_defers_but_never_drops_jobs(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """While a destination fails the budget defers retries; every job still succeeds."""
    script.plan("/outage", *[Step(503)] * 30, Step(201))
    jobs = [outbox.submit(base_url + "/outage", json={"i": i}) for i in range(10)]
    policy = RetryPolicy(attempts=50, wait_initial=0.01, wait_max=0.02, timeout=2.0)
    worker = outbox.worker(
        policy=policy, concurrency=10, budget=RetryBudget(capacity=3, refill_per_second=40.0)
    )
    worker.run_until_idle()
    assert worker.stats.deferred > 0
    assert {outbox.get(j.id).state for j in jobs} == {JobState.SUCCEEDED}
    for j in jobs:  # a deferral is not an attempt
        assert outbox.get(j.id).attempts == len(outbox.attempts(j.id))


def test_retry_budget_limits_retries_during_an_outage(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """Without the budget an outage multiplies requests; with it they are bounded."""
    script.plan("/storm", Step(503))
    for i in range(20):
        outbox.submit(base_url + "/storm", json={"i": i}, deadline=0.6)
    policy = RetryPolicy(attempts=100, wait_initial=0.01, wait_max=0.01, timeout=1.0)
    outbox.worker(
        policy=policy, concurrency=20, budget=RetryBudget(capacity=5, refill_per_second=10.0)
    ).run_until_idle()
    sent = len(script.requests("/storm"))
    # 20 first attempts + a burst of 5 + about 10/s for 0.6 s (with slack for timing).
    assert sent <= 20 + 5 + 10 + 10
    assert {j.state for j in outbox.jobs()} == {JobState.UNKNOWN}


def test_deferred_retries_wait_for_their_token_and_come_due_once_the_destination_recovers(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """During an outage each deferred retry takes a slot one refill apart, so the worker does
    not claim and defer every one of them again at each refill; once the destination answers
    again, each success brings a deferred retry forward. Before, 60 jobs made about 1,110
    deferrals in a 1 s outage (every deferred retry was due again within 0.1 s); with the
    slots alone and nothing brought forward, the last retry came 2.9 s after the recovery
    (0.05 s with it)."""
    n = 60
    script.plan("/down", *[Step(503)] * (n + 20), Step(201))
    jobs = [outbox.submit(base_url + "/down", json={"i": i}) for i in range(n)]
    policy = RetryPolicy(attempts=100, wait_initial=0.01, wait_max=0.02, timeout=2.0)
    budget = RetryBudget(capacity=3, refill_per_second=20.0)
    worker = outbox.worker(policy=policy, concurrency=16, budget=budget)
    worker.run_until_idle()
    ended = time.time()
    assert {outbox.get(j.id).state for j in jobs} == {JobState.SUCCEEDED}
    seen = script.requests("/down")
    assert len(seen) == n + 20 + n  # each failed job once more, then succeeded
    assert worker.stats.deferred <= 4 * n
    recovered = seen[n + 20].at  # the first request answered 201
    # 3 s (60 retries at 20 refills a second) when nothing is brought forward; a margin for
    # a loaded host (1.07 s in a run with another test load beside the suite's).
    assert ended - recovered < 2.0


def test_a_deferred_retry_comes_due_by_its_deadline_not_at_a_far_slot(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """60 jobs with a 1 s deadline to a destination that keeps failing, one retry per 0.5 s:
    their slots reach 15 s out, and a job waited in one long past its deadline before it was
    parked UNKNOWN (a fresh-user pass: 30 s late at the median)."""
    script.plan("/gone", Step(503))
    for i in range(60):
        outbox.submit(base_url + "/gone", json={"i": i}, deadline=1.0)
    policy = RetryPolicy(attempts=100, wait_initial=0.01, wait_max=0.02, timeout=2.0)
    budget = RetryBudget(capacity=1, refill_per_second=2.0)
    started = time.monotonic()
    outbox.worker(policy=policy, concurrency=16, budget=budget).run_until_idle()
    assert time.monotonic() - started < 6.0
    assert {j.state for j in outbox.jobs(limit=100)} == {JobState.UNKNOWN}


def test_budget_slots_are_one_refill_apart_and_successes_pay_for_the_earliest() -> None:
    from retrysafe.client._worker import DEFERRAL_SPAN_MAX, _Budgets

    budgets = _Budgets(RetryBudget(capacity=2.0, refill_per_second=4.0))
    rng = random.Random(1)
    assert [budgets.spend("d", 100.0)[0] for _ in range(3)] == [True, True, False]
    dues = [budgets.defer("d", 100.0, 0.25, rng) for i in range(4)]
    for i, due in enumerate(dues):
        budgets.deferred("d", f"j{i}", due, 100.0)
    for i, due in enumerate(dues):  # slot i at 100.25 + i/4, jittered within its step
        assert 100.25 + i * 0.25 <= due < 100.25 + (i + 1) * 0.25
    # Past the span the slots start again from the front.
    slots = int(DEFERRAL_SPAN_MAX * 4)
    more = [budgets.defer("d", 100.0, 0.25, rng) for i in range(slots)]
    wrapped = next(i for i in range(1, len(more)) if more[i] < more[i - 1])
    assert wrapped == slots - len(dues)
    assert 100.25 <= more[wrapped] < 100.5
    # A success pays for the earliest deferred retries not yet due (as many as the bucket
    # holds whole tokens); those due by now (and within 0.05 s) are skipped.
    assert budgets.credit("d", 100.0) == [("j0", dues[0], 100.0)]  # 0 tokens + 1 credit
    # full: 2 tokens; j1 was due before 100.75
    assert budgets.credit("d", 100.7) == [("j2", dues[2], 100.0), ("j3", dues[3], 100.0)]
    assert budgets.credit("e", 100.0) == []  # never spent


@pytest.mark.parametrize(
    "damage",
    [
        "headers = '[[1]'",
        # TEXT that is no UTF-8: the claim statement itself failed, after it leased the
        # jobs, and the worker stopped naming no job.
        "url = CAST(X'687474703aff' AS TEXT)",
    ],
)
def test_a_job_whose_row_cannot_be_read_is_parked_and_the_worker_goes_on(
    outbox: Outbox, script: Script, base_url: str, damage: str
) -> None:
    """A job row that something else damaged made every worker that claimed it stop with a
    traceback, again after each restart. It is parked UNKNOWN, never sent; the others go."""
    good = outbox.submit(base_url + "/fine", json={})
    bad = outbox.submit(base_url + "/never", json={})
    with outbox.store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(f"UPDATE outbox_jobs SET {damage} WHERE id = '{bad.id}'")
    stats = outbox.worker(policy=FAST).run_until_idle()
    assert stats.succeeded == 1 and outbox.get(good.id).state is JobState.SUCCEEDED
    assert stats.unknown == 1  # parked: left UNKNOWN (a run that parked one said none was)
    assert script.requests("/never") == []
    with outbox.store.transaction() as conn:  # type: ignore[attr-defined]
        state = conn.execute(f"SELECT state FROM outbox_jobs WHERE id = '{bad.id}'").fetchone()
    assert state[0] == "unknown"


def test_retry_after_variants_are_handled_without_crashing(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """Retry-After `1m0s` (ignored), a past HTTP-date and a huge value (capped) all work."""
    script.plan("/ra1", Step(429, headers={"Retry-After": "1m0s"}), Step(201))
    script.plan(
        "/ra2", Step(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}), Step(201)
    )
    script.plan("/ra3", Step(429, headers={"Retry-After": "9" * 30}), Step(201))
    jobs = [outbox.submit(base_url + p, json={}) for p in ("/ra1", "/ra2", "/ra3")]
    policy = RetryPolicy(wait_initial=0.01, wait_max=0.02, retry_after_max=0.2)
    outbox.worker(policy=policy).run_until_idle()
    assert [outbox.get(j.id).state for j in jobs] == [JobState.SUCCEEDED] * 3


def test_submit_wakes_a_running_worker_immediately(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """An in-process submit wakes an idle worker without waiting for the poll interval."""
    script.plan("/wake", Step(201))
    worker = outbox.worker(poll_interval=30.0)
    done = threading.Event()

    async def main() -> None:
        task = asyncio.create_task(worker.serve())
        await asyncio.sleep(0.1)
        job = await asyncio.to_thread(outbox.submit, base_url + "/wake", json={})
        for _ in range(200):
            if outbox.get(job.id).state is JobState.SUCCEEDED:
                done.set()
                break
            await asyncio.sleep(0.01)
        worker.stop()
        await task

    asyncio.run(main())
    assert done.is_set()


def test_every_attempt_is_recorded_and_logged(
    outbox: Outbox, script: Script, base_url: str, caplog: object
) -> None:
    """Each attempt row has job id, key, number, start, duration, outcome, status, error type."""
    import logging

    script.plan("/log", Step(503), Step(201))
    job = outbox.submit(base_url + "/log", json={})
    wall, started = time.time(), time.perf_counter()
    with caplog.at_level(logging.INFO, logger="retrysafe.client"):  # type: ignore[attr-defined]
        outbox.worker().run_until_idle()
    window, wall_end = time.perf_counter() - started, time.time()
    first, second = outbox.attempts(job.id)
    assert (first.number, first.status, first.outcome) == (1, 503, "server_error")
    assert (second.number, second.status, second.outcome) == (2, 201, "success")
    assert first.key == second.key == job.key
    # Start times and durations are the attempts' own, inside the run the test timed.
    for a in (first, second):
        assert wall <= a.started_at <= wall_end and 0 < a.duration <= window
    records = [r for r in caplog.records if hasattr(r, "retrysafe")]  # type: ignore[attr-defined]
    assert [r.retrysafe["number"] for r in records] == [1, 2]


def test_reconcile_resends_an_unknown_job_once_with_the_same_key(
    outbox: Outbox, sql_store: Any, script: Script, base_url: str
) -> None:
    """An UNKNOWN job is re-sent by reconcile once, with its key, and ends SUCCEEDED."""
    script.plan("/unknown", Step(200))
    job = outbox.submit(base_url + "/unknown", json={})
    outbox_store(sql_store).transition_job(
        job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0.0
    )
    report = outbox.reconcile()
    assert report.succeeded == 1
    assert outbox.get(job.id).state is JobState.SUCCEEDED
    assert [s.key for s in script.requests("/unknown")] == [job.key]


def test_async_outbox_submits_on_the_async_face_and_the_worker_delivers(
    sql_store: Any, script: Script, base_url: str
) -> None:
    """AsyncOutbox.submit (the store's async face) records the job once per key; a worker
    started from it delivers it with that key."""
    script.plan("/async", Step(201))

    async def main() -> tuple[str, str, str, JobState]:
        async with AsyncOutbox(sql_store, policy=FAST) as outbox:
            job = await outbox.submit(base_url + "/async", json={"a": 1}, key="async-1")
            again = await outbox.submit(base_url + "/async", json={"a": 1}, key="async-1")
            await outbox.worker(poll_interval=0.01).serve(until_idle=True)
            final = await outbox.get(job.id)
            return job.id, again.id, job.key, final.state

    job_id, again_id, key, state = asyncio.run(main())
    assert again_id == job_id and state is JobState.SUCCEEDED
    assert [s.key for s in script.requests("/async")] == [key]


def test_a_success_credits_back_what_retries_spent_and_a_full_bucket_is_forgotten() -> None:
    """The per-destination buckets: a destination that never retried keeps no state (a
    success credits a full bucket nothing); retries spend it, successes put tokens back, and
    a bucket full again is dropped, the same as one never spent."""
    from retrysafe.client._worker import _Budgets

    budgets = _Budgets(RetryBudget(capacity=3.0, refill_per_second=0.0, success_credit=1.0))
    budgets.credit("http://a:80", 0.0)
    assert budgets._state == {}
    assert [budgets.spend("http://a:80", 0.0)[0] for _ in range(4)] == [True, True, True, False]
    budgets.credit("http://a:80", 1.0)
    assert budgets._state["http://a:80"].tokens == 1.0
    assert budgets.spend("http://a:80", 1.0)[0] is True
    for _ in range(3):
        budgets.credit("http://a:80", 2.0)
    assert budgets._state == {}  # full again: forgotten
    assert [budgets.spend("http://a:80", 2.0)[0] for _ in range(4)] == [True, True, True, False]


def test_a_job_that_keeps_failing_in_the_worker_is_parked_unknown(
    outbox: Outbox, script: Script, base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose every attempt fails inside the worker (a bug after the answer: here the
    next-step rule raises) is released PENDING, after a doubling delay, then parked UNKNOWN at
    the third failure in a row (it was sent: reconcile it once the cause is fixed) — it was
    sent again forever, its attempts never recorded. Another job, whose attempt is recorded
    between its failures, starts its count again."""
    import contextvars

    import retrysafe.client._worker as worker_module
    from retrysafe.client._worker import WORKER_ERRORS_MAX

    # Whether this attempt's next step fails: set by the send, read by the next-step rule
    # (both run in the attempt's task).
    fails: contextvars.ContextVar[bool] = contextvars.ContextVar("fails", default=False)
    real_next_step = getattr(worker_module, "next_step")  # noqa: B009 (not exported)
    real_send = getattr(worker_module, "send_attempt")  # noqa: B009
    flaky = {"n": 0}

    def next_step(classification: Any, **kw: Any) -> Any:
        if fails.get():
            raise RuntimeError("a bug after the answer")
        return real_next_step(classification, **kw)

    async def send_attempt(client: Any, job: Any, **kw: Any) -> Any:
        if job.url.endswith("/flaky"):  # fails in the worker every other time
            flaky["n"] += 1
            fails.set(flaky["n"] % 2 == 1)
        else:
            fails.set(job.url.endswith("/broken"))
        return await real_send(client, job, **kw)

    monkeypatch.setattr(worker_module, "next_step", next_step)
    monkeypatch.setattr(worker_module, "send_attempt", send_attempt)
    script.plan("/broken", *[Step(201)] * 10)
    script.plan("/flaky", *[Step(503)] * 10)
    bad = outbox.submit(base_url + "/broken", json={})
    other = outbox.submit(base_url + "/flaky", json={})
    policy = RetryPolicy(attempts=3, wait_initial=0.01, wait_max=0.05)
    worker = outbox.worker(policy=policy)

    run_bounded(worker)  # the bug this pins down sent the job forever
    parked = outbox.get(bad.id)
    assert parked.state is JobState.UNKNOWN
    assert parked.last_error is not None and "parked UNKNOWN" in parked.last_error
    assert len(script.requests("/broken")) == WORKER_ERRORS_MAX
    assert outbox.attempts(bad.id) == []  # no answer was recorded: its outcome is unknown
    # Recorded attempts between its failures: it ran out of attempts as the policy says.
    done = outbox.get(other.id)
    assert done.state is JobState.UNKNOWN and done.attempts == 3
    assert "parked" not in (done.last_error or "")
    # Both counted UNKNOWN (what `worker --until-idle` exits 1 for).
    assert worker.stats.unknown == 2


def test_a_job_whose_attempt_hooks_cannot_be_made_is_parked_unknown(
    outbox: Outbox, script: Script, base_url: str
) -> None:
    """An ``AttemptHooksFactory.attempt`` that raises is a worker error like any other (it
    left the job IN_FLIGHT, claimed again at every lease): released, then parked UNKNOWN."""
    from retrysafe.client._worker import WORKER_ERRORS_MAX

    class Broken:
        def attempt(self, job: Any) -> Any:
            raise RuntimeError("no hooks today")

        async def aclose(self) -> None:
            return None

    script.plan("/x", *[Step(201)] * 5)
    job = outbox.submit(base_url + "/x", json={})
    worker = Worker(
        outbox.store,
        policy=RetryPolicy(wait_initial=0.01, wait_max=0.05),
        attempt_hooks=Broken(),
        poll_interval=0.01,
    )

    run_bounded(worker)  # the bug this pins down sent the job forever
    parked = outbox.get(job.id)
    assert parked.state is JobState.UNKNOWN
    assert parked.last_error is not None and "no hooks today" in parked.last_error
    assert script.requests("/x") == []  # never sent: the hooks come first
    assert worker.stats.unknown == 1 and WORKER_ERRORS_MAX == 3


@pytest.mark.parametrize("budget", [{"capacity": 1}, 5, "x", RetryPolicy()])
def test_a_budget_that_is_no_retry_budget_is_refused_up_front(outbox: Outbox, budget: Any) -> None:
    """It was accepted, then every job failed inside the worker at its first retry."""
    from retrysafe import ConfigurationError

    with pytest.raises(ConfigurationError, match="budget must be a RetryBudget or None"):
        outbox.worker(budget=budget)
