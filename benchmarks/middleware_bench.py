"""Requests/s of a trivial JSON POST endpoint under uvicorn, with and without idempotency.

Variants, each served by one uvicorn process (one core) and loaded by wrk (the other core):

  (a) no middleware                                   -- the baseline
  (b) retrysafe IdempotencyMiddleware, SQLite, a new key per request
  (c) retrysafe IdempotencyMiddleware, SQLite, replays of 100 completed keys
  (d) fastapi-idempotency-key 0.1.1, SQLiteBackend, a new key per request
  (e) retrysafe IdempotencyMiddleware, PostgreSQL, a new key per request
  (f) retrysafe IdempotencyMiddleware, Redis, a new key per request
  (g) fastapi-idempotency-key 0.1.1, RedisBackend, a new key per request
  (h) as (b) with lease renewal switched off      -- what the heartbeat costs: (b) vs (h)
  (i) as (f) on redis-py's asyncio client         -- what the lean Redis transport gives: (f) vs (i)
  (j) as (e) without group commit                 -- what group commit gives: (e) vs (j)
  (k) as (b) with Prometheus metrics on           -- what telemetry costs: (b) vs (k)

Each (e)/(j) run gets a fresh PostgreSQL schema and each (f)/(g)/(i) run a unique Redis key prefix,
removed after the run. ``--postgres`` / ``--redis`` name the servers (defaults: the
``RETRYSAFE_TEST_POSTGRES`` / ``RETRYSAFE_TEST_REDIS`` environment variables, else
``postgresql://postgres@127.0.0.1:5432/test`` and ``redis://127.0.0.1:6379/0``).

Rounds are interleaved (a b c d a b c d …) so machine noise hits every variant alike; the
medians and their ratios to (a) are printed. This is a benchmark, not a test: run it by hand.

Needs wrk (Debian: ``apt-get install -y wrk``) and the bench extra
(``pip install -e '.[bench]'``).

    python benchmarks/middleware_bench.py --duration 10 --rounds 3
    python benchmarks/middleware_bench.py --variants aefg --rounds 3 --duration 6
    python benchmarks/middleware_bench.py --variants abh --rounds 5 --duration 6
    python benchmarks/middleware_bench.py --variants afi --rounds 3 --duration 6
    python benchmarks/middleware_bench.py --variants abk --rounds 5 --duration 6

The apps are imported from this checkout (its ``src`` comes first on the servers' path), so a
copy of the tree benchmarks itself, whatever is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run as a script
from benchmarks._args import positive_int, positive_seconds  # noqa: E402

VARIANTS = {
    "a": ("baseline", "none", "no middleware"),
    "b": ("retrysafe_sqlite", "first", "retrysafe, SQLite, first-time keys"),
    "c": ("retrysafe_sqlite", "replay", "retrysafe, SQLite, replays"),
    "d": ("competitor_sqlite", "first", "fastapi-idempotency-key, SQLite, first-time keys"),
    "e": ("retrysafe_postgres", "first", "retrysafe, PostgreSQL, first-time keys"),
    "f": ("retrysafe_redis", "first", "retrysafe, Redis, first-time keys"),
    "g": ("competitor_redis", "first", "fastapi-idempotency-key, Redis, first-time keys"),
    "h": ("retrysafe_sqlite_no_heartbeat", "first", "retrysafe, SQLite, first-time, no heartbeat"),
    "i": ("retrysafe_redis_py", "first", "retrysafe, Redis via redis-py, first-time keys"),
    "j": ("retrysafe_postgres_unbatched", "first", "retrysafe, PostgreSQL, no group commit"),
    "k": ("retrysafe_sqlite_metrics", "first", "retrysafe, SQLite, first-time, metrics on"),
}
TARGETS = {"b": ("a", 0.7), "c": ("a", 0.9), "e": ("a", 0.35), "f": ("a", 0.65)}
# (variant, other variant, minimum ratio) between two middlewares on the same store
HEAD_TO_HEAD = [("b", "d", 4.0), ("f", "g", 1.5), ("b", "h", 0.97), ("k", "b", 0.95)]
PG_URL = os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RETRYSAFE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("server did not start")


@contextmanager
def store_namespace(code: str, pg_url: str, redis_url: str) -> Iterator[dict[str, str]]:
    """A fresh PostgreSQL schema or Redis prefix for one run (environment for the app),
    removed afterwards."""
    tag = uuid.uuid4().hex[:12]
    if code in ("e", "j"):
        import psycopg

        schema = f"rs_bench_{tag}"
        try:
            yield {"BENCH_PG_URL": pg_url, "BENCH_PG_SCHEMA": schema}
        finally:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    elif code in ("f", "g", "i"):
        import redis

        prefix = f"rs-bench:{tag}:"
        try:
            yield {"BENCH_REDIS_URL": redis_url, "BENCH_REDIS_PREFIX": prefix}
        finally:
            client = redis.Redis.from_url(redis_url)
            batch: list[bytes] = []
            for key in client.scan_iter(match=prefix + "*", count=5000):
                batch.append(key)
                if len(batch) >= 5000:
                    client.unlink(*batch)
                    batch.clear()
            if batch:
                client.unlink(*batch)
            client.close()
    else:
        yield {}


def run_variant(
    code: str, duration: float, connections: int, workdir: Path, store_env: dict[str, str]
) -> float:
    factory, mode, _ = VARIANTS[code]
    port = free_port()
    db = workdir / f"{code}-{uuid.uuid4().hex[:8]}.db"
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = dict(os.environ, BENCH_DB=str(db), PYTHONPATH=path, **store_env)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            f"benchmarks._apps:{factory}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--lifespan",
            "off",
            # asyncio's own loop, as in every earlier run of this benchmark: uvicorn would
            # take uvloop where it is installed (the test extras install it).
            "--loop",
            "asyncio",
        ],
        env=env,
        cwd=ROOT,
    )
    try:
        wait_listening(port, proc)
        url = f"http://127.0.0.1:{port}"
        prefix = uuid.uuid4().hex[:12]
        body = {"title": "hello", "text": "a trivial post for the benchmark"}
        with httpx.Client(base_url=url, timeout=10) as client:
            # warm up imports and connections; for replays, complete the 100 keys first
            for i in range(100):
                headers = {"Idempotency-Key": f"{prefix}-replay-{i}"} if mode == "replay" else {}
                r = client.post("/posts", json=body, headers=headers)
                if r.status_code >= 300:
                    raise SystemExit(f"warm-up got {r.status_code}: {r.text[:200]}")
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{connections}",
                f"-d{int(duration)}s",
                "-s",
                str(HERE / "_wrk.lua"),
                url,
            ],
            env=dict(os.environ, BENCH_MODE=mode, BENCH_PREFIX=prefix),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        errors = re.search(r"Socket errors: (.*)", out)
        if bad or errors:
            found = " ".join(m.group(0) for m in (bad, errors) if m)
            print(f"  warning: {code}: {found}", file=sys.stderr)
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        return rps
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=positive_seconds, default=10, help="seconds per wrk run"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds per variant"
    )
    parser.add_argument("--connections", type=positive_int, default=32)
    parser.add_argument("--variants", default="abcd")
    parser.add_argument(
        "--json", action="store_true", help="print only the result, as JSON (progress on stderr)"
    )
    parser.add_argument("--postgres", default=PG_URL, help="PostgreSQL URL for (e) and (j)")
    parser.add_argument("--redis", default=REDIS_URL, help="Redis URL for (f), (g) and (i)")
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if not args.variants or unknown:
        parser.error(
            f"--variants takes letters of {''.join(VARIANTS)}"
            + (f", not {''.join(unknown)!r}" if unknown else "")
        )
    if len(set(args.variants)) != len(args.variants):
        parser.error("--variants names a variant twice")
    out = sys.stderr if args.json else sys.stdout
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    results: dict[str, list[float]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for code in args.variants:
                with store_namespace(code, args.postgres, args.redis) as store_env:
                    rps = run_variant(code, args.duration, args.connections, Path(tmp), store_env)
                results[code].append(rps)
                line = f"round {r + 1} ({code}) {VARIANTS[code][2]}: {rps:,.0f} req/s"
                print(line, file=out, flush=True)
    med = {code: statistics.median(v) for code, v in results.items()}
    print(file=out)
    print(f"{'variant':<56} {'median req/s':>13} {'vs (a)':>8}", file=out)
    for code in args.variants:
        ratio = med[code] / med["a"] if "a" in med else float("nan")
        print(f"({code}) {VARIANTS[code][2]:<52} {med[code]:>13,.0f} {ratio:>8.2f}", file=out)
    print(file=out)
    for ours, theirs, _ in HEAD_TO_HEAD:
        if ours in med and theirs in med:
            print(
                f"({ours})/({theirs}) {VARIANTS[ours][2]} vs {VARIANTS[theirs][2]}: "
                f"{med[ours] / med[theirs]:.2f}x",
                file=out,
            )
    for code, (base, target) in TARGETS.items():
        if code in med and base in med:
            ratio = med[code] / med[base]
            verdict = "met" if ratio >= target else "MISSED"
            print(f"target ({code}) >= {target} x ({base}): {ratio:.3f} {verdict}", file=out)
    for ours, theirs, target in HEAD_TO_HEAD:
        if ours in med and theirs in med:
            ratio = med[ours] / med[theirs]
            verdict = "met" if ratio >= target else "MISSED"
            print(f"target ({ours}) >= {target:g} x ({theirs}): {ratio:.3f} {verdict}", file=out)
    if args.json:
        print(json.dumps({"medians": med, "runs": results}))


if __name__ == "__main__":
    main()
