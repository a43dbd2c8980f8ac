"""``send_attempt``: the headers one attempt sends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from retrysafe import Outbox, RetryPolicy
from retrysafe.client._sender import make_engine, send_attempt
from retrysafe.core import AttemptOutcome


def test_an_attempts_own_headers_replace_stored_ones_but_never_the_key(tmp_path: Path) -> None:
    """``extra_headers`` (a webhook's fresh signature) replace stored headers of the same name,
    whatever their case; the stored others go as they are; an ``Idempotency-Key`` among them
    is ignored, as the attempt always sends the job's own key, once."""
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(201)

    with Outbox(f"sqlite:///{tmp_path / 'o.db'}") as outbox:
        job = outbox.submit(
            "http://example.test/x", json={}, headers={"X-Sig": "stored", "X-Keep": "1"}
        )

    async def attempt() -> AttemptOutcome:
        engine = make_engine(RetryPolicy(), transport=httpx.MockTransport(handler))
        try:
            extra = [("x-sig", "fresh"), ("Idempotency-Key", "forged")]
            result = await send_attempt(engine, job, timeout=5.0, extra_headers=extra)
        finally:
            await engine.aclose()
        return result.classification.outcome

    assert asyncio.run(attempt()) is AttemptOutcome.SUCCESS
    (headers,) = seen
    assert headers.get_list("x-sig") == ["fresh"]
    assert headers["x-keep"] == "1"
    assert headers.get_list("idempotency-key") == [job.key]
