"""Prometheus metrics: each SPEC §3/§5 row moves its counter, store values are read at scrape
time, and a store that is down still gives a scrape (``retrysafe_store_up 0``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe import ConfigurationError, Outbox, RetryPolicy, SQLiteStore
from retrysafe._serving import ServerThread
from retrysafe.agents import start_run, tool
from retrysafe.client import JobState
from retrysafe.observability import (
    Prometheus,
    StoreCollector,
    metrics_asgi_app,
    serve_metrics,
    telemetry_of,
)
from retrysafe.server import IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import PostgresStore

FAST = RetryPolicy(attempts=3, wait_initial=0.01, wait_max=0.02, timeout=2.0, poll_interval=0.01)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0.0 when it does not exist (yet)."""
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _charge_app(
    effects: list[bytes],
    started: asyncio.Event | None = None,
    release: asyncio.Event | None = None,
) -> Starlette:
    async def charge(request: Request) -> Response:
        body = await request.body()
        if started is not None and release is not None:
            started.set()
            await release.wait()
        effects.append(body)
        return JSONResponse({"n": len(effects)}, 201)

    return Starlette(routes=[Route("/charge", charge, methods=["POST"])])


async def _post(app: Any, body: bytes, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        return await c.post("/charge", content=body, headers=headers)


# ---------------------------------------------------------------------- the seam
def test_importing_retrysafe_does_not_import_prometheus_client() -> None:
    """``import retrysafe`` (and its observability package) leaves prometheus_client unloaded."""
    code = (
        "import sys, retrysafe, retrysafe.observability, retrysafe.server, retrysafe.client\n"
        "assert 'prometheus_client' not in sys.modules, 'imported early'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_registry_that_is_not_one_is_refused() -> None:
    """``Prometheus(registry="x")`` raises ConfigurationError naming the option."""
    with pytest.raises(ConfigurationError) as err:
        Prometheus("x")  # type: ignore[arg-type]
    assert err.value.option == "registry"


def test_two_prometheus_on_one_registry_share_its_families(registry: CollectorRegistry) -> None:
    """A second ``Prometheus`` on the same registry counts into the same families instead of
    failing as a duplicate registration."""
    a, b = Prometheus(registry), Prometheus(registry)
    a.server_event("client-gone")
    b.server_event("client-gone")
    assert value(registry, "retrysafe_server_events_total", event="client-gone") == 2.0


def test_a_registry_already_holding_the_name_gives_a_clear_error(
    registry: CollectorRegistry,
) -> None:
    """A registry where something else registered a retrysafe name: ConfigurationError."""
    from prometheus_client import Counter

    Counter("retrysafe_server_decisions", "someone else's", registry=registry)
    with pytest.raises(ConfigurationError, match="cannot register"):
        Prometheus(registry)


def test_telemetry_that_is_not_one_is_refused() -> None:
    """``telemetry=object()`` on the middleware is a ConfigurationError, not a late crash."""
    with pytest.raises(ConfigurationError) as err:
        telemetry_of(object())  # type: ignore[arg-type]
    assert err.value.option == "telemetry"
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(_charge_app([]), "memory://", telemetry="prometheus")


# ---------------------------------------------------------------------- server
@pytest.mark.anyio
async def test_decisions_are_counted_by_outcome(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    """new, replayed, key-reused, unkeyed, invalid-key: each row of SPEC §3 moves its own
    counter, and the store's claim and complete are timed under store="sqlite"."""
    effects: list[bytes] = []
    app = IdempotencyMiddleware(
        _charge_app(effects), f"sqlite:///{tmp_path}/k.db", telemetry=Prometheus(registry)
    )
    try:
        assert (await _post(app, b"1", "k1")).status_code == 201
        replay = await _post(app, b"1", "k1")
        assert replay.headers["idempotent-replayed"] == "true"
        assert (await _post(app, b"2", "k1")).status_code == 422
        assert (await _post(app, b"3", None)).status_code == 201
        assert (await _post(app, b"4", "bad key\x01")).status_code == 400
    finally:
        app.close()
    d = "retrysafe_server_decisions_total"
    assert value(registry, d, decision="new") == 1.0
    assert value(registry, d, decision="replayed") == 1.0
    assert value(registry, d, decision="key-reused") == 1.0
    assert value(registry, d, decision="unkeyed") == 1.0
    assert value(registry, d, decision="invalid-key") == 1.0
    assert len(effects) == 2
    ops = "retrysafe_store_operation_duration_seconds_count"
    assert value(registry, ops, store="sqlite", operation="claim") == 3.0
    assert value(registry, ops, store="sqlite", operation="complete") == 1.0
    assert value(registry, "retrysafe_server_request_duration_seconds_count", decision="new") == 1


@pytest.mark.anyio
async def test_a_taken_over_key_and_an_in_progress_repeat_are_counted(
    registry: CollectorRegistry,
) -> None:
    """A repeat while the original runs is ``in-progress``; a claim that took over an
    expired lease and stored its answer is ``taken-over``, not ``new``."""
    from retrysafe.core import key_hash, scope_from_authorization
    from retrysafe.stores import MemoryStore

    store = MemoryStore()
    started, release = asyncio.Event(), asyncio.Event()
    effects: list[bytes] = []
    app = IdempotencyMiddleware(
        _charge_app(effects, started, release), store, telemetry=Prometheus(registry)
    )
    first = asyncio.create_task(_post(app, b"1", "k2"))
    await started.wait()
    assert (await _post(app, b"1", "k2")).status_code == 409
    release.set()
    assert (await first).status_code == 201
    assert value(registry, "retrysafe_server_decisions_total", decision="in-progress") == 1.0
    # A claim left by a claimant that died: expired lease, taken over by the next attempt.
    h = key_hash(scope_from_authorization({}), "k3")
    from retrysafe.core import fingerprint

    store.claim(
        h,
        fingerprint("POST", "/charge", "", b"9", None),
        now=time.time() - 100,
        lease=1.0,
        retention=3600.0,
    )
    assert (await _post(app, b"9", "k3")).status_code == 201
    assert value(registry, "retrysafe_server_decisions_total", decision="taken-over") == 1.0


@pytest.mark.anyio
async def test_store_unavailable_is_counted_with_the_failed_operation(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    """A store that cannot be reached: decision ``store-unavailable`` and the claim counted
    as an ``unavailable`` store error (the request is answered 503, nothing runs)."""
    effects: list[bytes] = []
    from retrysafe.stores import RedisStore

    # Nothing listens on port 1: every operation is unavailable.
    store = RedisStore("redis://127.0.0.1:1/0", check=False, socket_timeout=0.5)
    app = IdempotencyMiddleware(_charge_app(effects), store, telemetry=Prometheus(registry))
    try:
        assert (await _post(app, b"1", "k4")).status_code == 503
    finally:
        store.close()
    assert effects == []
    assert value(registry, "retrysafe_server_decisions_total", decision="store-unavailable") == 1
    assert (
        value(
            registry,
            "retrysafe_store_operation_errors_total",
            store="redis",
            operation="claim",
            error="unavailable",
        )
        >= 1.0
    )


def test_lease_renewals_are_counted_while_a_slow_handler_runs(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    """A handler that outlives a few heartbeats: ``renewed`` renewals are counted (WSGI)."""
    metrics = Prometheus(registry)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        wait_for(
            lambda: value(registry, "retrysafe_server_lease_renewals_total", result="renewed") >= 2
        )
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    wrapped = WSGIIdempotencyMiddleware(
        app, SQLiteStore(tmp_path / "k.db"), lease=0.3, heartbeat=0.05, telemetry=metrics
    )
    from werkzeug.test import Client

    r = Client(wrapped).post("/x", data=b"1", headers={"Idempotency-Key": "slow"})
    assert r.status_code == 201
    assert value(registry, "retrysafe_server_lease_renewals_total", result="renewed") >= 2
    assert value(registry, "retrysafe_server_decisions_total", decision="new") == 1.0


def test_the_asgi_metrics_app_serves_the_registry(registry: CollectorRegistry) -> None:
    """``metrics_asgi_app(metrics)`` mounted in an app answers a real HTTP scrape."""
    metrics = Prometheus(registry)
    metrics.server_event("stored-late")
    with ServerThread(metrics_asgi_app(metrics)) as server:
        text = httpx.get(server.url + "/metrics").text
    assert 'retrysafe_server_events_total{event="stored-late"} 1.0' in text


# ---------------------------------------------------------------------- outbox
class _Endpoint:
    """A real endpoint: 503 for the first request of each key, then 201 (``/gone``: 410,
    ``/down``: always 503)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.traceparents: list[str | None] = []

    async def __call__(self, request: Request) -> Response:
        key = request.headers.get("idempotency-key", "")
        self.traceparents.append(request.headers.get("traceparent"))
        self.seen[key] = self.seen.get(key, 0) + 1
        if request.url.path == "/gone":
            return Response(status_code=410)
        if request.url.path == "/down":
            return Response(status_code=503)
        if self.seen[key] == 1:
            return Response(status_code=503)
        return JSONResponse({"ok": True}, 201)


@pytest.fixture
def endpoint() -> Iterator[tuple[str, _Endpoint]]:
    handler = _Endpoint()

    async def route(request: Request) -> Response:
        return await handler(request)

    app = Starlette(routes=[Route("/{p:path}", route, methods=["POST"])])
    with ServerThread(app) as server:
        yield server.url, handler


def test_worker_attempts_are_counted_by_outcome_and_status_class(
    registry: CollectorRegistry, tmp_path: Path, endpoint: tuple[str, _Endpoint]
) -> None:
    """A 503 then a 201: one retryable 5xx attempt and one success 2xx, the job moved to
    pending then succeeded; the outbox store's operations are timed."""
    url, _ = endpoint
    metrics = Prometheus(registry)
    with Outbox(f"sqlite:///{tmp_path}/o.db", policy=FAST, telemetry=metrics) as outbox:
        outbox.submit(url + "/a", json={"n": 1})
        stats = outbox.worker(budget=None).run_until_idle()
    assert stats.succeeded == 1
    a = "retrysafe_outbox_attempts_total"
    assert value(registry, a, queue="default", outcome="server_error", status_class="5xx") == 1
    assert value(registry, a, queue="default", outcome="success", status_class="2xx") == 1
    t = "retrysafe_outbox_job_transitions_total"
    assert value(registry, t, queue="default", state="pending") == 1
    assert value(registry, t, queue="default", state="succeeded") == 1
    assert (
        value(
            registry,
            "retrysafe_store_operation_duration_seconds_count",
            store="sqlite",
            operation="claim_jobs",
        )
        >= 1
    )


def test_retry_budget_deferrals_are_counted(
    registry: CollectorRegistry, tmp_path: Path, endpoint: tuple[str, _Endpoint]
) -> None:
    """Retries over the per-destination budget are deferred, and each deferral counted."""
    from retrysafe.client import RetryBudget

    url, _ = endpoint
    metrics = Prometheus(registry)
    with Outbox(f"sqlite:///{tmp_path}/o.db", policy=FAST, telemetry=metrics) as outbox:
        for i in range(6):
            outbox.submit(url + "/down", json={"n": i})
        budget = RetryBudget(capacity=1.0, refill_per_second=0.001)
        worker = outbox.worker(budget=budget, concurrency=6)

        def stop_when_deferred() -> None:
            wait_for(
                lambda: (
                    value(registry, "retrysafe_outbox_budget_deferrals_total", queue="default") >= 1
                )
            )
            worker.stop()

        threading.Thread(target=stop_when_deferred, daemon=True).start()
        worker.run(until_idle=False)
    assert worker.stats.deferred >= 1
    assert value(registry, "retrysafe_outbox_budget_deferrals_total", queue="default") == (
        worker.stats.deferred
    )


def test_reconcile_results_are_counted(
    registry: CollectorRegistry, tmp_path: Path, endpoint: tuple[str, _Endpoint]
) -> None:
    """An UNKNOWN job reconciled against an endpoint that now answers 201: one
    ``succeeded`` reconcile result."""
    url, handler = endpoint
    metrics = Prometheus(registry)
    store = SQLiteStore(tmp_path / "o.db")
    with Outbox(store, policy=FAST, telemetry=metrics) as outbox:
        job = outbox.submit(url + "/r", json={})
        handler.seen[job.key] = 1  # its first answer already came (and was lost)
        outbox.store.transition_job(
            job.id,
            state=JobState.UNKNOWN,
            from_states=[JobState.PENDING],
            now=time.time(),
        )
        report = outbox.reconcile()
    store.close()
    assert report.succeeded == 1
    assert (
        value(
            registry, "retrysafe_outbox_reconcile_results_total", queue="default", state="succeeded"
        )
        == 1
    )


# ---------------------------------------------------------------------- the store at scrape time
def test_the_collector_reads_job_states_and_backlog_ages(tmp_path: Path) -> None:
    """Gauges come from the store: jobs by state, and the oldest PENDING and UNKNOWN job's
    age on the collector's clock (a job submitted 120 s before the scrape is 120 s old)."""
    registry = CollectorRegistry()
    store = SQLiteStore(tmp_path / "o.db")
    t0 = 1_800_000_000.0
    with Outbox(store, clock=lambda: t0) as outbox:
        a = outbox.submit("http://127.0.0.1:9/a", json={})
        outbox.submit("http://127.0.0.1:9/b", json={})
        outbox.store.transition_job(
            a.id, state=JobState.UNKNOWN, from_states=[JobState.PENDING], now=t0
        )
    StoreCollector(store, registry=registry, clock=lambda: t0 + 120.0)
    assert value(registry, "retrysafe_store_up", store="sqlite") == 1.0
    jobs = "retrysafe_outbox_jobs"
    assert value(registry, jobs, store="sqlite", queue="default", state="pending") == 1.0
    assert value(registry, jobs, store="sqlite", queue="default", state="unknown") == 1.0
    assert (
        registry.get_sample_value(
            jobs, {"store": "sqlite", "queue": "default", "state": "succeeded"}
        )
        == 0.0
    )
    age = "retrysafe_outbox_oldest_job_age_seconds"
    assert value(registry, age, store="sqlite", queue="default", state="unknown") == pytest.approx(
        120.0
    )
    assert value(registry, age, store="sqlite", queue="default", state="pending") == pytest.approx(
        120.0
    )
    store.close()


def test_an_empty_store_still_reports_the_default_queue(tmp_path: Path) -> None:
    """No jobs at all: the default queue's gauges exist with 0, so an alert never sees an
    absent series."""
    registry = CollectorRegistry()
    store = SQLiteStore(tmp_path / "o.db")
    StoreCollector(store, registry=registry)
    assert (
        registry.get_sample_value(
            "retrysafe_outbox_oldest_job_age_seconds",
            {"store": "sqlite", "queue": "default", "state": "unknown"},
        )
        == 0.0
    )
    store.close()


def test_a_scrape_while_the_store_is_down_answers_with_store_up_0() -> None:
    """The store cannot be reached: the scrape over HTTP still answers 200, with
    ``retrysafe_store_up 0`` and no job gauges (never a 500)."""
    from retrysafe.stores import RedisStore

    registry = CollectorRegistry()
    # Nothing listens on port 1.
    store = RedisStore("redis://127.0.0.1:1/0", check=False, socket_timeout=0.5)
    try:
        with serve_metrics("127.0.0.1", 0, metrics=Prometheus(registry), store=store) as server:
            r = httpx.get(server.url, timeout=10)
    finally:
        store.close()
    assert r.status_code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    assert samples["retrysafe_store_up"] == 0.0
    assert "retrysafe_outbox_jobs" not in samples


def test_a_scrape_of_a_broken_sql_store_answers_with_store_up_0(
    pg_url: str, pg_schema: str
) -> None:
    """PostgreSQL answers but the outbox table is gone (dropped by hand): store_up 0, the
    scrape still answers."""
    import psycopg

    registry = CollectorRegistry()
    store = PostgresStore(pg_url, schema=pg_schema)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{pg_schema}".outbox_jobs CASCADE')
    StoreCollector(store, registry=registry)
    assert value(registry, "retrysafe_store_up", store="postgresql") == 0.0
    store.close()


def test_a_key_store_reports_store_up(redis_url: str, redis_prefix: str) -> None:
    """Redis (a key store): ``retrysafe_store_up{store="redis"} 1`` and no outbox gauges."""
    from retrysafe.stores import RedisStore

    registry = CollectorRegistry()
    store = RedisStore(redis_url, prefix=redis_prefix)
    StoreCollector(store, registry=registry)
    assert value(registry, "retrysafe_store_up", store="redis") == 1.0
    assert (
        registry.get_sample_value(
            "retrysafe_outbox_jobs", {"store": "redis", "queue": "default", "state": "pending"}
        )
        is None
    )
    store.close()


def test_serve_metrics_on_a_port_in_use_raises_and_leaves_nothing_registered() -> None:
    """Binding a taken port raises OSError and unregisters the store collector again."""
    registry = CollectorRegistry()
    with (
        serve_metrics("127.0.0.1", 0, metrics=registry) as first,
        pytest.raises(OSError, match="in use"),
    ):
        serve_metrics("127.0.0.1", first.port, metrics=registry, store="memory://")
    assert registry.get_sample_value("retrysafe_store_up", {"store": "memory"}) is None


# ---------------------------------------------------------------------- webhooks and agents
def test_webhook_deliveries_and_a_gone_endpoint_are_counted(
    registry: CollectorRegistry, tmp_path: Path, endpoint: tuple[str, _Endpoint]
) -> None:
    """Deliveries count by endpoint id and outcome; a 410 disables the endpoint once (counted
    as ``gone`` once, however many of its deliveries see the 410) and the collector shows it
    disabled, its delivery in the dead-letter queue."""
    from retrysafe.webhooks import SVIX, Schedule, WebhookPolicy, Webhooks

    url, _ = endpoint
    metrics = Prometheus(registry)
    store = SQLiteStore(tmp_path / "w.db")
    fast = Schedule(name="default", attempts=4, base=0.01, cap=0.05, jitter=0.001)
    policy = WebhookPolicy(schedules=(fast, SVIX), timeout=2.0, disable_after=None)
    with Webhooks(store, policy=policy, allow_private=True) as hooks:
        ok = hooks.add_endpoint(url + "/ok", event_types=["order.paid"])
        gone = hooks.add_endpoint(url + "/gone", event_types=["order.paid"])
        for i in range(3):  # three deliveries to the gone endpoint: it is disabled once
            hooks.send("order.paid", {"id": i})
        hooks.worker(telemetry=metrics, budget=None, concurrency=8).run_until_idle()
    d = "retrysafe_webhook_deliveries_total"
    assert value(registry, d, endpoint_id=ok.id, outcome="retrying") == 3.0
    assert value(registry, d, endpoint_id=ok.id, outcome="delivered") == 3.0
    assert value(registry, d, endpoint_id=gone.id, outcome="failed") >= 1.0
    assert value(registry, "retrysafe_webhook_endpoints_disabled_total", reason="gone") == 1.0
    scrape = CollectorRegistry()
    StoreCollector(store, registry=scrape)
    assert (
        value(
            scrape, "retrysafe_webhook_endpoints", store="sqlite", state="disabled", reason="gone"
        )
        == 1.0
    )
    assert (
        value(scrape, "retrysafe_webhook_endpoints", store="sqlite", state="enabled", reason="")
        == 1.0
    )
    assert value(scrape, "retrysafe_webhook_dead_letters", store="sqlite") >= 1.0
    store.close()


def test_agent_write_calls_and_budget_refusals_are_counted(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    """A write call executed, the same call replayed from its record, and a call refused by
    the step budget: executed 1, replayed 1, refusals{steps} 1."""
    from retrysafe import BudgetExceededError

    metrics = Prometheus(registry)
    tickets: list[str] = []

    @tool(kind="write", name="create_ticket")
    def create_ticket(title: str) -> str:
        tickets.append(title)
        return f"T-{len(tickets)}"

    store = SQLiteStore(tmp_path / "a.db")
    run = start_run(store, "run-1", max_steps=1, telemetry=metrics)
    with run, run.step(1):
        create_ticket("printer on fire")
    from retrysafe.agents import resume_run

    again = resume_run(store, "run-1", telemetry=metrics)
    with again, again.step(1):
        assert create_ticket("printer on fire") == "T-1"
    with again, again.step(2), pytest.raises(BudgetExceededError):
        create_ticket("second")
    store.close()
    c = "retrysafe_agent_write_calls_total"
    assert value(registry, c, tool="create_ticket", outcome="executed") == 1.0
    assert value(registry, c, tool="create_ticket", outcome="replayed") == 1.0
    assert value(registry, "retrysafe_agent_budget_refusals_total", kind="steps") == 1.0
    assert tickets == ["printer on fire"]


# ---------------------------------------------------------------------- a scrape never stalls
class _StuckKeyStore:
    """A key store whose reads block until released (a store that stopped answering)."""

    url = "memory://stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.reads = 0

    def get(self, key_hash: str) -> None:
        self.reads += 1
        self.release.wait(30)


def test_a_store_that_does_not_answer_is_down_after_the_timeout() -> None:
    """A read that does not return within ``timeout``: the scrape answers store_up 0 after
    the timeout, the next scrape at once without piling a second read on the store, and
    store_up 1 once the store answers again."""
    store = _StuckKeyStore()
    registry = CollectorRegistry()
    StoreCollector(store, registry=registry, timeout=0.2)
    t0 = time.monotonic()
    assert value(registry, "retrysafe_store_up", store="memory") == 0.0
    assert 0.2 <= time.monotonic() - t0 < 5
    t1 = time.monotonic()
    assert value(registry, "retrysafe_store_up", store="memory") == 0.0
    assert time.monotonic() - t1 < 0.2 and store.reads == 1  # no second read started
    store.release.set()
    wait_for(lambda: value(registry, "retrysafe_store_up", store="memory") == 1.0)


def test_a_locked_postgresql_table_does_not_stall_the_scrape(pg_url: str, pg_schema: str) -> None:
    """Another session holds an exclusive lock on the jobs table: the scrape answers within
    its timeout with store_up 0, and with the jobs once the lock is gone."""
    import psycopg

    store = PostgresStore(pg_url, schema=pg_schema)
    registry = CollectorRegistry()
    StoreCollector(store, registry=registry, timeout=0.5)
    with psycopg.connect(pg_url) as locker:
        locker.execute(f'LOCK TABLE "{pg_schema}".outbox_jobs IN ACCESS EXCLUSIVE MODE')
        t0 = time.monotonic()
        assert value(registry, "retrysafe_store_up", store="postgresql") == 0.0
        assert time.monotonic() - t0 < 5
        locker.rollback()
    wait_for(lambda: value(registry, "retrysafe_store_up", store="postgresql") == 1.0)
    store.close()


def test_a_url_of_a_store_that_is_down_at_start_up_is_reported_down(tmp_path: Path) -> None:
    """A collector built while its store is unreachable still builds; scrapes say store_up 0;
    a missing SQLite file is never created by a scrape."""
    registry = CollectorRegistry()
    collector = StoreCollector(
        {"pg": "postgresql://nobody@127.0.0.1:1/none", "file": f"sqlite:///{tmp_path}/no.db"},
        registry=registry,
        timeout=5,
    )
    assert value(registry, "retrysafe_store_up", store="pg") == 0.0
    assert value(registry, "retrysafe_store_up", store="file") == 0.0
    assert not (tmp_path / "no.db").exists()
    collector.close()


def test_a_deleted_sqlite_file_is_not_recreated_by_a_scrape(tmp_path: Path) -> None:
    """The database file is deleted under a running process: a scrape (a new thread's
    connection) reports store_up 0 and does not create an empty file in its place."""
    import os

    path = tmp_path / "o.db"
    store = SQLiteStore(path)
    registry = CollectorRegistry()
    StoreCollector(store, registry=registry)
    os.remove(path)
    assert value(registry, "retrysafe_store_up", store="sqlite") == 0.0
    assert not path.exists()
    store.close()


def test_one_collector_reads_several_stores_and_a_second_one_is_refused(tmp_path: Path) -> None:
    """Two stores in one collector are labelled by name (one valid exposition); a second
    collector on the same registry raises ConfigurationError instead of duplicating series."""
    registry = CollectorRegistry()
    keys, app = SQLiteStore(tmp_path / "k.db"), SQLiteStore(tmp_path / "a.db")
    with Outbox(app) as outbox:
        outbox.submit("http://127.0.0.1:9/x", json={})
    StoreCollector({"keys": keys, "app": app}, registry=registry)
    jobs = "retrysafe_outbox_jobs"
    assert value(registry, jobs, store="app", queue="default", state="pending") == 1.0
    assert value(registry, jobs, store="keys", queue="default", state="pending") == 0.0
    with pytest.raises(ConfigurationError, match="one StoreCollector per registry"):
        StoreCollector(keys, registry=registry)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE retrysafe_store_up gauge") == 1
    keys.close()
    app.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_a_bad_collector_timeout_is_refused(bad: Any, tmp_path: Path) -> None:
    """``timeout`` that is not positive finite seconds: ConfigurationError."""
    with pytest.raises(ConfigurationError):
        StoreCollector(f"sqlite:///{tmp_path}/o.db", timeout=bad)


def test_the_asgi_metrics_app_runs_alone_under_uvicorn_with_its_lifespan(
    registry: CollectorRegistry,
) -> None:
    """``metrics_asgi_app`` as the whole app (uvicorn's lifespan on), and routed at
    ``/metrics`` in a Starlette app: both answer a real scrape."""
    metrics = Prometheus(registry)
    metrics.server_event("client-gone")
    with ServerThread(metrics_asgi_app(metrics), lifespan="on") as alone:
        assert "retrysafe_server_events_total" in httpx.get(alone.url + "/metrics").text
    routed = Starlette(routes=[Route("/metrics", metrics_asgi_app(metrics))])
    with ServerThread(routed) as server:
        r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and "retrysafe_server_events_total" in r.text


def test_an_agent_write_call_with_an_unknown_outcome_is_counted_unknown(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    """A write tool whose every attempt fails retryably ends UNKNOWN: counted ``unknown``
    once, and a repeat that finds it recorded UNKNOWN (not run again) is ``unknown`` too."""
    from retrysafe import OutcomeUnknownError

    metrics = Prometheus(registry)
    sent: list[str] = []

    @tool(kind="write", name="send_email", attempts=2, wait_initial=0.001, wait_max=0.002)
    def send_email(to: str) -> str:
        sent.append(to)
        raise ConnectionError("the answer was lost")

    store = SQLiteStore(tmp_path / "a.db")
    run = start_run(store, "run-u", telemetry=metrics)
    with run, run.step(1), pytest.raises(OutcomeUnknownError):
        send_email("ops@example.com")
    with run, run.step(1), pytest.raises(OutcomeUnknownError):
        send_email("ops@example.com")
    store.close()
    assert sent == ["ops@example.com", "ops@example.com"]  # two attempts, then never again
    c = "retrysafe_agent_write_calls_total"
    assert value(registry, c, tool="send_email", outcome="unknown") == 2.0
    assert value(registry, c, tool="send_email", outcome="executed") == 0.0


def test_several_stores_that_do_not_answer_are_waited_for_once_not_each() -> None:
    """Two stuck stores in one collector: the scrape takes one timeout, not two (they are
    read at once), and reports both down."""
    a, b = _StuckKeyStore(), _StuckKeyStore()
    registry = CollectorRegistry()
    StoreCollector({"a": a, "b": b}, registry=registry, timeout=1.0)
    t0 = time.monotonic()
    text = generate_latest(registry).decode()
    took = time.monotonic() - t0
    a.release.set()
    b.release.set()
    assert 'retrysafe_store_up{store="a"} 0.0' in text
    assert 'retrysafe_store_up{store="b"} 0.0' in text
    assert took < 1.8, took  # one 1 s timeout, not two (margin for a loaded host)


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("410 Gone at attempt 3", "gone"),
        ("50 consecutive failed attempts over 5.0 days", "failures"),
        ("registered disabled", "registered"),
        ("maintenance until Friday", "operator"),
        (None, "operator"),
    ],
)
def test_a_disabled_endpoints_reason_gets_its_label(reason: str | None, label: str) -> None:
    """The ``reason`` label is read back from the reasons the delivery code writes (its
    constants), and anything an operator wrote is ``operator``."""
    from retrysafe.observability._collect import disabled_reason_class
    from retrysafe.webhooks._delivery import FAILURES_REASON, GONE_REASON

    assert (
        GONE_REASON in "410 Gone at attempt 3"
        and FAILURES_REASON in "50 consecutive failed attempts"
    )
    assert disabled_reason_class(reason) == label
