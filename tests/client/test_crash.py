"""Crash safety (SPEC §5): a worker killed with SIGKILL mid-attempt loses its lease; the next
worker re-sends with the same key and the server-side middleware keeps it to one effect."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe import JobState, Outbox, RetryPolicy
from retrysafe._serving import ServerThread
from retrysafe.server import IdempotencyMiddleware

_WORKER = """
import sys
from retrysafe import RetryPolicy, Worker
Worker(sys.argv[1], policy=RetryPolicy(timeout=1.5), lease=3.0).run_until_idle()
"""


def test_sigkilled_worker_job_is_resent_with_same_key_and_has_one_effect(tmp_path: Path) -> None:
    """kill -9 mid-attempt, restart: SUCCEEDED, same key on every request, one effect."""
    effects: list[str] = []
    keys: list[str | None] = []
    arrived = threading.Event()

    async def create(request: Request) -> Response:
        arrived.set()
        await asyncio.sleep(1.0)  # the attempt is in flight when the worker dies
        effects.append((await request.body()).decode())
        return JSONResponse({"created": True}, status_code=201)

    inner = Starlette(routes=[Route("/posts", create, methods=["POST"])])

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"idempotency-key":
                    keys.append(value.decode())
        await middleware(scope, receive, send)

    middleware = IdempotencyMiddleware(inner, f"sqlite:///{tmp_path / 'keys.db'}")
    db = tmp_path / "outbox.db"
    with ServerThread(app) as server, Outbox(f"sqlite:///{db}") as outbox:
        job = outbox.submit(server.url + "/posts", json={"text": "once"})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, f"sqlite:///{db}"], env=env)
        try:
            assert arrived.wait(20), "the first attempt never reached the server"
            assert outbox.get(job.id).state is JobState.IN_FLIGHT
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        started = time.monotonic()
        outbox.worker(
            policy=RetryPolicy(timeout=1.5, wait_initial=0.05, poll_interval=0.1), lease=3.0
        ).run_until_idle()
        assert time.monotonic() - started < 15
        final = outbox.get(job.id)
        assert final.state is JobState.SUCCEEDED
        assert final.key == job.key
        assert len(keys) >= 2 and set(keys) == {job.key}
        assert effects == ['{"text":"once"}']
        assert outbox.attempts(job.id)[-1].replayed  # the server replayed, did not re-run
        middleware.close()
