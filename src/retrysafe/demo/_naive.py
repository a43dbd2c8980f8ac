"""The naive client of the original incident: blind retries, no idempotency key.

This is what the shop did: on a timeout, a reset or a 5xx it simply sent the request again,
so every answer lost *after* the post was published became a second post.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from retrysafe.chaos import BeliefState, ClientBelief

__all__ = ["run_naive"]


async def run_naive(
    url: str,
    jobs: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    timeout: float,
    attempts: int = 4,
    pause: float = 0.05,
    on_done: Callable[[ClientBelief], None] | None = None,
) -> list[ClientBelief]:
    """Send every job with up to ``attempts`` blind attempts; return what the client believes.

    Args:
        url: the ``POST`` endpoint.
        jobs: job bodies; each must carry an ``operation`` id.
        concurrency: jobs in flight at once.
        timeout: seconds per attempt (connect and read).
        attempts: attempts per job before it is believed FAILED.
        pause: seconds between attempts (fixed, no jitter: the naive way).
        on_done: called with each job's belief as it ends (progress bars).
    """
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout), limits=limits, trust_env=False
    ) as client:

        async def one(job: dict[str, Any]) -> ClientBelief:
            started = time.monotonic()  # the operation exists from now on, like a submitted job
            async with gate:
                state = BeliefState.FAILED
                for attempt in range(attempts):
                    if attempt:
                        await asyncio.sleep(pause)
                    try:
                        response = await client.post(url, json=job)
                    except httpx.HTTPError:
                        continue
                    if response.is_success:
                        state = BeliefState.SUCCEEDED
                        break
                    if 400 <= response.status_code < 500:
                        state = BeliefState.REJECTED
                        break
                belief = ClientBelief(
                    operation_id=str(job["operation"]),
                    state=state,
                    seconds_to_terminal=time.monotonic() - started,
                )
                if on_done is not None:
                    on_done(belief)
                return belief

        return list(await asyncio.gather(*(one(job) for job in jobs)))
