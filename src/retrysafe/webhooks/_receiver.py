"""The receiving side: verify Standard Webhooks and handle each ``webhook-id`` once.

Senders deliver at least once, so a receiver sees duplicates (a lost 200, a replay from the
DLQ). :class:`WebhookVerifier` checks the signature and timestamp, then claims the
``webhook-id`` in a :class:`~retrysafe.stores.KeyStore` with the same claim / complete /
release primitives the idempotency middleware uses: the first delivery runs the handler and
completes the claim; a duplicate is acknowledged without running it; a handler that fails
releases the claim so the sender's retry runs it again. Use it directly
(:meth:`WebhookVerifier.receive`), as a decorator (:meth:`WebhookVerifier.handler`) or as
pure ASGI middleware (:class:`WebhookMiddleware`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from retrysafe._exceptions import ConfigurationError, WebhookVerificationError
from retrysafe.core import KeyState, StoredResponse
from retrysafe.stores._base import KeyStore
from retrysafe.webhooks._signing import (
    DEFAULT_TOLERANCE,
    Body,
    Headers,
    as_body,
    as_headers,
    parse_secret,
    verify,
)

__all__ = ["Receipt", "WebhookMiddleware", "WebhookVerifier"]

_T = TypeVar("_T")
_ACK = StoredResponse(200, (), b"", True)
_Message = MutableMapping[str, Any]
_Send = Callable[[_Message], Awaitable[None]]
_Receive = Callable[[], Awaitable[_Message]]
_App = Callable[[_Message, _Receive, _Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Receipt:
    """What :meth:`WebhookVerifier.receive` did.

    Attributes:
        webhook_id: the verified ``webhook-id``.
        payload: the JSON-decoded body.
        duplicate: True when this id was already handled (the handler did not run).
        in_progress: True when another delivery of this id is being handled right now (the
            handler did not run; answer 409 so the sender tries again later).
        result: the handler's return value (None for duplicates).
    """

    webhook_id: str
    payload: Any
    duplicate: bool
    in_progress: bool
    result: Any = None


class WebhookVerifier:
    """Verify incoming Standard Webhooks and deduplicate them by ``webhook-id``.

    Args:
        secret: the endpoint's ``whsec_`` secret, or several (during a rotation).
        store: a :class:`~retrysafe.stores.KeyStore` (or its URL) that remembers handled
            ids; None verifies without deduplicating.
        tolerance: seconds the ``webhook-timestamp`` may differ from the clock (default 300).
        retention: seconds a handled id is remembered (default 7 days; longer than the
            sender's whole retry schedule).
        lease: seconds a handler may run before another delivery of the same id may take
            over (default 60).
        clock: Unix-seconds clock.

    Raises:
        ConfigurationError: a malformed secret, bad durations.
    """

    def __init__(
        self,
        secret: str | Iterable[str],
        *,
        store: KeyStore | str | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        retention: float = 7 * 24 * 3600.0,
        lease: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        secrets = [secret] if isinstance(secret, str) else list(secret)
        self._keys = [parse_secret(s) for s in secrets]
        if not self._keys:
            raise ConfigurationError("at least one secret is needed", option="secret")
        for name, value in (("tolerance", tolerance), ("retention", retention), ("lease", lease)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"{name} must be > 0 seconds", option=name)
        self._owns_store = isinstance(store, str)
        if isinstance(store, str):
            from retrysafe.stores import open_store

            self.store: KeyStore | None = open_store(store)
        else:
            self.store = store
        self.tolerance = float(tolerance)
        self.retention = float(retention)
        self.lease = float(lease)
        self._clock = clock

    def close(self) -> None:
        """Close the store if this verifier opened it from a URL. Idempotent."""
        if self._owns_store and self.store is not None:
            self.store.close()
            self._owns_store = False

    def verify(self, headers: Headers, body: Body) -> tuple[str, Any]:
        """Check signature and timestamp; return ``(webhook_id, JSON payload)``.

        Args:
            headers: a mapping (``dict``, framework headers) or ``(name, value)`` pairs
                (raw ASGI ``scope["headers"]``), names and values ``str`` or ``bytes``.
            body: the raw request body, ``bytes`` or ``str`` (encoded as UTF-8, as the
                official ``standardwebhooks`` library does).

        Raises:
            WebhookVerificationError: bad headers, stale timestamp, no matching signature,
                or a body that is not JSON.
            TypeError: headers or body of another type.
        """
        body = as_body(body)
        headers = as_headers(headers)
        webhook_id = verify(self._keys, headers, body, now=self._clock(), tolerance=self.tolerance)
        try:
            payload = json.loads(body)
        except ValueError:
            raise WebhookVerificationError("body is not JSON", webhook_id=webhook_id) from None
        return webhook_id, payload

    @staticmethod
    def _key_hash(webhook_id: str) -> str:
        return hashlib.sha256(b"webhook-id\x00" + webhook_id.encode()).hexdigest()

    def _claim(self, webhook_id: str, body: bytes) -> tuple[str, int | None]:
        """``("run", token)``, ``("duplicate", None)`` or ``("in_progress", None)``."""
        assert self.store is not None
        key_hash = self._key_hash(webhook_id)
        fingerprint = hashlib.sha256(body).hexdigest()
        now = self._clock()
        claimed, record = self.store.claim(
            key_hash, fingerprint, now=now, lease=self.lease, retention=self.retention
        )
        if claimed:
            return "run", record.fencing_token
        if record.state is KeyState.COMPLETED:
            return "duplicate", None
        if record.lease_expires_at <= now:
            taken = self.store.take_over(key_hash, record.fencing_token, now=now, lease=self.lease)
            if taken is not None:
                return "run", taken.fencing_token
        return "in_progress", None

    def _complete(self, webhook_id: str, token: int) -> None:
        assert self.store is not None
        self.store.complete(
            self._key_hash(webhook_id),
            token,
            _ACK,
            now=self._clock(),
            retention=self.retention,
        )

    def _release(self, webhook_id: str, token: int) -> None:
        assert self.store is not None
        self.store.release(self._key_hash(webhook_id), token)

    def receive(self, headers: Headers, body: Body, handler: Callable[[Any], _T]) -> Receipt:
        """Verify, then run ``handler(payload)`` once per ``webhook-id``.

        Raises:
            WebhookVerificationError: verification failed (answer 400/401; the handler did
                not run).
            Exception: whatever the handler raised (the claim is released, so the sender's
                retry runs it again).
            TypeError: headers or body of another type (see :meth:`verify`).
        """
        body = as_body(body)
        webhook_id, payload = self.verify(headers, body)
        if self.store is None:
            return Receipt(webhook_id, payload, False, False, handler(payload))
        state, token = self._claim(webhook_id, body)
        if token is None:
            return Receipt(webhook_id, payload, state == "duplicate", state == "in_progress")
        try:
            result = handler(payload)
        except BaseException:
            self._release(webhook_id, token)
            raise
        self._complete(webhook_id, token)
        return Receipt(webhook_id, payload, False, False, result)

    async def areceive(
        self,
        headers: Headers,
        body: Body,
        handler: Callable[[Any], Awaitable[_T]],
    ) -> Receipt:
        """:meth:`receive` for an async handler."""
        body = as_body(body)
        webhook_id, payload = self.verify(headers, body)
        if self.store is None:
            return Receipt(webhook_id, payload, False, False, await handler(payload))
        state, token = self._claim(webhook_id, body)
        if token is None:
            return Receipt(webhook_id, payload, state == "duplicate", state == "in_progress")
        try:
            result = await handler(payload)
        except BaseException:
            self._release(webhook_id, token)
            raise
        self._complete(webhook_id, token)
        return Receipt(webhook_id, payload, False, False, result)

    def handler(self, fn: Callable[[Any], _T]) -> Callable[[Headers, Body], Receipt]:
        """Decorator: ``fn(payload)`` becomes ``(headers, body) -> Receipt``, verified and
        run once per ``webhook-id``::

            @verifier.handler
            def on_event(payload): ...

            receipt = on_event(request.headers, request.body)
        """

        @functools.wraps(fn)
        def wrapper(headers: Headers, body: Body) -> Receipt:
            return self.receive(headers, body, fn)

        return wrapper


class WebhookMiddleware:
    """Pure ASGI middleware that verifies webhooks on ``path`` and passes each
    ``webhook-id`` to the app once.

    Answers without calling the app: 401 (problem+json) when verification fails, 200
    ``{"duplicate": true}`` for an id already handled, 409 with ``Retry-After`` while
    another delivery of it runs. A 2xx from the app completes the id; anything else (or an
    exception) releases it so the sender's retry runs again. Other paths pass through.

    Args:
        app: the ASGI application.
        verifier: a :class:`WebhookVerifier` (with a store, for deduplication).
        path: the webhook path (exact match), or None for every POST.
    """

    def __init__(self, app: _App, *, verifier: WebhookVerifier, path: str | None = None) -> None:
        self.app = app
        self.verifier = verifier
        self.path = path

    async def __call__(self, scope: _Message, receive: _Receive, send: _Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or (self.path is not None and scope.get("path") != self.path)
        ):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            webhook_id, _ = self.verifier.verify(headers, body)
        except WebhookVerificationError as exc:
            await _answer(send, 401, {"type": "webhook-verification", "detail": exc.reason})
            return
        token = None
        if self.verifier.store is not None:
            state, token = self.verifier._claim(webhook_id, body)
            if state == "duplicate":
                await _answer(send, 200, {"duplicate": True, "webhook_id": webhook_id})
                return
            if state == "in_progress":
                await _answer(send, 409, {"in_progress": True}, retry_after=True)
                return
        status: list[int] = []
        sent_body = False

        async def replay() -> _Message:
            nonlocal sent_body
            if sent_body:
                return {"type": "http.disconnect"}
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def watch(message: _Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, replay, watch)
        except BaseException:
            if token is not None:
                self.verifier._release(webhook_id, token)
            raise
        if token is not None:
            if status and 200 <= status[0] < 300:
                self.verifier._complete(webhook_id, token)
            else:
                self.verifier._release(webhook_id, token)


async def _answer(send: _Send, status: int, doc: dict[str, Any], retry_after: bool = False) -> None:
    body = json.dumps(doc).encode()
    ctype = b"application/problem+json" if status >= 400 else b"application/json"
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
