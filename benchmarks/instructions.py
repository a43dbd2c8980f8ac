"""Instructions per operation, a baseline revision beside this tree (not a timed test).

On a shared, noisy machine a throughput benchmark moves ±15 % between runs; the number of
instructions a path executes does not. This runs each case under ``valgrind --tool=callgrind``
twice, with N and 5·N operations, so start-up cancels out: (I(5N) − I(N)) / 4N is the cost of
one operation. The baseline is another revision of this repository (``git archive`` into a
temporary directory), run by the same interpreter with its ``src`` first on ``sys.path``.

Cases (each on a fresh SQLite file, in one process, no sockets):

``first-key``  the idempotency middleware, a first-time key per request, 32 requests in
               flight on one event loop (the ASGI app answers 201 at once);
``submit``     ``Outbox.submit`` of a small JSON job, all in one transaction;
``send``       ``Webhooks.send`` of a small event to one endpoint;
``deliver``    the outbox worker delivering jobs (claim, send, record) at concurrency 32, to
               an ``httpx.MockTransport`` answering 201 (the submits counted too);
``deliver-webhooks``  the webhook worker delivering events to 10 endpoints the same way
               (signed, the endpoint read before each attempt; the sends counted).
``engine``     the outbox's default HTTP engine (aiohttp, as ``make_engine`` builds it for a
               policy) sending small JSON POSTs at concurrency 32, each under the attempt's
               total timeout as the worker sends, to a real loopback endpoint (a uvicorn
               child process started here, outside valgrind). The one case with sockets:
               its counts move by about 1 % between runs.

Kernel time (system calls, page faults) is not counted: compare the figures with the
throughput benchmarks, which count everything.

    python benchmarks/instructions.py --baseline 423218d

Needs valgrind (Debian: ``apt-get install -y valgrind``). Takes a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: One case: Python code run with ``N`` bound; it does N operations after a warm-up.
CASES = {
    "first-key": """
import asyncio, tempfile
from pathlib import Path
from retrysafe import IdempotencyMiddleware, SQLiteStore

async def app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})

async def drive(app, n, tag):
    async def receive():
        return {"type": "http.request", "body": b'{"amount":100}', "more_body": False}
    async def send(message):
        return None
    numbers = iter(range(n))
    async def client():
        for i in numbers:
            scope = {"type": "http", "method": "POST", "path": "/charge", "query_string": b"",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"idempotency-key", f"{tag}-{i}".encode())]}
            await app(scope, receive, send)
            await asyncio.sleep(0)
    await asyncio.gather(*(client() for _ in range(32)))

with tempfile.TemporaryDirectory() as d:
    store = SQLiteStore(Path(d) / "keys.db")
    middleware = IdempotencyMiddleware(app, store)
    asyncio.run(drive(middleware, 200, "warm"))
    asyncio.run(drive(middleware, N, "run"))
    store.close()
""",
    "submit": """
import tempfile
from pathlib import Path
from retrysafe import Outbox, SQLiteStore

with tempfile.TemporaryDirectory() as d:
    with SQLiteStore(Path(d) / "outbox.db") as store, Outbox(store) as outbox:
        with store.transaction() as conn:
            for i in range(N):
                outbox.submit("http://127.0.0.1:9/jobs", json={"n": i}, connection=conn)
""",
    "send": """
import tempfile
from pathlib import Path
from retrysafe.webhooks import Webhooks

with tempfile.TemporaryDirectory() as d:
    with Webhooks(f"sqlite:///{d}/hooks.db", allow_private=True) as hooks:
        hooks.add_endpoint("http://127.0.0.1:9/hook", event_types=["bench"])
        for i in range(N):
            hooks.send("bench", {"n": i})
""",
    "deliver": """
import tempfile
from pathlib import Path
import httpx
from retrysafe import Outbox, SQLiteStore

def answer(request):
    return httpx.Response(201, json={"ok": True})

def deliver(outbox, n, conn_store):
    with conn_store.transaction() as conn:
        for i in range(n):
            outbox.submit("http://127.0.0.1:9/jobs", json={"n": i}, connection=conn)
    stats = outbox.worker(
        concurrency=32, poll_interval=0.01, transport=httpx.MockTransport(answer)
    ).run_until_idle()
    assert stats.succeeded == n, stats

with tempfile.TemporaryDirectory() as d:
    with SQLiteStore(Path(d) / "outbox.db") as store, Outbox(store) as outbox:
        deliver(outbox, 100, store)
        deliver(outbox, N, store)
""",
    "deliver-webhooks": """
import httpx
from retrysafe.webhooks import Webhooks
import tempfile

def answer(request):
    return httpx.Response(204)

def deliver(hooks, n):
    for i in range(n):
        hooks.send(f"bench.{i % 10}", {"n": i})
    stats = hooks.worker(
        concurrency=32, poll_interval=0.01, transport=httpx.MockTransport(answer)
    ).run_until_idle()
    assert stats.succeeded == n, stats

with tempfile.TemporaryDirectory() as d:
    with Webhooks(f"sqlite:///{d}/hooks.db", allow_private=True) as hooks:
        for e in range(10):
            hooks.add_endpoint(f"http://127.0.0.1:9/ep{e}", event_types=[f"bench.{e}"])
        deliver(hooks, 100)
        deliver(hooks, N)
""",
    "engine": """
import asyncio, json, os
from retrysafe import RetryPolicy
from retrysafe._wire import total_timeout
from retrysafe.client._sender import make_engine

URL = os.environ["BENCH_URL"] + "/jobs"

async def sends(n):
    engine = make_engine(RetryPolicy(timeout=10.0), max_connections=32)
    body = json.dumps({"n": 0}).encode()
    headers = [("content-type", "application/json"), ("Idempotency-Key", "k")]
    left = [n]

    async def one():
        while left[0] > 0:
            left[0] -= 1
            async with total_timeout(10.0):
                answer = await engine.send("POST", URL, headers=headers, body=body, keep=65536)
            assert answer.status == 201, answer.status

    await asyncio.gather(*(one() for _ in range(32)))
    await engine.aclose()

asyncio.run(sends(100))
asyncio.run(sends(N))
""",
}
#: Operations of the small run of each case (the large one does five times as many).
SIZES = {
    "first-key": 1000,
    "submit": 500,
    "send": 300,
    "deliver": 300,
    "deliver-webhooks": 300,
    "engine": 300,
}


def _instructions(src: Path, code: str, n: int) -> int:
    """Instructions callgrind counts for ``code`` with ``N = n`` on ``src``'s retrysafe."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "callgrind.out"
        run = subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                os.path.realpath(sys.executable), "-c", f"N = {n}\n{code}",
            ],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        found = re.search(r"Collected\s*:\s*(\d+)", run.stderr)
        if run.returncode != 0 or found is None:
            raise SystemExit(f"valgrind failed ({run.returncode}): {run.stderr[-800:]}")
        return int(found.group(1))


def per_operation(src: Path, case: str) -> float:
    """Instructions of one operation of ``case`` on ``src`` (start-up cancelled out)."""
    n = SIZES[case]
    small = _instructions(src, CASES[case], n)
    large = _instructions(src, CASES[case], 5 * n)
    return (large - small) / (4 * n)


def run_on(src: Path, code: str, *args: str) -> Any:
    """Run ``code`` (``python -c``, with ``args``) on the ``src`` tree first on the path; the
    JSON of its last line of output.

    Raises:
        SystemExit: the run failed (its status and the end of its error output).
    """
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise SystemExit(f"the run on {src} failed ({run.returncode}): {run.stderr[-800:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_revision(parser: argparse.ArgumentParser, revision: str) -> None:
    """A usage error (exit 2) unless ``revision`` names a commit of this repository."""
    known = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", revision + "^{commit}"],
        capture_output=True,
    )
    if known.returncode != 0:
        parser.error(f"--baseline {revision!r} names no commit of this repository")


def _baseline_tree(revision: str, into: Path) -> Path:
    """``git archive`` of ``revision``'s ``src`` into ``into``; returns that ``src``."""
    archive = into / "baseline.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--output", str(archive), revision, "src"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision to compare with")
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}"
    )
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (Debian: apt-get install -y valgrind)")
    check_revision(parser, args.baseline)
    with contextlib.ExitStack() as stack:
        if "engine" in cases:
            sys.path.insert(0, str(ROOT))  # run as a script
            from benchmarks._wire import endpoint

            os.environ["BENCH_URL"] = stack.enter_context(endpoint(201))
        _compare(args.baseline, cases)
    return 0


def _compare(baseline: str, cases: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        base = _baseline_tree(baseline, Path(d))
        print(f"instructions per operation, {baseline} vs this tree (callgrind)")
        print(f"{'case':<10} {'baseline':>12} {'this tree':>12} {'ratio':>7}")
        for case in cases:
            before = per_operation(base, case)
            after = per_operation(ROOT / "src", case)
            print(f"{case:<10} {before:>12,.0f} {after:>12,.0f} {after / before:>7.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
