"""The proof's child processes: ``python -m retrysafe.proof._child ROLE …``.

Roles (internal: the runner starts them with the arguments it needs):

``service``
    The protected publishing service under uvicorn: ``POST /posts`` publishes one post per
    call that reaches it (an effect), behind :class:`~retrysafe.IdempotencyMiddleware`. In
    plain mode the effect is a line appended to a file (``O_APPEND``, one ``write`` per post,
    so it survives a SIGKILL, like a call to another system that already happened); in
    transactional mode, for a request with a key, it is a row written in the key's own
    transaction (SPEC §4), which commits with the key's completion or not at all.
``worker``
    An outbox worker on the run's store, until every job is terminal; writes its stats as
    JSON to ``--stats``.
``naive``
    The naive client on a JSONL file of bodies: skips the operations already in ``--done``
    (a restarted process resumes its queue, as an at-least-once queue does), appends one
    JSON line per operation it ends there.
``lock``
    Holds an exclusive lock on a SQLite database for ``--seconds``; prints ``locked`` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from retrysafe.demo._service import answer_json, read_body
from retrysafe.proof._scenarios import EFFECTS_TABLE

__all__ = ["main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


def open_store(url: str, schema: str | None, busy_timeout: float) -> Any:
    """The store a child works on: SQLite with ``busy_timeout``, PostgreSQL in ``schema``."""
    from retrysafe.stores import open_store as _open

    if url.startswith("env:"):  # the URL is in the environment: no password in argv
        url = os.environ[url[4:]]
    if url.startswith("sqlite:"):
        return _open(url, busy_timeout=busy_timeout)
    return _open(url, schema=schema or "public")


# ------------------------------------------------------------------------------ service
class _Posts:
    """ASGI app: ``POST /posts`` publishes one post per call that reaches it."""

    def __init__(self, effects: Path, transactional: bool) -> None:
        self._fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._transactional = transactional
        self._posts = 0

    def _append(self, operation: str) -> None:
        os.write(self._fd, (operation + "\n").encode())

    def _in_transaction(self, scope: Scope, operation: str) -> None:
        from retrysafe.server import transaction

        with transaction(scope) as conn:
            mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
            conn.execute(f"INSERT INTO {EFFECTS_TABLE} (operation) VALUES ({mark})", (operation,))

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        try:
            job = json.loads(body)
            operation = str(job["operation"])
            work = float(job.get("work_seconds", 0.002))
        except (ValueError, KeyError, TypeError):
            await answer_json(send, 400, {"error": "expected a JSON job with an 'operation' field"})
            return
        await asyncio.sleep(work)
        keyed = any(name == b"idempotency-key" for name, _ in scope["headers"])
        if self._transactional and keyed:
            await asyncio.to_thread(self._in_transaction, scope, operation)
        else:
            self._append(operation)
        self._posts += 1
        await answer_json(send, 201, {"post_id": self._posts, "operation": operation})


def _service(args: argparse.Namespace) -> None:
    import uvicorn

    from retrysafe.server import IdempotencyMiddleware

    store = open_store(args.store, args.schema, args.busy_timeout)
    app = IdempotencyMiddleware(
        _Posts(Path(args.effects), args.transactional), store=store, lease=args.lease
    )
    config = uvicorn.Config(
        app, log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=1
    )
    # The listening socket is the runner's, held for the whole pass (as a supervisor's
    # socket activation holds it): a restarted service serves the same port, and no other
    # process can take that port between a kill and the restart.
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=args.fd)])


# ------------------------------------------------------------------------------ worker
def _worker(args: argparse.Namespace) -> None:
    from retrysafe.client import Outbox, RetryPolicy

    policy = RetryPolicy(
        attempts=args.attempts, wait_initial=0.05, wait_max=1.0, timeout=args.timeout
    )
    store = open_store(args.store, args.schema, args.busy_timeout)
    with Outbox(store, policy=policy) as outbox:
        worker = outbox.worker(concurrency=args.concurrency, lease=args.lease)
        stats = worker.run_until_idle()
    Path(args.stats).write_text(json.dumps(stats.to_dict()))


# ------------------------------------------------------------------------------ naive
def _naive(args: argparse.Namespace) -> None:
    from retrysafe.chaos import ClientBelief
    from retrysafe.demo import run_naive

    done_path = Path(args.done)
    done: set[str] = set()
    if done_path.exists():
        for line in done_path.read_text().splitlines():
            try:
                done.add(json.loads(line)["op"])
            except (ValueError, KeyError):
                continue  # a line cut by a SIGKILL: its operation is sent again
    bodies = [json.loads(line) for line in Path(args.jobs).read_text().splitlines() if line]
    todo = [b for b in bodies if b["operation"] not in done]
    fd = os.open(done_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def on_done(belief: ClientBelief) -> None:
        line = {"op": belief.operation_id, "state": belief.state.value, "at": time.time()}
        os.write(fd, (json.dumps(line) + "\n").encode())

    asyncio.run(
        run_naive(
            args.url,
            todo,
            concurrency=args.concurrency,
            timeout=args.timeout,
            attempts=args.attempts,
            on_done=on_done,
        )
    )


# ------------------------------------------------------------------------------ lock
def _lock(args: argparse.Namespace) -> None:
    conn = sqlite3.connect(args.path, timeout=30.0, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(args.seconds)
    conn.execute("ROLLBACK")
    conn.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m retrysafe.proof._child")
    roles = parser.add_subparsers(dest="role", required=True)
    service = roles.add_parser("service")
    worker = roles.add_parser("worker")
    for p in (service, worker):
        p.add_argument("--store", required=True)
        p.add_argument("--schema", default=None)
        p.add_argument("--busy-timeout", type=float, default=1.0)
        p.add_argument("--lease", type=float, required=True)
    service.add_argument("--fd", type=int, required=True, help="the listening socket")
    service.add_argument("--effects", required=True)
    service.add_argument("--transactional", action="store_true")
    worker.add_argument("--concurrency", type=int, required=True)
    worker.add_argument("--attempts", type=int, required=True)
    worker.add_argument("--timeout", type=float, required=True)
    worker.add_argument("--stats", required=True)
    naive = roles.add_parser("naive")
    naive.add_argument("--url", required=True)
    naive.add_argument("--jobs", required=True)
    naive.add_argument("--done", required=True)
    naive.add_argument("--concurrency", type=int, required=True)
    naive.add_argument("--attempts", type=int, required=True)
    naive.add_argument("--timeout", type=float, required=True)
    lock = roles.add_parser("lock")
    lock.add_argument("--path", required=True)
    lock.add_argument("--seconds", type=float, required=True)
    return parser


def _exit_with_parent() -> None:
    """Exit once the runner is gone (SIGKILLed, or its terminal closed): a child in a
    session of its own would otherwise go on serving, sending or holding a lock."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="retrysafe-proof-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """Run one role (see the module docstring)."""
    import logging

    _exit_with_parent()
    logging.getLogger("retrysafe").setLevel(logging.ERROR)
    args = _parser().parse_args(argv)
    {"service": _service, "worker": _worker, "naive": _naive, "lock": _lock}[args.role](args)


if __name__ == "__main__":
    main(sys.argv[1:])
