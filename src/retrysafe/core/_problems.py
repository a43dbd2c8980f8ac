"""RFC 9457 problem details for every answer the middleware gives on its own.

Each case has a distinct ``type`` URI (``urn:retrysafe:problem:<slug>``), documented in
``docs/problems.md``. Bodies never echo secrets or the raw stored response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROBLEM_CONTENT_TYPE", "PROBLEM_TYPE_PREFIX", "Problem"]

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:retrysafe:problem:"

_TITLES = {
    "missing-key": "Idempotency-Key header required",
    "invalid-key": "Invalid Idempotency-Key header",
    "key-reused": "Idempotency key reused for a different request",
    "request-in-progress": "A request with this idempotency key is in progress",
    "store-unavailable": "Idempotency store unavailable",
    "body-too-large": "Request body too large",
    "replay-unavailable": "Stored response cannot be replayed",
    "bad-gateway": "Upstream unavailable",
    "gateway-timeout": "Upstream did not answer in time",
    "not-forwarded": "The gateway does not forward this request",
    "server-stopped": "Server stopped while the request ran",
    "incomplete-body": "Request body ended early",
    "invalid-answer": "The handler's answer is not a valid HTTP response",
}


@dataclass(frozen=True, slots=True)
class Problem:
    """A problem-details answer.

    Attributes:
        slug: the case, e.g. ``"key-reused"``; the ``type`` is ``urn:retrysafe:problem:<slug>``.
        status: HTTP status code.
        detail: human-readable explanation of this occurrence.
        retry_after: whole seconds for a ``Retry-After`` header, or None.
        extra: extension members (JSON-serialisable), e.g. fingerprints.
    """

    slug: str
    status: int
    detail: str
    retry_after: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.slug

    def body(self) -> bytes:
        doc: dict[str, Any] = {
            "type": self.type,
            "title": _TITLES.get(self.slug, self.slug),
            "status": self.status,
            "detail": self.detail,
        }
        doc.update(self.extra)
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    def headers(self, body_length: int) -> list[tuple[str, str]]:
        out = [
            ("content-type", PROBLEM_CONTENT_TYPE),
            ("content-length", str(body_length)),
        ]
        if self.retry_after is not None:
            out.append(("retry-after", str(self.retry_after)))
        return out
