"""How an app tells the middleware "I don't know whether the effect happened".

The middleware stores a small state dict in the ASGI scope (or WSGI environ) under
:data:`SCOPE_KEY` while it holds a claim. An app that lost track of its own effect — the
gateway after its upstream timed out mid-request — calls :func:`mark_outcome_unknown`; the
middleware then neither completes nor releases the key, which stays claimed until its lease
ends (SPEC §0: a timeout means "I don't know", so a retry must not run the effect again
while the first attempt may still be committing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any

__all__ = [
    "ANSWER_EARLY",
    "SCOPE_KEY",
    "answer_early",
    "can_answer_early",
    "client_stalled",
    "mark_client_stalled",
    "mark_outcome_unknown",
    "outcome_unknown",
]

SCOPE_KEY = "retrysafe.idempotency"

#: The state's entry, while the ASGI middleware can still answer early: an async callable
#: ``(status, headers, body) -> seconds or None`` (see :func:`answer_early`).
ANSWER_EARLY = "answer_early"

EarlyAnswer = Callable[[int, Sequence[tuple[bytes, bytes]], bytes], Awaitable["float | None"]]


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


def can_answer_early(scope: MutableMapping[str, Any]) -> bool:
    """Whether :func:`answer_early` may work for this request: the ASGI middleware holds its
    claim and none of the answer has left yet."""
    state = scope.get(SCOPE_KEY)
    return isinstance(state, dict) and ANSWER_EARLY in state


async def answer_early(
    scope: MutableMapping[str, Any],
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
) -> float | None:
    """Give the client this answer now, in place of the app's own, which is slow to come
    (the gateway's 504 while its upstream still works): it is neither stored nor replayed.
    The app's own answer, when it ends, is captured and recorded as usual, never sent, so a
    retry with the same key gets ``409 request-in-progress`` until then and that answer
    after (SPEC §0: the request may still commit; the key must not run it again).

    Returns the seconds the claim is still renewed for (up to ``max_run_time`` from the
    claim, :meth:`~retrysafe.core.LeaseTiming.renewed_for`): the app's answer must end
    within them to be recorded; after them the key is left to its lease. None when nothing
    was sent: no middleware here (or the WSGI one, which cannot answer before the app
    returns), part of the answer already left, or no renewal time is left — send the answer
    as usual then.

    Args:
        status: 200-599 (an interim 1xx is no answer).
        headers: ASGI ``(name, value)`` byte-string pairs.
        body: the whole body, bytes.

    Raises:
        ValueError: ``status`` outside 200-599, a body with 204 or 304, and under the
            middleware any answer it would refuse to store (a header name that is no token,
            a value with CR, LF or another control character, a Content-Length that is not
            the body's length: :meth:`~retrysafe.server._engine.Engine.answer_fault`).
            Checked before anything is sent.
        TypeError: headers that are no byte-string pairs, or a body that is no bytes.
    """
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise ValueError(f"an early answer's status must be an int in 200-599, got {status!r}")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"an early answer's body must be bytes, got {type(body).__name__}")
    if body and status in (204, 304):
        raise ValueError(f"an early answer with status {status} carries no body")
    given: Any = headers
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(
            f"an early answer's headers are (name, value) bytes pairs, got {given!r:.100}"
        )
    headers = list(given)  # a generator is read once, here
    for pair in headers:
        if not (
            isinstance(pair, (tuple, list))
            and len(pair) == 2
            and all(isinstance(part, bytes) for part in pair)
        ):
            raise TypeError(
                f"an early answer's headers are (name, value) bytes pairs, got {pair!r}"
            )
    state = scope.get(SCOPE_KEY)
    early: EarlyAnswer | None = state.get(ANSWER_EARLY) if isinstance(state, dict) else None
    if early is None:
        return None
    return await early(status, headers, body)
