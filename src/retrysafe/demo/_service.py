"""The demo's publishing service: each accepted job publishes one post.

A framework-free ASGI app (so ``pip install retrysafe`` is enough to run the demo): ``POST
/posts`` with a JSON job publishes it — the effect — by recording it in an
:class:`~retrysafe.chaos.EffectLedger` under the job's operation id, and answers ``201`` with
the post's id and ``Location``. The demo wraps it in the idempotency middleware.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from retrysafe.chaos import EffectLedger

__all__ = ["PublishingService", "answer_json", "read_body"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class PublishingService:
    """ASGI app: ``POST /posts`` publishes a post (one effect per call that reaches it).

    Args:
        ledger: where each publication is counted, keyed by the body's ``operation`` field.
        work_seconds: simulated work per post (rendering, the AI caption call), seconds.
    """

    def __init__(self, ledger: EffectLedger, *, work_seconds: float = 0.002) -> None:
        self.ledger = ledger
        self.work_seconds = work_seconds
        self._ids = itertools.count(1)

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["method"] != "POST" or scope["path"] != "/posts":
            await answer_json(send, 404, {"error": "not found"})
            return
        try:
            job = json.loads(body)
            operation = str(job["operation"])
        except (ValueError, KeyError, TypeError):
            await answer_json(send, 400, {"error": "expected a JSON job with an 'operation' field"})
            return
        if self.work_seconds:
            await asyncio.sleep(self.work_seconds)
        post_id = next(self._ids)
        self.ledger.record(operation, post_id=post_id, channel=job.get("channel"))
        await answer_json(
            send,
            201,
            {"post_id": post_id, "operation": operation, "status": "published"},
            location=f"/posts/{post_id}",
        )


async def read_body(receive: Callable[[], Awaitable[Message]]) -> bytes:
    """The whole request body, from every ``http.request`` message."""
    body = b""
    while True:
        message = await receive()
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body", False):
            return body


async def answer_json(
    send: Callable[[Message], Awaitable[None]],
    status: int,
    doc: dict[str, Any],
    *,
    location: str | None = None,
) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if location:
        headers.append((b"location", location.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
