"""One attempt over the HTTP engine: send, then turn what happened into a §5 classification.

The engine (:mod:`retrysafe._wire`) translates its driver's errors once, into a
:class:`~retrysafe._wire.WireError` whose ``sent`` decides the row of the SPEC §5 table:

* not sent — ``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``, ``UnsupportedProtocol``,
  ``DestinationRefused``: no byte reached the server, the effect cannot have committed;
* sent, answer unknown — ``ReadTimeout``, ``WriteTimeout``, ``ReadError``, ``WriteError``,
  ``RemoteProtocolError`` (reset, closed, malformed or truncated answer), the total
  per-attempt timeout (``AttemptTimeout``), anything unexpected: the effect may have
  committed, so the retry must carry the same key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin

from retrysafe import _wire
from retrysafe._wire import Engine, WireError, total_timeout
from retrysafe.client._models import Job
from retrysafe.core import (
    PROBLEM_CONTENT_TYPE,
    Classification,
    classify_response,
    classify_transport_error,
    parse_retry_after,
)

if TYPE_CHECKING:
    import httpx

    from retrysafe._wire import AddressGuard
    from retrysafe.client._policy import RetryPolicy
    from retrysafe.observability._telemetry import Telemetry

__all__ = ["IDEMPOTENCY_KEY_HEADER", "SendResult", "make_engine", "send_attempt"]

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
_ERROR_BODY_LIMIT = 2000
#: Bytes of an answer's body kept (the rest is read and dropped): enough for a problem
#: document (whose ``type`` tells a key-reused 422 from other 422s) and the error detail.
_BODY_KEPT = 65536

logger = logging.getLogger("retrysafe.client")


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one attempt saw.

    Attributes:
        classification: the SPEC §5 row.
        started_at: Unix seconds; duration: seconds.
        status: the HTTP status, or None without a complete answer.
        error_type: the transport error's class name, or None.
        replayed: the answer carried ``Idempotent-Replayed: true``.
        retry_after: the parsed ``Retry-After`` in seconds (uncapped), or None.
        detail: for non-2xx answers, the start of the body (a problem document for 422
            key-reused keeps both fingerprints); for errors, the error message.
    """

    classification: Classification
    started_at: float
    duration: float
    status: int | None
    error_type: str | None
    replayed: bool
    retry_after: float | None
    detail: str | None


#: C0 controls but tab and newlines, and DEL, as U+FFFD in an error's detail (a binary answer
#: body would otherwise put NULs and escape sequences into logs, the CLI and the console).
_UNPRINTABLE = dict.fromkeys([*range(0, 9), 11, 12, *range(14, 32), 127], "\ufffd")
#: Headers an attempt's trace replaces (with the key's, which every attempt sets itself).
_TRACED = frozenset({"idempotency-key", "traceparent", "tracestate"})
_KEY = frozenset({"idempotency-key"})


def make_engine(
    policy: RetryPolicy,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    max_connections: int = 100,
    guard: AddressGuard | None = None,
) -> Engine:
    """The HTTP engine for ``policy``: connect timeout ``policy.connect_timeout_s``, read
    timeout ``policy.timeout_s``, no retries, no redirects (see :mod:`retrysafe._wire`).
    Every send goes through :func:`send_attempt`, under a total timeout of
    ``policy.timeout_s``: the engine is told so (``attempt_timeout``), and leaves out the
    per-read timers that total makes redundant.

    Args:
        transport: an ``httpx`` transport to send through instead of the default aiohttp
            engine (tests, proxies); ``guard`` does not apply to it (wrap it yourself).
        max_connections: the pool size.
        guard: the SSRF guard for the default engine.
    """
    return _wire.make_engine(
        connect_timeout=policy.connect_timeout_s,
        read_timeout=policy.timeout_s,
        transport=transport,
        max_connections=max_connections,
        guard=guard,
        attempt_timeout=policy.timeout_s,
    )


async def send_attempt(
    engine: Engine,
    job: Job,
    *,
    timeout: float,
    clock: Callable[[], float] = time.time,
    telemetry: Telemetry | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> SendResult:
    """Send one attempt of ``job`` with its key and classify what happened.

    Args:
        engine: from :func:`make_engine`.
        job: the leased job.
        timeout: total seconds for the attempt, connect to last body byte.
        clock: Unix-seconds clock (for ``started_at`` and HTTP-date ``Retry-After``).
        telemetry: traces the attempt (its span, and the trace context it sends in
            ``traceparent`` instead of any stored one).
        loop: the running event loop, if the caller knows it (saves looking it up).
        extra_headers: this attempt's own headers (a webhook's signature), each replacing
            any stored header of the same name (case-insensitive); never the key, which
            the attempt sets itself.

    Returns:
        A :class:`SendResult`. Never raises for network or HTTP trouble; cancellation
        (``asyncio.CancelledError``) propagates.
    """
    trace = None if telemetry is None else telemetry.attempt_started(job)
    if trace is None and not extra_headers:
        headers = [(k, v) for k, v in job.headers if k.lower() != "idempotency-key"]
        headers.append((IDEMPOTENCY_KEY_HEADER, job.key))
        return await _send(engine, job, headers, timeout, clock, loop)
    # The attempt's own trace context replaces the stored one (the submission's), whatever
    # headers the propagator uses (traceparent, tracestate, baggage, b3, ...).
    traced = [] if trace is None else list(trace.headers())
    replaced = {name.lower() for name, _ in (*traced, *extra_headers)}
    replaced |= _TRACED if trace is not None else _KEY
    headers = [(k, v) for k, v in job.headers if k.lower() not in replaced]
    headers.extend((k, v) for k, v in extra_headers if k.lower() != "idempotency-key")
    headers.extend(traced)
    headers.append((IDEMPOTENCY_KEY_HEADER, job.key))
    if trace is None:
        return await _send(engine, job, headers, timeout, clock, loop)
    try:
        result = await _send(engine, job, headers, timeout, clock, loop)
    except asyncio.CancelledError:
        trace.cancelled()
        raise
    trace.end(result)
    return result


#: Characters of a redirect's Location shown in the job's error.
_LOCATION_SHOWN = 500


def _redirect_detail(url: str, location: str | None, detail: str | None) -> str | None:
    """A 3xx's error: where it points, resolved against the job's ``url`` (never followed:
    the job, its key and, for a webhook, its signature and the SSRF guard's check are for
    the URL it was given; the operator re-submits or re-registers the URL the redirect
    names), then the body's text if any."""
    if location is None:
        note = "redirect without a Location (not followed)"
    else:
        with contextlib.suppress(ValueError):  # a Location no URL parser takes: as sent
            location = urljoin(url, location)
        shown = location[:_LOCATION_SHOWN] + ("…" if len(location) > _LOCATION_SHOWN else "")
        note = f"redirect to {shown} (not followed)".translate(_UNPRINTABLE)
    return f"{note}: {detail}"[:_ERROR_BODY_LIMIT] if detail else note


def _no_answer(
    exc: Exception, job: Job, timeout: float, started: float, duration: float
) -> SendResult:
    """The result of an attempt that got no complete answer (``exc`` says why).

    A function of its own: the error it reads is no local of :func:`_send`'s frame, which the
    error's traceback holds, so no reference cycle keeps the error, its traceback and the
    frames' buffers alive until the garbage collector's next full pass."""
    if isinstance(exc, WireError):
        error = exc
    elif isinstance(exc, asyncio.TimeoutError):
        error = WireError("AttemptTimeout", f"no complete answer within {timeout:g} s", sent=True)
    else:
        error = WireError(type(exc).__name__, str(exc), sent=True, expected=False)
    if not error.expected:
        logger.warning("unexpected error sending job %s", job.id, exc_info=exc)
    return SendResult(
        classification=classify_transport_error(sent=error.sent),
        started_at=started,
        duration=duration,
        status=None,
        error_type=error.kind,
        replayed=False,
        retry_after=None,
        detail=str(error)[:_ERROR_BODY_LIMIT],
    )


async def _send(
    engine: Engine,
    job: Job,
    headers: list[tuple[str, str]],
    timeout: float,
    clock: Callable[[], float],
    loop: asyncio.AbstractEventLoop | None,
) -> SendResult:
    started = clock()
    t0 = time.perf_counter()
    try:
        async with total_timeout(timeout, loop):
            answer = await engine.send(
                job.method, job.url, headers=headers, body=job.body or None, keep=_BODY_KEPT
            )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        return _no_answer(exc, job, timeout, started, time.perf_counter() - t0)
    duration = time.perf_counter() - t0
    status = answer.status
    headers_in = answer.headers
    problem_type = None
    detail = None
    if not 200 <= status < 300:
        text = answer.body.decode("utf-8", "replace")
        coding = headers_in.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity") and answer.body:
            # Kept as sent (never decompressed: a bomb stays a few KiB): not text to show.
            detail = f"{answer.size}-byte answer body, content-encoding {coding[:40]}"
        else:
            detail = text[:_ERROR_BODY_LIMIT].translate(_UNPRINTABLE) or None
        ctype = headers_in.get("content-type", "").split(";")[0].strip().lower()
        if ctype == PROBLEM_CONTENT_TYPE or ctype == "application/json":
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("type"), str):
                problem_type = doc["type"]
        if 300 <= status < 400:
            detail = _redirect_detail(job.url, headers_in.get("location"), detail)
    retry_after = headers_in.get("retry-after")
    error_type = None
    if not 200 <= status <= 599:
        # A final 1xx, or no such status: a malformed answer (classify_response), recorded
        # as the engine records one, the status kept for the operator.
        error_type = "RemoteProtocolError"
        detail = f"malformed answer: final status {status}" + (f": {detail}" if detail else "")
    return SendResult(
        classification=classify_response(status, problem_type=problem_type),
        started_at=started,
        duration=duration,
        status=status,
        error_type=error_type,
        replayed=headers_in.get(REPLAYED_HEADER, "").strip().lower() == "true",
        retry_after=None if retry_after is None else parse_retry_after(retry_after, now=clock()),
        detail=detail,
    )
