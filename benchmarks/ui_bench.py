"""Console page times on a store of N jobs (issue 15; not a timed test; run it by hand).

Seeds a fresh store (a temporary SQLite file, or a fresh schema on PostgreSQL, dropped at
the end) with ``--jobs`` jobs in a realistic mix -- about 90 % succeeded, 5 % unknown, 3 %
rejected, 2 % pending; queues ``default``, ``billing`` and ``webhooks`` (webhook jobs have
their events and deliveries to five endpoints, one disabled and one failing); destinations
over 20 hosts; about 1.3 attempts per job, started over the last two hours -- by bulk
inserts on the tables (``executemany`` on SQLite, ``COPY`` on PostgreSQL). The store is not
ANALYZEd (a user's store is not), unless ``--analyze``.

Then serves ``console_app(store)`` under a real uvicorn on loopback
(:class:`retrysafe._serving.ServerThread`) and, after a warm-up, times full page renders
with one httpx client, sequentially, in ``--rounds`` interleaved rounds (each round visits
every page once, starting one page further along than the round before): the overview,
the jobs list (first page; filtered to ``unknown``, to ``succeeded``, to one host; and the
page after following "older" 20 times), the dead letters, a job page and the webhook DLQ.

Prints, per page, the median and p95 in ms against the 300 ms limit and their ratio
(median / limit), PASS or MISS; ``--json`` prints the same as JSON. Exit status 0 either way.

    python benchmarks/ui_bench.py --jobs 100000 --rounds 15
    python benchmarks/ui_bench.py --jobs 100000 --rounds 15 \\
        --store postgresql://postgres@127.0.0.1:5432/test

``--explain`` also prints the plan of each statement behind the pages (EXPLAIN QUERY PLAN on
SQLite, EXPLAIN ANALYZE on PostgreSQL) with its own time, measured on a store connection.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int

LIMIT_MS = 300.0
#: How far the deep keyset page is: the page after following "older" this many times.
DEEP_PAGES = 20
QUEUES = (("default", 0.60), ("billing", 0.15), ("webhooks", 0.25))
STATES = (("succeeded", 0.90), ("unknown", 0.05), ("rejected", 0.03), ("pending", 0.02))
HOSTS = [f"host{i}.example" for i in range(20)]
#: Destination weights: a mild skew (host0 is busiest, host19 has a third of its jobs).
HOST_WEIGHTS = [1.0 / (1.0 + 0.1 * i) for i in range(20)]
#: Webhook endpoints: (host, event types, enabled, failure count).
ENDPOINTS: tuple[tuple[str, list[str], bool, int], ...] = (
    ("host0.example", [], True, 0),
    ("host1.example", ["invoice.*"], True, 0),
    ("host2.example", ["customer.*", "invoice.paid"], True, 14),
    ("host3.example", [], False, 0),
    ("host4.example", ["subscription.*"], True, 0),
)
EVENT_TYPES = (
    "invoice.paid",
    "invoice.created",
    "customer.updated",
    "subscription.renewed",
    "subscription.canceled",
)
PATHS = ("/v1/orders", "/v1/refunds", "/api/posts", "/api/notify", "/v2/charges", "/hooks/in")
WINDOW = 7200.0  # attempts started over the last two hours

JOB_COLS = (
    "id, idempotency_key, queue, state, method, url, destination, headers, body, created_at, "
    "updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token, "
    "lease_expires_at, finished_at, last_status, last_outcome, last_error"
)
ATTEMPT_COLS = (
    "job_id, number, idempotency_key, started_at, duration, outcome, status, error_type, "
    "replayed, counted"
)
ENDPOINT_COLS = (
    "id, url, secrets, event_types, description, schedule, rate_limit, enabled, "
    "disabled_reason, failure_count, first_failure_at, created_at, updated_at"
)
EVENT_COLS = "id, event_type, payload, created_at"
DELIVERY_COLS = "job_id, event_id, endpoint_id, created_at"

Row = tuple[Any, ...]


# ---------------------------------------------------------------------- the data
@dataclass
class Data:
    """The rows to insert, per table, and what the pages need to know about them."""

    endpoints: list[Row] = field(default_factory=list)
    events: list[Row] = field(default_factory=list)
    jobs: list[Row] = field(default_factory=list)
    deliveries: list[Row] = field(default_factory=list)
    attempts: list[Row] = field(default_factory=list)
    job_page_id: str = ""
    #: ``(created_at, id)`` of the default queue's jobs, newest first (keyset positions).
    default_keys: list[tuple[float, str]] = field(default_factory=list)
    host7_default: int = 0
    default_jobs: int = 0


def _hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _attempt_plan(rng: random.Random, state: str) -> list[tuple[str, int | None, str | None]]:
    """``(outcome, status, error type)`` of each attempt of a job that ended in ``state``."""
    retryable = [
        ("server_error", 503, None),
        ("server_error", 502, None),
        ("connect_error", None, "ConnectError"),
        ("rate_limited", 429, None),
        ("request_timeout", None, "ReadTimeout"),
    ]
    if state == "succeeded":
        r = rng.random()
        n = 1 if r < 0.80 else 2 if r < 0.97 else 3
        ok = ("success", rng.choice((200, 200, 200, 201, 202)), None)
        return [rng.choice(retryable) for _ in range(n - 1)] + [ok]
    if state == "unknown":
        lost = [("request_timeout", None, "ReadTimeout"), ("transport_error", None, "ReadError")]
        return [rng.choice(lost + retryable[:2]) for _ in range(2)] + [rng.choice(lost)]
    if state == "rejected":
        bad = ("client_error", rng.choice((400, 404, 409, 422, 422)), None)
        return [bad] if rng.random() < 0.8 else [rng.choice(retryable), bad]
    # pending: new (no attempt yet) or waiting for its next one
    return [] if rng.random() < 0.7 else [rng.choice(retryable)]


def _job(
    rng: random.Random,
    data: Data,
    *,
    now: float,
    queue: str,
    state: str,
    url: str,
    destination: str,
    headers: list[list[str]],
    body: bytes,
    key: str,
    job_id: str,
    created: float,
) -> None:
    """One job row and its attempt rows."""
    plan = _attempt_plan(rng, state)
    t = created + rng.uniform(0.002, 0.5)  # a worker's poll
    delay = 0.0
    last: tuple[str, int | None, str | None] | None = None
    for number, (outcome, status, error_type) in enumerate(plan, start=1):
        timed_out = outcome == "request_timeout"
        duration = 10.0 if timed_out else rng.lognormvariate(-2.5, 0.6)
        replayed = number > 1 and outcome == "success" and rng.random() < 0.5
        data.attempts.append(
            (job_id, number, key, t, duration, outcome, status, error_type, replayed, True)
        )
        t += duration
        last = (outcome, status, error_type)
        if number < len(plan):
            delay = min(30.0, 0.5 * 2 ** (number - 1)) * rng.uniform(0.5, 1.0)
            t += delay
    if state == "pending":
        due = created if last is None else t + rng.uniform(1.0, 30.0)
        if due < now - 900.0:  # an old delivery waiting for its endpoint's next slot
            due = now + rng.uniform(0.0, 600.0)
        finished = None
    else:
        due, finished = t, t
    errors = {
        "ReadTimeout": "ReadTimeout: timed out",
        "ReadError": "ReadError: connection reset by peer",
        "ConnectError": "ConnectError: [Errno 111] Connection refused",
    }
    error = None
    if last is not None and last[0] != "success":
        error = errors.get(last[2] or "", f"HTTP {last[1]}")
    data.jobs.append(
        (
            job_id,
            key,
            queue,
            state,
            "POST",
            url,
            destination,
            json.dumps(headers),
            body,
            created,
            max(created, min(t, now)),
            due,
            None,
            len(plan),
            len(plan),
            0,
            delay,
            None,
            None,
            finished,
            None if last is None else last[1],
            None if last is None else last[0],
            error,
        )
    )


def _created(rng: random.Random, now: float, state: str) -> float:
    if state == "pending":  # a backlog of the last few minutes
        return now - rng.uniform(1.0, 900.0)
    return now - rng.uniform(120.0, WINDOW)  # settled: their attempts are all in the past


def make_data(n: int, now: float, seed: int) -> Data:
    """``n`` jobs (webhook deliveries included) and everything around them, deterministic."""
    from retrysafe.webhooks import generate_secret

    rng = random.Random(seed)
    data = Data()
    endpoint_ids = []
    for i, (host, types, enabled, failures) in enumerate(ENDPOINTS):
        ep_id = "ep_" + _hex(rng)
        endpoint_ids.append(ep_id)
        made = now - 86400.0 * (30 - i)
        data.endpoints.append(
            (
                ep_id,
                f"https://{host}/webhooks/retrysafe",
                json.dumps([[generate_secret(), None]]),
                json.dumps(types),
                f"customer endpoint {i}",
                "default",
                None,
                enabled,
                None if enabled else "disabled by the operator: receiver migration",
                failures,
                now - 5400.0 if failures else None,
                made,
                made,
            )
        )
    queue_names = [q for q, _ in QUEUES]
    queue_weights = [w for _, w in QUEUES]
    state_names = [s for s, _ in STATES]
    state_weights = [w for _, w in STATES]
    webhook_jobs = 0
    plain = 0
    for _ in range(n):
        if rng.choices(queue_names, queue_weights)[0] == "webhooks":
            webhook_jobs += 1
        else:
            plain += 1
    # Plain jobs (default and billing) of the outbox.
    for _ in range(plain):
        queue = rng.choices(queue_names[:2], queue_weights[:2])[0]
        state = rng.choices(state_names, state_weights)[0]
        h = rng.choices(range(len(HOSTS)), HOST_WEIGHTS)[0]
        host = HOSTS[h]
        key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        job_id = _hex(rng)
        order = rng.randrange(1, 10**7)
        body = json.dumps(
            {
                "order": order,
                "amount": rng.randrange(100, 100000),
                "currency": "EUR",
                "note": "x" * rng.randrange(20, 300),
            }
        ).encode()
        url = f"https://{host}{rng.choice(PATHS)}/{order}"
        _job(
            rng,
            data,
            now=now,
            queue=queue,
            state=state,
            url=url,
            destination=f"https://{host}:443",
            headers=[["Content-Type", "application/json"], ["X-Tenant", f"t{h % 7}"]],
            body=body,
            key=key,
            job_id=job_id,
            created=_created(rng, now, state),
        )
        if queue == "default":
            data.default_jobs += 1
            data.default_keys.append((data.jobs[-1][9], job_id))
            data.host7_default += host == "host7.example"
            if state == "unknown" and not data.job_page_id:
                data.job_page_id = job_id
    # Webhook deliveries: events fanned out to one to three endpoints.
    made = 0
    while made < webhook_jobs:
        event_id = "msg_" + _hex(rng)
        event_type = rng.choice(EVENT_TYPES)
        payload = json.dumps(
            {"type": event_type, "data": {"id": _hex(rng)[:16], "amount": rng.randrange(10**6)}}
        ).encode()
        state0 = rng.choices(state_names, state_weights)[0]
        at = _created(rng, now, state0)
        data.events.append((event_id, event_type, payload, at))
        fan = min(webhook_jobs - made, rng.choice((1, 1, 2, 3)))
        for ep in rng.sample(range(len(ENDPOINTS)), fan):
            state = state0 if made % fan == 0 else rng.choices(state_names, state_weights)[0]
            host = ENDPOINTS[ep][0]
            job_id = _hex(rng)
            _job(
                rng,
                data,
                now=now,
                queue="webhooks",
                state=state,
                url=f"https://{host}/webhooks/retrysafe",
                destination=f"https://{host}:443",
                headers=[["Content-Type", "application/json"], ["webhook-id", event_id]],
                body=payload,
                key=f"{event_id}:{endpoint_ids[ep]}",
                job_id=job_id,
                created=at,
            )
            data.deliveries.append((job_id, event_id, endpoint_ids[ep], at))
            made += 1
    return data


# ---------------------------------------------------------------------- seeding
def _seed_sqlite(store: Any, data: Data) -> None:
    def insert(conn: Any, table: str, cols: str, rows: list[Row]) -> None:
        marks = ", ".join("?" for _ in cols.split(","))
        conn.executemany(f"INSERT INTO {table} ({cols}) VALUES ({marks})", rows)

    with store.transaction() as conn:
        insert(conn, "webhook_endpoints", ENDPOINT_COLS, data.endpoints)
        insert(conn, "webhook_events", EVENT_COLS, data.events)
        insert(conn, "outbox_jobs", JOB_COLS, data.jobs)
        insert(conn, "webhook_deliveries", DELIVERY_COLS, data.deliveries)
        insert(conn, "outbox_attempts", ATTEMPT_COLS, data.attempts)


def _seed_postgres(store: Any, data: Data) -> None:
    def copy(conn: Any, table: str, cols: str, rows: list[Row]) -> None:
        with conn.cursor() as cur, cur.copy(f"COPY {table} ({cols}) FROM STDIN") as out:
            for row in rows:
                out.write_row(row)

    with store.transaction() as conn:
        copy(conn, "webhook_endpoints", ENDPOINT_COLS, data.endpoints)
        copy(conn, "webhook_events", EVENT_COLS, data.events)
        copy(conn, "outbox_jobs", JOB_COLS, data.jobs)
        copy(conn, "webhook_deliveries", DELIVERY_COLS, data.deliveries)
        copy(conn, "outbox_attempts", ATTEMPT_COLS, data.attempts)


def _analyze(store: Any) -> None:
    with store.transaction() as conn:
        conn.execute("ANALYZE")


@contextmanager
def _store(url: str | None) -> Iterator[Any]:
    """A fresh, empty store: a temporary SQLite file, or a new PostgreSQL schema (dropped)."""
    if url is None:
        from retrysafe import SQLiteStore

        with tempfile.TemporaryDirectory(prefix="ui_bench_") as tmp:
            store: Any = SQLiteStore(Path(tmp) / "console.db")
            try:
                yield store
            finally:
                store.close()
        return
    import psycopg

    from retrysafe.stores import PostgresStore

    schema = f"rs_ui_bench_{uuid.uuid4().hex[:12]}"
    try:
        pg_store: Any = PostgresStore(url, schema=schema)
        try:
            yield pg_store
        finally:
            pg_store.close()
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# ---------------------------------------------------------------------- timing
_NEXT = re.compile(r'<a href="([^"]+)" rel="next"')


def _get(client: Any, path: str) -> tuple[float, str]:
    start = time.perf_counter()
    response = client.get(path)
    text: str = response.text
    ms = (time.perf_counter() - start) * 1000.0
    if response.status_code != 200:
        raise SystemExit(f"GET {path}: {response.status_code}\n{text[:2000]}")
    return ms, text


def _deep_path(client: Any, start: str, follows: int) -> str:
    """The path reached from ``start`` by following the page's "next" link ``follows`` times."""
    path = start
    for n in range(follows):
        _, text = _get(client, path)
        found = _NEXT.search(text)
        if found is None:
            raise SystemExit(f"{path}: no next link after {n} follows (too few jobs?)")
        path = html.unescape(found.group(1))
    return path


def _p95(values: Sequence[float]) -> float:
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def time_pages(base: str, pages: list[tuple[str, str]], rounds: int) -> dict[str, list[float]]:
    """Each page's request times (ms) over ``rounds`` interleaved rounds, after a warm-up."""
    import httpx

    times: dict[str, list[float]] = {name: [] for name, _ in pages}
    with httpx.Client(base_url=base, timeout=60.0) as client:
        deep = _deep_path(client, "/jobs", DEEP_PAGES)
        pages = [(name, deep if path == "<deep>" else path) for name, path in pages]
        for _ in range(2):  # warm-up: templates compiled, statements prepared, caches warm
            for _, path in pages:
                _get(client, path)
        for r in range(rounds):
            turn = r % len(pages)
            for name, path in pages[turn:] + pages[:turn]:
                ms, _ = _get(client, path)
                times[name].append(ms)
    return times


# ---------------------------------------------------------------------- plans
def _statements(data: Data, now: float) -> list[tuple[str, Any, dict[str, Any]]]:
    """The statements behind the pages with the parameters those pages pass."""
    from retrysafe.client._models import JobState
    from retrysafe.client._store import _SQL as OUTBOX_SQL
    from retrysafe.ui._data import _SQL as UI_SQL
    from retrysafe.ui._data import DEAD_LETTER_STATES, JobFilter, Position, page_jobs

    def jobs_params(f: JobFilter, after: Position | None = None) -> dict[str, Any]:
        gen = page_jobs(None, f, limit=51, after=after)
        request = next(gen)
        gen.close()
        return dict(request.params)

    dlq = json.dumps([s.value for s in DEAD_LETTER_STATES])
    keys = sorted(data.default_keys, reverse=True)
    deep = Position(*keys[50 * DEEP_PAGES - 1])
    deeper = Position(*keys[len(keys) * 9 // 10])
    return [
        ("overview, jobs, dead letters: job_stats", OUTBOX_SQL["job_stats"], {}),
        (
            "overview: attempt_buckets",
            UI_SQL["attempt_buckets"],
            {"since": now - 3600.0, "width": 300.0},
        ),
        ("jobs: page_jobs", UI_SQL["page_jobs"], jobs_params(JobFilter())),
        (
            "jobs ?state=unknown: page_jobs",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(states=(JobState.UNKNOWN,))),
        ),
        (
            "jobs ?state=succeeded: page_jobs",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(states=(JobState.SUCCEEDED,))),
        ),
        (
            "jobs ?host=host7.example: page_jobs",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(host="host7.example")),
        ),
        (
            f"jobs, page {DEEP_PAGES + 1}: page_jobs after {DEEP_PAGES * 50} rows",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(), deep),
        ),
        (
            f"jobs, a page after {len(keys) * 9 // 10:,} rows: page_jobs (not timed as a page)",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(), deeper),
        ),
        (
            "dead letters: page_jobs",
            UI_SQL["page_jobs"],
            jobs_params(JobFilter(states=DEAD_LETTER_STATES)),
        ),
        (
            "webhook DLQ: page_deliveries",
            UI_SQL["page_deliveries"],
            {"endpoint_id": None, "states": dlq, "after_at": None, "after_id": None, "limit": 51},
        ),
    ]


def _median_ms(fn: Any, times: int = 5) -> float:
    values = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        values.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(values)


def _plan_postgres(store: Any, sql: bytes, params: dict[str, Any]) -> tuple[float, list[str]]:
    with store.transaction() as conn:
        ms = _median_ms(lambda: conn.execute(sql, params).fetchall())
        rows = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS) " + sql, params).fetchall()
    return ms, [str(r[0]) for r in rows]


def _plan_sqlite(store: Any, sql: str, params: dict[str, Any]) -> tuple[float, list[str]]:
    ms = _median_ms(lambda: store.run(lambda conn: conn.execute(sql, params).fetchall()))
    rows = store.run(lambda conn: conn.execute("EXPLAIN QUERY PLAN " + sql, params).fetchall())
    return ms, [f"{'  ' * _depth(rows, r)}{r[3]}" for r in rows]


def explain(store: Any, data: Data, now: float, postgres: bool) -> list[dict[str, Any]]:
    """Each statement's plan and its own median time (ms, 5 runs) on a store connection."""
    out = []
    for label, statement, params in _statements(data, now):
        if postgres:
            ms, plan = _plan_postgres(store, statement.parts["postgres"][0], params)
        else:
            ms, plan = _plan_sqlite(store, statement.parts["sqlite"][0], params)
        out.append({"statement": label, "ms": round(ms, 2), "plan": plan})
    return out


def _depth(rows: Sequence[Row], row: Row) -> int:
    """A row's depth in EXPLAIN QUERY PLAN's tree (id, parent, notused, detail)."""
    parents = {r[0]: r[1] for r in rows}
    depth, at = 0, row[1]
    while at in parents:
        depth, at = depth + 1, parents[at]
    return depth


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--jobs", type=positive_int, default=100_000)
    parser.add_argument(
        "--store",
        default="sqlite",
        metavar="sqlite|URL",
        help="sqlite (default: a temporary file) or postgresql://… (a fresh schema, dropped)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=15, help="interleaved rounds (default 15)"
    )
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--analyze", action="store_true", help="ANALYZE after seeding")
    parser.add_argument("--explain", action="store_true", help="print the statements' plans")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    url: str | None = None
    if args.store != "sqlite":
        if not args.store.startswith(("postgresql://", "postgres://")):
            parser.error("--store must be sqlite or a postgresql:// URL")
        url = args.store
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.jobs < 51 * (DEEP_PAGES + 1) * 2:
        parser.error(f"--jobs must be at least {51 * (DEEP_PAGES + 1) * 2} (the deep page)")
    import logging

    logging.getLogger("retrysafe").setLevel(logging.WARNING)
    from retrysafe._serving import ServerThread
    from retrysafe.ui import console_app

    now = time.time()
    start = time.perf_counter()
    data = make_data(args.jobs, now, args.seed)
    made_s = time.perf_counter() - start
    with _store(url) as store:
        start = time.perf_counter()
        (_seed_postgres if url else _seed_sqlite)(store, data)
        seed_s = time.perf_counter() - start
        if args.analyze:
            _analyze(store)
        pages = [
            ("overview /", "/"),
            ("jobs /jobs", "/jobs"),
            ("jobs ?state=unknown", "/jobs?state=unknown"),
            ("jobs ?state=succeeded", "/jobs?state=succeeded"),
            ("jobs ?host=host7.example", "/jobs?host=host7.example"),
            (f"jobs, page {DEEP_PAGES + 1} (keyset)", "<deep>"),
            ("dead letters", "/dead-letters"),
            ("job page", f"/jobs/{data.job_page_id}"),
            ("webhooks dead letters", "/webhooks/dead-letters"),
        ]
        with ServerThread(console_app(store)) as server:
            times = time_pages(server.url, pages, args.rounds)
        plans = explain(store, data, now, url is not None) if args.explain else []
        autovacuum = None
        if url is not None:
            with store.transaction() as conn:
                autovacuum = conn.execute("SHOW autovacuum").fetchone()[0]
    results: list[dict[str, Any]] = []
    for name, _ in pages:
        med, p95 = statistics.median(times[name]), _p95(times[name])
        results.append(
            {
                "page": name,
                "median_ms": round(med, 1),
                "p95_ms": round(p95, 1),
                "limit_ms": LIMIT_MS,
                "ratio": round(med / LIMIT_MS, 3),
                "verdict": "PASS" if med < LIMIT_MS else "MISS",
                "rounds_ms": [round(t, 1) for t in times[name]],
            }
        )
    where = "SQLite (temporary file)" if url is None else "PostgreSQL (fresh schema)"
    setup = {
        "store": where,
        "jobs": len(data.jobs),
        "attempts": len(data.attempts),
        "attempts_per_job": round(len(data.attempts) / len(data.jobs), 2),
        "webhook_deliveries": len(data.deliveries),
        "default_queue_jobs": data.default_jobs,
        "host7_share_of_default": round(data.host7_default / max(1, data.default_jobs), 3),
        "analyzed": bool(args.analyze),
        "autovacuum": autovacuum,
        "generate_s": round(made_s, 1),
        "seed_s": round(seed_s, 1),
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps({"setup": setup, "pages": results, "plans": plans}, indent=2))
        return 0
    print(
        f"{where}: {setup['jobs']:,} jobs, {setup['attempts']:,} attempts "
        f"({setup['attempts_per_job']}/job), {setup['webhook_deliveries']:,} webhook deliveries; "
        f"seeded in {seed_s:.1f} s; ANALYZE: {'yes' if args.analyze else 'no'}"
        + (f"; autovacuum: {autovacuum}" if autovacuum is not None else "")
    )
    print(
        f"rounds={args.rounds} cpus={os.cpu_count()}; default queue {data.default_jobs:,} jobs, "
        f"host7.example {setup['host7_share_of_default']:.1%} of them"
    )
    print(f"{'page':<28} {'median ms':>10} {'p95 ms':>8} {'limit ms':>9} {'ratio':>6}  verdict")
    for r in results:
        print(
            f"{r['page']:<28} {r['median_ms']:>10.1f} {r['p95_ms']:>8.1f} {LIMIT_MS:>9.0f} "
            f"{r['ratio']:>6.2f}  {r['verdict']}"
        )
    missed = [r["page"] for r in results if r["verdict"] == "MISS"]
    print(
        f"target: every page's median under {LIMIT_MS:.0f} ms: "
        + ("met" if not missed else "MISSED by " + ", ".join(missed))
    )
    for p in plans:
        print(f"\n-- {p['statement']}: {p['ms']:.1f} ms (median of 5, on a store connection)")
        for line in p["plan"]:
            print(f"   {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
