"""Several ``retrysafe webhooks worker`` processes on one store through the chaos proxy, one
SIGKILLed (SPEC §6, §9): every webhook-id is processed exactly once by its receiver.

1. A fresh store: a new PostgreSQL database (``CREATE DATABASE``, dropped at the end), or a new
   SQLite file (``--store sqlite``).
2. Ten receiving endpoints (``/hook/0`` … ``/hook/9``, each with its own secret) in one ASGI
   app on loopback. Each verifies the Standard Webhooks signature and deduplicates by
   ``webhook-id`` with :class:`~retrysafe.webhooks.WebhookVerifier` on a key store of its own
   (PostgreSQL schema ``receiver``, or a second SQLite file); its handler counts one effect
   per call in an :class:`~retrysafe.chaos.EffectLedger`, keyed by webhook-id. Duplicates the
   receiver acknowledged without running the handler are counted apart.
3. :class:`~retrysafe.chaos.ChaosProxy` in front: 2.5 % of answers lost after the receiver
   committed, plus small rates of 503 after commit, resets and 503 before forwarding, and
   latency.
4. ``--events`` events sent (``Webhooks.send``: one transaction each for the event, its
   delivery job and the delivery row), spread over the ten endpoints by event type; then
   ``--workers`` ``retrysafe webhooks worker --store … --until-idle`` processes. Once a third of
   the events have had their effect the first worker is SIGKILLed: its leased deliveries are
   taken over by the others when their leases (10 s) expire.

Prints events/s, the delivered count, duplicated effects, lost events (no effect) and the
receivers' dedupe count: a summary on stderr, one JSON line on stdout. Exit status 0 only when
every event had exactly one effect.

    python benchmarks/webhooks_workers.py --store postgresql --events 10000 --workers 4
    python benchmarks/webhooks_workers.py --store sqlite --events 10000 --workers 4
    python benchmarks/webhooks_workers.py --compare --events 10000   # both, and the ratio

PostgreSQL: ``--pg`` (default ``RETRYSAFE_TEST_POSTGRES`` or
``postgresql://postgres@127.0.0.1:5432/test``), a role allowed to create databases.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from retrysafe import WebhookVerificationError
from retrysafe._serving import ServerThread
from retrysafe.chaos import ChaosProxy, EffectLedger, FaultRates
from retrysafe.stores import PostgresStore, SQLiteStore
from retrysafe.webhooks import Webhooks, WebhookVerifier, generate_secret

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_float, positive_int

DEFAULT_PG = os.environ.get("RETRYSAFE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
ENDPOINTS = 10
RATES = FaultRates(
    lose_after_commit=0.025,
    error_after_commit=0.005,
    reset_before_forward=0.005,
    error_before_forward=0.005,
    latency=0.02,
    latency_seconds=(0.01, 0.05),
)
_Message = MutableMapping[str, Any]


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def fresh_database(pg_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``pg_url``; its URL. Dropped afterwards."""
    import psycopg

    name = f"rs_webhooks_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield urlsplit(pg_url)._replace(path="/" + name).geturl()
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Receivers:
    """Ten verifying, deduplicating webhook endpoints in one ASGI app."""

    def __init__(self, secrets: list[str], dedupe: Any) -> None:
        self.ledger = EffectLedger()
        self.duplicates = 0
        self.rejected = 0
        self._verifiers = [WebhookVerifier(s, store=dedupe) for s in secrets]

    async def __call__(
        self,
        scope: _Message,
        receive: Callable[[], Awaitable[_Message]],
        send: Callable[[_Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        index = int(scope["path"].rsplit("/", 1)[-1])
        webhook_id = headers.get("webhook-id", "")

        async def handle(payload: Any) -> None:
            self.ledger.record(webhook_id)

        try:
            receipt = await self._verifiers[index].areceive(headers, body, handle)
        except WebhookVerificationError:
            self.rejected += 1
            status = 401
        else:
            if receipt.duplicate:
                self.duplicates += 1
            status = 409 if receipt.in_progress else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _start_worker(store_url: str, args: argparse.Namespace, log: TextIO) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "retrysafe",
        "webhooks",
        "worker",
        "--store",
        store_url,
        "--until-idle",
        "--allow-private",
        "-c",
        str(args.concurrency),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def run(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """One run on ``kind`` (``postgresql`` or ``sqlite``); the figures as a dict."""
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        if kind == "postgresql":
            db_url = stack.enter_context(fresh_database(args.pg))
            store_url = db_url
            dedupe: Any = PostgresStore(db_url, schema="receiver")
        else:
            store_url = f"sqlite:///{tmp / 'webhooks.db'}"
            dedupe = SQLiteStore(tmp / "receiver.db")
        stack.callback(dedupe.close)
        secrets = [generate_secret() for _ in range(ENDPOINTS)]
        receivers = Receivers(secrets, dedupe)
        server = stack.enter_context(ServerThread(receivers))
        proxy = stack.enter_context(ChaosProxy(server.url, rates=RATES, seed=args.seed))
        webhooks = stack.enter_context(Webhooks(store_url, allow_private=True))
        for i, secret in enumerate(secrets):
            webhooks.add_endpoint(
                f"{proxy.url}/hook/{i}", secret=secret, event_types=[f"bench.{i}"]
            )
        sent_started = time.monotonic()
        ids = []
        for n in range(args.events):
            event = webhooks.send(f"bench.{n % ENDPOINTS}", {"n": n})
            ids.append(event.id)
        sent = time.monotonic() - sent_started
        # One event to one endpoint: its deliveries' webhook-id is the event id.
        _say(f"{kind}: {args.events} events sent in {sent:.1f} s; {args.workers} workers")
        logs = [(tmp / f"worker-{n}.log").open("w") for n in range(args.workers)]
        started = time.monotonic()
        workers = [_start_worker(store_url, args, log) for log in logs]
        killed: int | None = None
        kill_at = args.events // 3
        deadline = started + args.max_seconds
        while any(w.poll() is None for w in workers):
            if killed is None and receivers.ledger.total() >= kill_at:
                workers[0].send_signal(signal.SIGKILL)
                killed = workers[0].pid
                _say(f"SIGKILLed worker {killed} after {receivers.ledger.total()} effects")
            if time.monotonic() > deadline:
                for w in workers:
                    w.kill()
                raise SystemExit(f"workers still running after {args.max_seconds} s")
            time.sleep(0.02)
        delivered = time.monotonic() - started
        exit_codes = [w.returncode for w in workers]
        for log in logs:
            log.close()
        for n, code in enumerate(exit_codes):
            if n > 0 and code != 0:
                _say(f"worker {n} failed:\n{(tmp / f'worker-{n}.log').read_text()[-2000:]}")
        dead = len(webhooks.dead_letters())
        faults = proxy.stats().to_dict()
    counts = receivers.ledger.counts()
    duplicated = sum(max(0, counts.get(i, 0) - 1) for i in ids)
    lost = sum(1 for i in ids if counts.get(i, 0) == 0)
    return {
        "store": kind,
        "events": args.events,
        "workers": args.workers,
        "killed_worker": killed,
        "worker_exit_codes": exit_codes,
        "send_seconds": round(sent, 2),
        "deliver_seconds": round(delivered, 2),
        "events_per_second": round(args.events / delivered, 1),
        "effects": receivers.ledger.total(),
        "duplicated": duplicated,
        "lost": lost,
        "dead_letters": dead,
        "receiver_dedupes": receivers.duplicates,
        "rejected_signatures": receivers.rejected,
        "faults": faults,
    }


def _ok(result: dict[str, Any]) -> bool:
    return (
        result["duplicated"] == 0
        and result["lost"] == 0
        and result["effects"] == result["events"]
        and result["killed_worker"] is not None
        and all(code == 0 for code in result["worker_exit_codes"][1:])
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=("postgresql", "sqlite"), default="postgresql")
    parser.add_argument("--compare", action="store_true", help="run both stores; print the ratio")
    parser.add_argument("--events", type=positive_int, default=10_000)
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("-c", "--concurrency", type=positive_int, default=16, help="per worker")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--pg", default=DEFAULT_PG, help="PostgreSQL URL (creates a database)")
    parser.add_argument("--max-seconds", type=positive_float, default=900.0)
    args = parser.parse_args()
    for name in ("retrysafe", "psycopg", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.ERROR)
    kinds = ("sqlite", "postgresql") if args.compare else (args.store,)
    results = [run(args, kind) for kind in kinds]
    for r in results:
        _say(
            f"{r['store']}: {r['events']} events, {r['workers']} workers (one SIGKILLed): "
            f"{r['deliver_seconds']} s, {r['events_per_second']} events/s; effects "
            f"{r['effects']}, duplicated {r['duplicated']}, lost {r['lost']}, receiver "
            f"dedupes {r['receiver_dedupes']}, dead letters {r['dead_letters']}"
        )
        print(json.dumps(r))
    if len(results) == 2:
        ratio = results[1]["events_per_second"] / results[0]["events_per_second"]
        _say(f"postgresql / sqlite events/s: {ratio:.2f}")
    return 0 if all(_ok(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
