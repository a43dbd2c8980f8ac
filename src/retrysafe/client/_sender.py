"""One attempt over httpx: send, then translate what happened into a §5 classification.

Driver errors are translated here, in one place. Whether the request may have reached the
server decides the row of the SPEC §5 table:

* not sent — ``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``, ``UnsupportedProtocol``:
  no byte reached the server, the effect cannot have committed;
* sent, answer unknown — ``ReadTimeout``, ``WriteTimeout``, ``ReadError``, ``WriteError``,
  ``RemoteProtocolError``, the total per-attempt timeout, anything unexpected: the effect may
  have committed, so the retry must carry the same key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

    from retrysafe.client._policy import RetryPolicy

__all__ = ["IDEMPOTENCY_KEY_HEADER", "SendResult", "make_client", "send_attempt"]

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
_ERROR_BODY_LIMIT = 2000

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


def make_client(
    policy: RetryPolicy,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    max_connections: int = 100,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` that never retries by itself (retries live in one layer,
    SPEC §5), with explicit connect/read/write/pool timeouts and no redirects."""
    import httpx

    timeout = httpx.Timeout(
        connect=policy.connect_timeout_s,
        read=policy.timeout_s,
        write=policy.timeout_s,
        pool=policy.timeout_s,
    )
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(
        transport=transport or httpx.AsyncHTTPTransport(retries=0, limits=limits),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )


def _not_sent() -> tuple[type[BaseException], ...]:
    import httpx

    return (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


async def send_attempt(
    client: httpx.AsyncClient,
    job: Job,
    *,
    timeout: float,
    clock: Callable[[], float] = time.time,
) -> SendResult:
    """Send one attempt of ``job`` with its key and classify what happened.

    Args:
        client: from :func:`make_client`.
        job: the leased job.
        timeout: total seconds for the attempt, connect to last body byte.
        clock: Unix-seconds clock (for ``started_at`` and HTTP-date ``Retry-After``).

    Returns:
        A :class:`SendResult`. Never raises for network or HTTP trouble; cancellation
        (``asyncio.CancelledError``) propagates.
    """
    headers = [(k, v) for k, v in job.headers if k.lower() != "idempotency-key"]
    headers.append((IDEMPOTENCY_KEY_HEADER, job.key))
    started = clock()
    t0 = time.perf_counter()
    try:
        response = await asyncio.wait_for(
            client.request(job.method, job.url, headers=headers, content=job.body), timeout
        )
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise
        sent = not isinstance(exc, _not_sent())
        if isinstance(exc, asyncio.TimeoutError):
            error_type = "AttemptTimeout"
        else:
            error_type = type(exc).__name__
        known = _is_httpx_error(exc) or isinstance(exc, asyncio.TimeoutError)
        if not known:
            logger.warning("unexpected error sending job %s", job.id, exc_info=exc)
        return SendResult(
            classification=classify_transport_error(sent=sent),
            started_at=started,
            duration=time.perf_counter() - t0,
            status=None,
            error_type=error_type,
            replayed=False,
            retry_after=None,
            detail=(str(exc) or error_type)[:_ERROR_BODY_LIMIT],
        )
    duration = time.perf_counter() - t0
    status = response.status_code
    problem_type = None
    detail = None
    if not 200 <= status < 300:
        text = response.text
        detail = text[:_ERROR_BODY_LIMIT] or None
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == PROBLEM_CONTENT_TYPE or ctype == "application/json":
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("type"), str):
                problem_type = doc["type"]
    return SendResult(
        classification=classify_response(status, problem_type=problem_type),
        started_at=started,
        duration=duration,
        status=status,
        error_type=None,
        replayed=response.headers.get(REPLAYED_HEADER, "").strip().lower() == "true",
        retry_after=parse_retry_after(response.headers.get("retry-after"), now=clock()),
        detail=detail,
    )


def _is_httpx_error(exc: BaseException) -> bool:
    import httpx

    return isinstance(exc, httpx.HTTPError)
