"""Pure ASGI idempotency middleware (starlette style: config on ``self``, per-request state in a
small responder that wraps ``send``; never ``BaseHTTPMiddleware``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio

from retrysafe._exceptions import StoreError
from retrysafe._heartbeat import AsyncHeartbeat
from retrysafe.core import (
    InvalidKey,
    Keyed,
    MissingKey,
    fingerprint,
    key_hash,
    scope_from_authorization,
)
from retrysafe.observability._timed import store_kind, timed_store
from retrysafe.server._config import IdempotencyConfig, resolve_config
from retrysafe.server._engine import (
    FORWARD,
    INVALID,
    UNRECORDED,
    Answer,
    Capture,
    Claimant,
    Engine,
    RequestState,
    Verdict,
    adrive,
)
from retrysafe.server._outcome import ANSWER_EARLY, SCOPE_KEY, client_stalled, outcome_unknown
from retrysafe.server._transaction import effect_opener
from retrysafe.stores import AsyncKeyStore, KeyStore, as_async_key_store, open_store

__all__ = ["IdempotencyMiddleware"]

# Transactional mode's commits run on threads of their own, never on the loop's default
# executor: a handler that waits there for the database lock (SQLite: another request's
# open transaction) must not take the thread the lock holder's commit needs, or every
# commit waits out the busy timeout (seen with asyncio.to_thread handlers under load).
_EFFECT_THREADS = 16
_effect_pool: ThreadPoolExecutor | None = None
_effect_pool_lock = threading.Lock()


def _effect_executor() -> ThreadPoolExecutor:
    global _effect_pool
    with _effect_pool_lock:
        if _effect_pool is None:
            _effect_pool = ThreadPoolExecutor(
                _EFFECT_THREADS, thread_name_prefix="retrysafe-effect-commit"
            )
        return _effect_pool

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _ClientGone(Exception):
    """The client disconnected while the request body was being read."""


# What a server's ``send`` raises once the client has gone: uvicorn's ClientDisconnected is an
# OSError; anyio streams (outer BaseHTTPMiddleware layers) raise these.
_SEND_ERRORS = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)
_DISCONNECT: Message = {"type": "http.disconnect"}
# Background records (SPEC §3 "Record before answer"): strong references until they finish.
_BACKGROUND: set[asyncio.Task[None]] = set()


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
        original = self._owned if isinstance(store, str) else store
        self._begin_effect = effect_opener(original)
        self.store = timed_store(self.store, self.config.telemetry, store_kind(original))
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
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            body = message.get("body", b"")  # the common case: the whole body in one message
            if len(body) > engine.max_body_size:
                body = None
        else:
            try:
                body = await _read_body(message, receive, engine.max_body_size)
            except _ClientGone:
                engine.log_decision("disconnect", method, path, 0, started)
                return
        if body is None:
            await self._too_large(send, method, path, started)
            return

        owner: str
        if engine.scope is not scope_from_authorization:
            owner = engine.scope(
                {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            )
        elif authorization is None:
            owner = ""  # what the default scope says without Authorization
        else:
            # The default scope reads Authorization only: no need to decode every header.
            owner = scope_from_authorization({"authorization": authorization.decode("latin-1")})
        query = scope.get("query_string", b"").decode("latin-1")
        req = RequestState(
            method,
            path,
            key_hash(owner, check.key),
            fingerprint(method, path, query, body, content_type),
            started,
        )
        try:
            answer_or_run = await adrive(engine.admit(req), self.store)
        except StoreError as exc:
            if engine.fail_open:
                engine.log_decision(
                    "fail-open", method, path, 0, started, req.key_hash,
                    level=logging.WARNING, error=repr(exc),
                )
                await self.app(scope, _BodyReceive(body, receive), send)
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
            # The responder is the app's send (a callable: no bound method per request).
            await self.app(scope, _BodyReceive(body, responder), responder)
        except BaseException as exc:
            kept = await responder.abort(exc)
            if kept and isinstance(exc, asyncio.CancelledError):
                await responder.stopped()
            raise
        await responder.close()

    async def _too_large(self, send: Send, method: str, path: str, started: float) -> None:
        answer = self._engine.body_too_large()
        self._engine.log_decision(answer.decision, method, path, answer.status, started)
        await _send_answer(send, answer)


class _Responder(Claimant):
    """Per-request: the app's ``send``. Renews the lease while the app runs, forwards the
    response, keeps a copy, and records it before the end of the answer leaves (SPEC §3).

    * Record before answer: the start message waits for the first body message; a body
      message that ends the response (``more_body`` false), or that completes a declared
      ``Content-Length``, waits until the key is completed. If the record cannot land the
      client gets 503 ``store-unavailable`` instead (or, when part of a streamed answer already
      left, the connection is cut before its end) and the record is retried in the background.
    * The record starts once the app has returned (:meth:`close`), so the app's frames are
      gone before the store round trip instead of living through it (fewer objects for the
      garbage collector to walk); an app that goes on after its answer (background tasks) has
      it recorded and sent meanwhile, from the next event-loop iteration on. The ASGI call
      never returns before the answer is sent or replaced.
    * Client gone: a ``send`` that fails because the client left is swallowed; the app runs on
      and its whole answer is captured and recorded, so the retry gets the replay. The app's
      ``receive`` never reports the disconnect before the response ends.
    """

    __slots__ = (
        "_ended",
        "_recording",
        "_soon",
        "answered",
        "beat",
        "gone",
        "held",
        "length",
        "sent",
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
        super().__init__(engine, store, req, opener)
        self.wrapped = send
        self.gone = False  # the client went away: nothing more is forwarded
        self.sent = False  # something of the answer reached the server's send
        self.held: list[Message] = []  # messages waiting for the record
        self.length = -1  # the declared Content-Length, or -1
        self._ended: asyncio.Event | None = None
        self.answered = False  # the end of the answer reached the server (or was replaced)
        self._soon: asyncio.Handle | None = None  # the record, due at the next loop iteration
        self._recording: asyncio.Task[None] | None = None  # the record, started meanwhile
        self.beat: AsyncHeartbeat = self.heartbeat(AsyncHeartbeat, self._renew)
        # A cycle (state, method, responder) that end() breaks: every request reaches it.
        self.state[ANSWER_EARLY] = self.answer_early

    async def _renew(self) -> bool:
        if self.write_locked():
            return True
        return await adrive(self.engine.renew(self.req), self.store)

    async def wait_end(self) -> Message:
        """The app's ``receive`` once its body was read: ``http.disconnect``, but only once
        the end of the response has been handed to the server (or replaced), as a real
        server would say it — so a departed client never makes the app stop half-way, and the
        app (Starlette's disconnect listener) never cancels its own answer mid-record."""
        if not self.answered:
            if self._ended is None:
                self._ended = asyncio.Event()
            await self._ended.wait()
        return _DISCONNECT

    async def __call__(self, message: Message) -> None:
        """The app's ``send``."""
        kind = message["type"]
        if kind == "http.response.body":
            if self.finalized:
                return  # after the end, or after abort: nothing more belongs to this answer
            capture = self.capture
            capture.add(message.get("body", b""))
            if message.get("more_body", False):
                if 0 <= self.length <= capture.size:
                    self.held.append(message)  # completes the declared body: wait for the record
                else:
                    beat = self.beat
                    beat.wait_begins()  # the client's time, not the app's
                    try:
                        await self._forward(message)
                    finally:
                        beat.wait_ends()
                return
            capture.complete = True
            self.held.append(message)
            # The end waits for the record, which starts when the app returns (close()) or,
            # if it goes on first, at the next loop iteration (_record_meanwhile).
            self.end()
            self._soon = asyncio.get_running_loop().call_soon(self._record_meanwhile)
        elif kind == "http.response.start":
            capture = self.capture
            capture.status = message["status"]
            capture.headers = message.get("headers") or ()
            self.length = _content_length(capture.headers)
            self.held.append(message)
        else:
            await self._forward(message)

    async def _forward(self, message: Message | None) -> None:
        """Send the held messages and ``message``, unless the client has gone."""
        if not self.gone and client_stalled(self.state):
            self._gone("the client took no part of the answer for too long (the app said so)")
        if self.gone:
            self.held = []
            return
        held = self.held
        try:
            if held:
                self.held = []
                for m in held:
                    self.sent = True
                    await self.wrapped(m)
            if message is not None:
                self.sent = True
                await self.wrapped(message)
        except _SEND_ERRORS as exc:
            self._gone(repr(exc))

    async def answer_early(
        self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> float | None:
        """:func:`~retrysafe.server._outcome.answer_early`: ``status``, ``headers`` and
        ``body`` go to the client now, unrecorded; the app's own answer is then captured and
        recorded, never sent. The seconds of renewal left, or None (nothing sent)."""
        engine = self.engine
        req = self.req
        early = Capture(len(body))
        early.status, early.headers = status, headers
        early.add(bytes(body))
        fault = engine.answer_fault(req, early)
        if fault is not None:
            raise ValueError(f"early answer refused, nothing sent: {fault}")
        if self.finalized or self.sent or self.gone or self.held:
            return None
        left = engine.timing.renewed_for(req.claimed_at, engine.clock())
        if left <= 0:
            return None
        self.gone = True  # nothing of the app's own answer is sent from now on
        self.state.pop(ANSWER_EARLY, None)
        engine.log_decision(
            "answered-early", req.method, req.path, status, req.started, req.key_hash,
            level=logging.WARNING, renewed_for=round(left, 3),
            detail="the client got this answer instead of the app's, which is still awaited; "
            "that one is recorded for a retry of the same key (409 until then)",
        )  # fmt: skip
        try:
            await self.wrapped(
                {"type": "http.response.start", "status": status, "headers": list(headers)}
            )
            await self.wrapped({"type": "http.response.body", "body": body})
        except _SEND_ERRORS:
            pass  # the client left first: nothing changes for the record
        return left

    def _gone(self, error: str) -> None:
        """The client left (or stopped taking the answer): nothing more is sent to it."""
        self.gone = True
        self.held = []
        req = self.req
        self.engine.log_decision(
            "client-gone", req.method, req.path, self.capture.status, req.started,
            req.key_hash, level=logging.WARNING, error=error,
            detail="the client left mid-answer; the answer is still captured and recorded",
        )  # fmt: skip

    # -------------------------------------------------------------- the end
    def _answered_now(self) -> None:
        self.answered = True
        if self._ended is not None:
            self._ended.set()

    def _record_meanwhile(self) -> None:
        """The app went on after the end of its answer: record and send it meanwhile."""
        self._soon = None
        self._recording = asyncio.get_running_loop().create_task(self._finalize())

    async def close(self) -> None:
        """The app returned: record and send its answer (or wait for that to finish); an
        answer the app never finished releases the key, or keeps it claimed as
        outcome-unknown when it had started (SPEC §4)."""
        soon = self._soon
        if soon is not None:
            soon.cancel()
            self._soon = None
            await self._finalize()
        elif self._recording is not None:
            await self._recording
        elif not self.finalized and await self.abort(None):
            # The app returned without finishing its response (an app bug, or an app that
            # gave up): released if nothing had started, else (here) the outcome is
            # unknown; when none of it left, the client is told so, not the server's 500.
            await self._replace(INVALID)

    async def _finalize(self) -> None:
        beat = self.beat
        beat.bounded = False  # the handler is done; only its record may still be pending
        state = self.state
        unknown = outcome_unknown(state)
        verdict: Verdict = FORWARD
        try:
            if "effect" in state:
                verdict = await self._end_effect(unknown, None)
                unknown = False  # rolled back: nothing is left to keep claimed
            else:
                try:
                    verdict = await adrive(
                        self.engine.conclude(self.req, self.capture, unknown=unknown), self.store
                    )
                except asyncio.CancelledError:
                    # The server stopped mid-record (its shutdown grace ran out): whether the
                    # record landed is unknown, and the handler acted; say so for this key.
                    self.engine.log_unknown(
                        self.req,
                        self.capture.status,
                        error="the server stopped while the answer was being recorded",
                    )
                    raise
        finally:
            if verdict == UNRECORDED and self.req.pending is not None:
                task = asyncio.get_running_loop().create_task(self._record_later())
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)
            elif unknown or (verdict == INVALID and "effect" not in state):
                beat.bounded = True  # outcome unknown: claimed, renewed up to max_run_time
            else:
                beat.stop()
        try:
            if verdict == FORWARD:
                await self._forward(None)
            else:
                await self._replace(verdict)
        finally:
            self._answered_now()

    async def _record_later(self) -> None:
        try:
            await adrive(self.engine.record_later(self.req), self.store)
        finally:
            self.beat.stop()

    async def _replace(self, verdict: Verdict) -> None:
        """The answer may not be seen: answer for it if nothing left yet, else cut it short."""
        self.held = []
        if self.sent or self.gone:
            return  # the server closes the connection before the end: the client retries
        engine = self.engine
        answer = engine.instead_of(self.req, verdict)
        try:
            await _send_answer(self.wrapped, answer)
        except _SEND_ERRORS:
            self.gone = True

    async def _end_effect(self, unknown: bool, exc: BaseException | None) -> Verdict:
        """Transactional mode: commit or roll back the handler's transaction (in a thread:
        its connection blocks), then release the key if that is what is left to do."""
        engine = self.engine
        verdict, reason = await asyncio.get_running_loop().run_in_executor(
            _effect_executor(),
            functools.partial(
                engine.end_effect,
            self.req,
            self.capture,
            self.state["effect"],
                unknown=unknown,
                doomed=bool(self.state.get("effect_failed")),
            ),
        )
        if reason is not None:
            error = reason if exc is None else exc
            conversation = engine.abandon(
                self.req, self.capture, unknown=False, error=error, undone=True
            )
            await adrive(conversation, self.store)
        return verdict

    async def abort(self, exc: BaseException | None) -> bool:
        """The app raised (``exc``) or returned without ending its response: release the key,
        or keep it claimed as outcome-unknown when the response had started (SPEC §4). An
        answer that had ended before the app raised is recorded and sent (:meth:`close`).
        True when the key was kept claimed as outcome-unknown."""
        if self.finalized:
            if self._soon is not None or self._recording is not None:
                await self.close()
            return False
        self.end()
        self._answered_now()
        self.held = []  # the end of an unfinished answer never leaves
        kept = False
        try:
            if "effect" in self.state:
                await self._end_effect(outcome_unknown(self.state), exc)
                return False
            # Cancelled (the server's shutdown grace ran out): the handler may have made its
            # effect, so the key stays claimed as after a crash, never released for a retry
            # to run it again (a fresh user's check: 7 of 7 gateway stops ran it twice).
            unknown = outcome_unknown(self.state) or isinstance(exc, asyncio.CancelledError)
            conversation = self.engine.abandon(self.req, self.capture, unknown=unknown, error=exc)
            kept = await adrive(conversation, self.store)
        finally:
            if not kept:  # outcome unknown: claimed, renewed up to max_run_time
                self.beat.stop()
        return kept

    async def stopped(self) -> None:
        """The server cancelled the request (its shutdown grace ran out) after the key was
        kept as outcome-unknown: if none of the answer left, say so (503 ``server-stopped``,
        retry with the same key) instead of the server's bare 500."""
        if self.sent or self.gone:
            return
        try:
            await _send_answer(self.wrapped, self.engine.stopped())
        except _SEND_ERRORS:
            self.gone = True


class _BodyReceive:
    """``receive`` that first hands the app the buffered body, then defers to ``after``: the
    server's ``receive``, or a responder's :meth:`_Responder.wait_end`."""

    __slots__ = ("after", "body", "sent")

    def __init__(self, body: bytes, after: Receive | _Responder) -> None:
        self.body = body
        self.after = after
        self.sent = False

    async def __call__(self) -> Message:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        after = self.after
        if isinstance(after, _Responder):
            return await after.wait_end()
        return await after()


def _content_length(headers: Any) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


async def _read_body(message: Message, receive: Receive, limit: int) -> bytes | None:
    """The whole request body, starting with its first ``message``, or None when it exceeds
    ``limit`` bytes.

    Raises:
        _ClientGone: the client disconnected first.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
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
        message = await receive()
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


async def _send_answer(send: Send, answer: Answer) -> None:
    # A copy: outer middleware may append to the list, and some answers are shared constants.
    headers = list(answer.headers)
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
