"""How an app tells the middleware "I don't know whether the effect happened".

The middleware stores a small state dict in the ASGI scope (or WSGI environ) under
:data:`SCOPE_KEY` while it holds a claim. An app that lost track of its own effect — the
gateway after its upstream timed out mid-request — calls :func:`mark_outcome_unknown`; the
middleware then neither completes nor releases the key, which stays claimed until its lease
ends (SPEC §0: a timeout means "I don't know", so a retry must not run the effect again
while the first attempt may still be committing).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

__all__ = [
    "SCOPE_KEY",
    "client_stalled",
    "mark_client_stalled",
    "mark_outcome_unknown",
    "outcome_unknown",
]

SCOPE_KEY = "retrysafe.idempotency"


def mark_outcome_unknown(scope: MutableMapping[str, Any]) -> None:
    """Mark this request's outcome as unknown; a no-op without the middleware."""
    state = scope.get(SCOPE_KEY)
    if isinstance(state, dict):
        state["outcome_unknown"] = True


def outcome_unknown(state: MutableMapping[str, Any] | None) -> bool:
    """Whether the app marked the outcome unknown."""
    return bool(state and state.get("outcome_unknown"))


def mark_client_stalled(scope: MutableMapping[str, Any]) -> None:
    """Say that the client stopped taking the answer (the gateway's: nothing accepted for
    its timeout): the middleware stops sending to it and still records the whole answer, as
    for a client that left; a no-op without the middleware."""
    state = scope.get(SCOPE_KEY)
    if isinstance(state, dict):
        state["client_stalled"] = True


def client_stalled(state: MutableMapping[str, Any] | None) -> bool:
    """Whether the app said the client stopped taking the answer."""
    return bool(state and state.get("client_stalled"))
