"""Logs: the ready logging config shows the middleware's decision lines as JSON under
uvicorn, and the workers' output is one JSON object per line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import retrysafe
from retrysafe import ConfigurationError
from retrysafe._serving import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_file_is_the_ready_config() -> None:
    """``examples/logging.json`` is ``retrysafe.logging_config()``, byte for byte in value."""
    shipped = json.loads((ROOT / "examples" / "logging.json").read_text())
    assert shipped == retrysafe.logging_config()


@pytest.mark.parametrize("level", ["loud", "", "5"])
def test_a_bad_level_is_refused(level: str) -> None:
    """``logging_config(level=…)`` that is not a level name raises ConfigurationError."""
    with pytest.raises(ConfigurationError):
        retrysafe.logging_config(level)


def test_uvicorn_with_the_example_config_logs_each_decision_as_a_json_line(
    tmp_path: Path,
) -> None:
    """``uvicorn app:app --log-config examples/logging.json``: a first request and its retry
    give a ``decision`` line each (new work stored, then a replay) as JSON on stderr."""
    (tmp_path / "app.py").write_text(
        "from starlette.applications import Starlette\n"
        "from starlette.responses import JSONResponse\n"
        "from starlette.routing import Route\n"
        "from retrysafe import IdempotencyMiddleware\n"
        "async def charge(request):\n"
        "    return JSONResponse({'ok': True}, 201)\n"
        "app = IdempotencyMiddleware(\n"
        "    Starlette(routes=[Route('/charge', charge, methods=['POST'])]),\n"
        f"    'sqlite:///{tmp_path}/keys.db')\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port),
         "--log-config", str(ROOT / "examples" / "logging.json")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                first = httpx.post(f"http://127.0.0.1:{port}/charge", json={},
                                   headers={"Idempotency-Key": "log-1"})  # fmt: skip
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        again = httpx.post(f"http://127.0.0.1:{port}/charge", json={},
                           headers={"Idempotency-Key": "log-1"})  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert (first.status_code, again.status_code) == (201, 201)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    decisions = [d["decision"] for d in lines if d.get("logger") == "retrysafe.server"]
    assert decisions == ["stored", "replay"], err
    assert any(d.get("logger", "").startswith("uvicorn") for d in lines), err
    assert all("log-1" not in json.dumps(d) for d in lines)  # the raw key is never logged


def test_gunicorn_with_the_example_config_logs_each_decision_as_a_json_line(
    tmp_path: Path,
) -> None:
    """``gunicorn app:app --log-config-json examples/logging.json`` (a WSGI app behind the
    WSGI middleware) starts, and a request and its retry give a decision line each as JSON."""
    (tmp_path / "app.py").write_text(
        "from retrysafe import WSGIIdempotencyMiddleware\n"
        "def charge(environ, start_response):\n"
        "    start_response('201 Created', [('Content-Type', 'application/json')])\n"
        "    return [b'{\"ok\": true}']\n"
        f"app = WSGIIdempotencyMiddleware(charge, 'sqlite:///{tmp_path}/keys.db')\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "app:app", "--bind", f"127.0.0.1:{port}",
         "--workers", "1", "--log-config-json", str(ROOT / "examples" / "logging.json")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                first = httpx.post(f"http://127.0.0.1:{port}/charge", content=b"{}",
                                   headers={"Idempotency-Key": "g-1"})  # fmt: skip
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        again = httpx.post(f"http://127.0.0.1:{port}/charge", content=b"{}",
                           headers={"Idempotency-Key": "g-1"})  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert (first.status_code, again.status_code) == (201, 201), err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    decisions = [d["decision"] for d in lines if d.get("logger") == "retrysafe.server"]
    assert decisions == ["stored", "replay"], err
    assert any(d.get("logger", "").startswith("gunicorn") for d in lines), err


def test_a_logged_exception_keeps_its_type_and_whole_message() -> None:
    """An exception logged through the JSON formatter keeps ``error``: its type and its whole
    message, newlines included (not only the traceback's last line)."""
    import logging

    from retrysafe._logging import JSONFormatter

    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        import sys as _sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, _sys.exc_info())
    doc = json.loads(JSONFormatter().format(record))
    assert doc["error"] == "RuntimeError: boom\nsecond line"
    assert "traceback" not in doc


def _uvicorn_error(msg: str, exc: BaseException | None, *args: object) -> logging.LogRecord:
    import logging

    info = None if exc is None else (type(exc), exc, None)
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, args, info)


def test_requests_a_shutdown_cancelled_are_warnings_and_other_errors_stay_errors() -> None:
    """``ShutdownCancels`` (the served commands' filter and the ready config's): uvicorn's
    "Exception in ASGI application" with the CancelledError its shutdown caused becomes a
    warning that keeps the error, its "Cancel N running task(s)" line a warning, the
    lifespan's cancelled line is dropped; the same lines with any other exception, and any
    other logger's records, pass unchanged."""
    import asyncio
    import logging

    from retrysafe._logging import JSONFormatter, ShutdownCancels

    keep = ShutdownCancels().filter
    cancelled = asyncio.CancelledError("Task cancelled, timeout graceful shutdown exceeded")
    request = _uvicorn_error("Exception in ASGI application\n", cancelled)
    assert keep(request)
    assert (request.levelno, request.levelname) == (logging.WARNING, "WARNING")
    assert request.getMessage() == "request cancelled by the server's shutdown"
    assert json.loads(JSONFormatter().format(request))["error"].startswith(
        "CancelledError: Task cancelled"
    )
    grace = _uvicorn_error("Cancel %s running task(s), timeout graceful shutdown exceeded", None, 2)
    assert keep(grace) and grace.levelno == logging.WARNING and "Cancel 2" in grace.getMessage()
    assert not keep(_uvicorn_error("Exception in 'lifespan' protocol\n", asyncio.CancelledError()))

    crash = _uvicorn_error("Exception in ASGI application\n", RuntimeError("boom"))
    lifespan_crash = _uvicorn_error("Exception in 'lifespan' protocol\n", RuntimeError("x"))
    other = _uvicorn_error("Exception in ASGI application\n", cancelled)
    other.name = "myapp"
    for record in (crash, lifespan_crash, other):
        assert keep(record) and record.levelno == logging.ERROR
        assert record.msg.startswith("Exception in")
