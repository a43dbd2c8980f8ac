"""Pure ASGI idempotency middleware (starlette style: config on ``self``, per-request state in a
small responder that wraps ``send``; never ``BaseHTTPMiddleware``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from retrysafe._exceptions import ConfigurationError, StoreError
from retrysafe.core import (
    InvalidKey,
    Keyed,
    MissingKey,
    fingerprint,
    key_hash,
    scope_from_authorization,
)
from retrysafe.server._config import IdempotencyConfig, resolve_config
from retrysafe.server._engine import (
    Answer,
    Capture,
    Engine,
    RequestState,
    adrive,
)
from retrysafe.server._outcome import SCOPE_KEY, outcome_unknown
from retrysafe.server._transaction import effect_opener
from retrysafe.stores import AsyncKeyStore, KeyStore, as_async_key_store, open_store

__all__ = ["IdempotencyMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _ClientGone(Exception):
    """The client disconnected while the request body was being read."""


class IdempotencyMiddleware:
    """ASGI middleware that makes protected requests safe to retry (SPEC §3, §4).

    A request with an ``Idempotency-Key`` (IETF draft-ietf-httpapi-idempotency-key-header)
    claims the key in the store; the handler runs once per key, its response streams to the
    client while a copy is stored, and repeats get that response replayed with
    ``Idempotent-Replayed: true``. Answers of its own are RFC 9457 problem details; see
    ``docs/server.md`` for every case.

    Use it like any pure ASGI middleware::

        app = IdempotencyMiddleware(app, "sqlite:///keys.db", key_required=True)
        # or: starlette_app.add_middleware(IdempotencyMiddleware, store=store, lease=30)

    Args:
        app: the ASGI application to protect. Non-HTTP scopes (lifespan, websocket) and
            unprotected methods pass straight through.
        store: a :class:`~retrysafe.stores.KeyStore`, an
            :class:`~retrysafe.stores.AsyncKeyStore`, or a store URL (``sqlite:///keys.db``);
            a store opened from a URL is closed by :meth:`close`. Its async face is taken once
            here (SQLite runs uncontended statements inline on the loop).
        config: an :class:`IdempotencyConfig`; or pass its fields as keyword ``options``.

    Raises:
        ConfigurationError: invalid options, both ``config`` and options, a bad store URL.
    """

    def __init__(
        self,
        app: ASGIApp,
        /,
        store: KeyStore | AsyncKeyStore | str,
        *,
        config: IdempotencyConfig | None = None,
        **options: Any,
    ) -> None:
        self.app = app
        self.config = resolve_config(config, options)
        self._owned: Any = None
        if isinstance(store, str):
            self._owned = open_store(store)
            self.store = as_async_key_store(self._owned)
        else:
            self.store = as_async_key_store(store)
        self._begin_effect = effect_opener(self._owned if isinstance(store, str) else store)
        self._engine = Engine(self.config)
        self._methods = self._engine.protected_methods

    def close(self) -> None:
        """Close the store if this middleware opened it from a URL. Idempotent."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self._methods:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        engine = self._engine
        method: str = scope["method"]
        path: str = scope["path"]
        header: str | None = None
        duplicate = False
        content_type: str | None = None
        content_length: bytes | None = None
        authorization: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"idempotency-key":
                duplicate = header is not None
                # UTF-8 so an error can name the real character; valid keys are ASCII anyway.
                header = value.decode("utf-8", "surrogateescape")
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"content-length":
                content_length = value
            elif name == b"authorization":
                authorization = value
        check = engine.duplicate_key(header) if duplicate and header else engine.check(
            method, path, header
        )
        if isinstance(check, (MissingKey, InvalidKey)):
            answer = engine.rejection(check)
            engine.log_decision(answer.decision, method, path, answer.status, started)
            await _send_answer(send, answer)
            return
        if not isinstance(check, Keyed):  # Unkeyed: no key, and the key is optional here
            engine.log_decision("unkeyed", method, path, 0, started)
            await self.app(scope, receive, send)
            return

        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                declared = -1
            if declared > engine.max_body_size:
                await self._too_large(send, method, path, started)
                return
        try:
            body = await _read_body(receive, engine.max_body_size)
        except _ClientGone:
            engine.log_decision("disconnect", method, path, 0, started)
            return
        if body is None:
            await self._too_large(send, method, path, started)
            return

        headers: dict[str, str]
        if engine.scope is scope_from_authorization:
            # The default scope reads Authorization only: no need to decode every header.
            headers = {}
            if authorization is not None:
                headers["authorization"] = authorization.decode("latin-1")
        else:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode("latin-1")
        req = RequestState(
            method,
            path,
            key_hash(engine.scope(headers), check.key),
            fingerprint(method, path, query, body, content_type),
            started,
        )
        replay_receive = _BodyReceive(body, receive)
        try:
            answer_or_run = await adrive(engine.admit(req), self.store)
        except StoreError as exc:
            if engine.fail_open:
                engine.log_decision(
                    "fail-open", method, path, 0, started, req.key_hash,
                    level=logging.WARNING, error=repr(exc),
                )
                await self.app(scope, replay_receive, send)
                return
            answer = engine.store_unavailable()
            engine.log_decision(
                answer.decision, method, path, answer.status, started, req.key_hash,
                level=logging.WARNING, error=repr(exc),
            )
            await _send_answer(send, answer)
            return
        if answer_or_run is not None:
            engine.log_decision(
                answer_or_run.decision, method, path, answer_or_run.status, started, req.key_hash
            )
            await _send_answer(send, answer_or_run)
            return

        responder = _Responder(engine, self.store, req, send, self._begin_effect)
        scope[SCOPE_KEY] = responder.state  # lets the app say "outcome unknown"
        try:
            await self.app(scope, replay_receive, responder.send)
        except BaseException as exc:
            await responder.abort(exc)
            raise
        if not responder.finalized:
            # The app returned without finishing a response (client gone, app bug): release.
            await responder.abort(None)

    async def _too_large(self, send: Send, method: str, path: str, started: float) -> None:
        answer = self._engine.body_too_large()
        self._engine.log_decision(answer.decision, method, path, answer.status, started)
        await _send_answer(send, answer)


class _Responder:
    """Per-request: forwards the response unchanged, keeps a copy, and completes or releases
    the key just before the last body chunk leaves (so a completed response is durable before
    the client can see it)."""

    __slots__ = (
        "_opener",
        "capture",
        "engine",
        "finalized",
        "req",
        "state",
        "store",
        "wrapped",
    )

    def __init__(
        self,
        engine: Engine,
        store: AsyncKeyStore,
        req: RequestState,
        send: Send,
        opener: Callable[[], Any],
    ) -> None:
        self.engine = engine
        self.store = store
        self.req = req
        self.wrapped = send
        self.capture = Capture(engine.max_replay_size)
        self.finalized = False
        self._opener = opener
        # scope[SCOPE_KEY]: "outcome unknown" and transaction() (SPEC §4 transactional mode).
        self.state: dict[str, Any] = {"begin_effect": self._begin_effect}

    def _begin_effect(self) -> Any:
        if self.finalized:
            raise ConfigurationError(
                "transaction() called after the response ended", option="transaction"
            )
        return self._opener()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            capture = self.capture
            capture.add(message.get("body", b""))
            if not message.get("more_body", False) and not self.finalized:
                capture.complete = True
                await self._finalize()
        elif kind == "http.response.start":
            self.capture.status = message["status"]
            self.capture.headers = message.get("headers") or ()
        await self.wrapped(message)

    async def _finalize(self) -> None:
        self.finalized = True
        state = self.state
        unknown = outcome_unknown(state)
        if "effect" in state:
            await self._end_effect(unknown, None)
            return
        await adrive(self.engine.conclude(self.req, self.capture, unknown=unknown), self.store)

    async def _end_effect(self, unknown: bool, exc: BaseException | None) -> None:
        """Transactional mode: commit or roll back the handler's transaction (in a thread:
        its connection blocks), then release the key if that is what is left to do."""
        engine = self.engine
        reason = await asyncio.to_thread(
            engine.end_effect,
            self.req,
            self.capture,
            self.state["effect"],
            unknown=unknown,
            doomed=bool(self.state.get("effect_failed")),
        )
        if reason is not None:
            error = reason if exc is None else exc
            conversation = engine.abandon(self.req, self.capture, unknown=False, error=error)
            await adrive(conversation, self.store)

    async def abort(self, exc: BaseException | None) -> None:
        """The handler raised (``exc``) or stopped without a complete response: release."""
        if self.finalized:
            return
        self.finalized = True
        if "effect" in self.state:
            await self._end_effect(outcome_unknown(self.state), exc)
            return
        conversation = self.engine.abandon(
            self.req, self.capture, unknown=outcome_unknown(self.state), error=exc
        )
        await adrive(conversation, self.store)


class _BodyReceive:
    """``receive`` that first hands the app the buffered body, then defers to the server."""

    __slots__ = ("body", "receive", "sent")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body = body
        self.receive = receive
        self.sent = False

    async def __call__(self) -> Message:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self.receive()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when it exceeds ``limit`` bytes.

    Raises:
        _ClientGone: the client disconnected first.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


async def _send_answer(send: Send, answer: Answer) -> None:
    # A copy: outer middleware may append to the list, and some answers are shared constants.
    headers = list(answer.headers)
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
