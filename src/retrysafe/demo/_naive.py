"""The naive client of the original incident: blind retries, no idempotency key.

This is what the shop did: on a timeout, a reset or a 5xx it simply sent the request again,
so every answer lost *after* the post was published became a second post.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from retrysafe._wire import AiohttpEngine, WireError, total_timeout
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
    # The same HTTP engine as the protected path, so the two passes differ only in keys,
    # persistence and the retry rules.
    engine = AiohttpEngine(
        connect_timeout=timeout,
        read_timeout=timeout,
        max_connections=concurrency,
        attempt_timeout=timeout,  # every send below runs under total_timeout(timeout)
    )
    headers = [("content-type", "application/json")]
    try:

        async def one(job: dict[str, Any]) -> ClientBelief:
            started = time.monotonic()  # the operation exists from now on, like a submitted job
            async with gate:
                state = BeliefState.FAILED
                for attempt in range(attempts):
                    if attempt:
                        await asyncio.sleep(pause)
                    try:
                        async with total_timeout(timeout):
                            answer = await engine.send(
                                "POST",
                                url,
                                headers=headers,
                                body=json.dumps(job).encode(),
                                keep=0,
                            )
                    except (WireError, asyncio.TimeoutError):
                        continue
                    if 200 <= answer.status < 300:
                        state = BeliefState.SUCCEEDED
                        break
                    if 400 <= answer.status < 500:
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
    finally:
        await engine.aclose()
