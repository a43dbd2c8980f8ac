"""The Django idempotency middleware: the server engine (SPEC §3, §4) driven by Django's
request/response cycle, sync or async (Django's middleware conventions).

One conversation per request, written once as a generator (the engine's pattern): it yields
*store work* (a callable that touches the database) and :data:`_VIEW` (call the rest of the
stack); the sync face runs the work inline, the async face in Django's thread
(``sync_to_async(thread_sensitive=True)``, where Django keeps the request's connection). The
key's claim, completion and release are the engine's; the per-request bookkeeping is the WSGI
driver's ``_Run`` (lease heartbeat, record before answer, transactional mode).
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.http import HttpRequest, HttpResponse, UnreadablePostError
from django.http.response import HttpResponseBase

from retrysafe._exceptions import (
    ConfigurationError,
    RetrysafeWarning,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import InvalidKey, Keyed, MissingKey, fingerprint, key_hash
from retrysafe.observability._timed import timed_store
from retrysafe.server._engine import FENCED, FORWARD, Answer, Engine, RequestState, Verdict, drive
from retrysafe.server._outcome import SCOPE_KEY
from retrysafe.server._transaction import effect_opener
from retrysafe.server._wsgi import _incomplete_body, _Run
from retrysafe.stores import KeyStore, open_store
from retrysafe.stores._url_check import redact_url

from ._settings import SETTING, DjangoSettings, load_settings
from ._store import DeferredStore, DjangoStore

__all__ = ["IdempotencyMiddleware"]

log = logging.getLogger("retrysafe.server")

#: The conversation's request to call the rest of the stack (the view).
_VIEW = object()
Step = Any  # a callable (store work) or _VIEW


def _open(settings: DjangoSettings) -> KeyStore:
    kind, where = settings.store
    if kind == "django":
        from django.apps import apps

        if not apps.is_installed("retrysafe.django"):
            raise ImproperlyConfigured(
                f"{SETTING}['STORE'] is {'django' if where == 'default' else 'django:' + where!r}"
                ": add 'retrysafe.django' to INSTALLED_APPS (its migration creates the keys' "
                "tables: python manage.py migrate retrysafe), or give a store URL"
            )
    try:
        store: Any = DjangoStore(where) if kind == "django" else _open_url(where)
    except ConfigurationError as exc:
        raise ImproperlyConfigured(f"{SETTING}['STORE']: {exc}") from exc
    if not isinstance(store, KeyStore):
        raise ImproperlyConfigured(f"{SETTING}['STORE']: {store!r} is not a sync key store")
    return store


def _open_url(url: str) -> Any:
    """The store a URL names; one that cannot be reached now is opened on first use (until
    then protected requests get 503, or run unprotected with FAIL_OPEN), so a store that is
    down does not keep the whole site from starting."""
    try:
        return open_store(url)
    except StoreUnavailableError as exc:
        log.warning(
            "retrysafe store %s is unreachable at startup (%s); protected requests get 503 "
            "store-unavailable until it is",
            redact_url(url),
            exc,
        )
        return DeferredStore(url)


def _repeated_key_header(request: HttpRequest) -> bool:
    """Whether the request carried more than one ``Idempotency-Key`` header: ambiguous, so
    malformed (as the ASGI middleware answers). Django joins repeated headers with commas
    into one value; under ASGI the raw header list is still there to count. (Under WSGI the
    server joined them already: the joined value is what the key is, as for the WSGI
    middleware.)"""
    scope = getattr(request, "scope", None)
    if not isinstance(scope, dict):
        return False
    seen = 0
    for name, _value in scope.get("headers", ()):
        if name.lower() == b"idempotency-key":
            seen += 1
    return seen > 1


def _csrf_installed() -> bool:
    """Whether ``MIDDLEWARE`` has Django's CSRF check (or a subclass of it)."""
    from django.middleware.csrf import CsrfViewMiddleware
    from django.utils.module_loading import import_string

    for path in getattr(django_settings, "MIDDLEWARE", None) or ():
        try:
            cls = import_string(path)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, CsrfViewMiddleware):
            return True
    return False


def _csrf_refused(request: HttpRequest) -> bool:
    """A 403 from Django's CSRF check, not from the view: the check (``process_view``, which
    runs inside the middleware chain whatever the order) marks every request it lets through
    ``csrf_processing_done``, and a ``csrf_exempt`` view is never checked."""
    if getattr(request, "csrf_processing_done", False):
        return False
    match = getattr(request, "resolver_match", None)
    view = getattr(match, "func", None)
    return not getattr(view, "csrf_exempt", False)


def _answer(answer: Answer) -> HttpResponse:
    """The middleware's own answer (a problem or a replay) as a Django response."""
    response = HttpResponse(answer.body, status=answer.status)
    del response["Content-Type"]  # Django's default; the answer carries its own
    for name, value in answer.str_headers():
        response[name] = value
    return response


class _DjangoRun(_Run):
    """The WSGI driver's per-request run (heartbeat, record before answer, transactional
    mode), with its background work (renewals, a record retried later) on borrowed
    connections: threads Django does not manage close what they open."""

    __slots__ = ("borrowed",)

    def __init__(
        self,
        engine: Engine,
        store: Any,
        req: RequestState,
        opener: Callable[[], Any],
        borrowed: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self.borrowed = borrowed
        super().__init__(engine, store, req, opener, _no_start_response)

    def _renew(self) -> bool:
        with self.borrowed():
            return super()._renew()

    def _record_later(self) -> None:
        with self.borrowed():
            super()._record_later()

    def open_effect(self) -> None:
        """Transactional mode: open the view's transaction before the view runs."""
        self.state["effect"] = self.state["begin_effect"]()


def _no_start_response(*args: Any) -> Any:  # pragma: no cover - never called
    raise AssertionError("the Django run has no start_response")


class IdempotencyMiddleware:
    """Django middleware that makes protected requests safe to retry (SPEC §3, §4).

    Add it to ``MIDDLEWARE`` after ``AuthenticationMiddleware`` (so a ``SCOPE`` function can
    use ``request.user``) and configure it with the ``RETRYSAFE`` setting (see
    :mod:`retrysafe.django`). The behaviour and the answers are those of
    :class:`retrysafe.server.IdempotencyMiddleware`: the same engine decides. It works under
    WSGI and ASGI (Django picks the sync or async face).

    A protected request with a new key runs the view once; a repeat with the same key and
    request gets the stored answer (``Idempotent-Replayed: true``); a repeat while the first
    runs gets 409 ``request-in-progress``; the same key with another request 422
    ``key-reused``; a store that fails 503 ``store-unavailable`` (nothing run). The answer is
    recorded before it is sent.

    Raises:
        ImproperlyConfigured: (at startup, when Django builds the middleware chain) the
            ``RETRYSAFE`` setting is invalid or names a store that cannot be opened.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
        settings = load_settings(getattr(django_settings, SETTING, None))
        upload = getattr(django_settings, "DATA_UPLOAD_MAX_MEMORY_SIZE", None)
        if isinstance(upload, int) and settings.config.max_body_size > upload:
            warnings.warn(
                f"{SETTING}['MAX_BODY_SIZE'] ({settings.config.max_body_size} bytes) is above "
                f"Django's DATA_UPLOAD_MAX_MEMORY_SIZE ({upload} bytes): keyed bodies between "
                "the two get 413 body-too-large; raise DATA_UPLOAD_MAX_MEMORY_SIZE too",
                RetrysafeWarning,
                stacklevel=2,
            )
        raw_store = _open(settings)
        self.store: Any = timed_store(raw_store, settings.config.telemetry)
        self._engine = Engine(settings.config)
        self._methods = self._engine.protected_methods
        self._scope = settings.scope
        self._transactional = settings.transactional
        self._begin_effect = effect_opener(raw_store)
        self._csrf = _csrf_installed()
        self._borrowed: Callable[[], AbstractContextManager[None]] = (
            raw_store.connector.borrowed if isinstance(raw_store, DjangoStore) else nullcontext
        )

    # ------------------------------------------------------------------ the two faces
    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        if request.method not in self._methods:
            return self.get_response(request)
        conversation = self._conversation(request)
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = conversation.send(value) if error is None else conversation.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = self.get_response(request) if step is _VIEW else step()
            except BaseException as exc:  # the conversation releases the key, re-raises
                error = exc

    async def __acall__(self, request: HttpRequest) -> Any:
        if request.method not in self._methods:
            return await self.get_response(request)
        conversation = self._conversation(request)
        value: Any = None
        error: BaseException | None = None
        # Django cancels the request's task when the client leaves. Under a claimed key the
        # view may be mid-effect then, so every step runs to its end (the view too: its
        # answer is recorded and the retry gets the replay, as the WSGI driver drains a
        # response nobody reads), and the cancellation is re-raised once the key is settled.
        cancelled = False
        while True:
            try:
                step = conversation.send(value) if error is None else conversation.throw(error)
            except StopIteration as stop:
                if cancelled:
                    await _finish_unread(stop.value)
                    raise asyncio.CancelledError from None
                return stop.value
            value, error = None, None
            try:
                if step is not _VIEW:  # store work: a statement is never left half-driven
                    work = sync_to_async(step, thread_sensitive=True)()
                    value, interrupted = await _to_the_end(asyncio.ensure_future(work))
                elif SCOPE_KEY in request.META:  # the view of a claimed key
                    view = asyncio.ensure_future(self.get_response(request))
                    value, interrupted = await _to_the_end(view)
                else:  # unkeyed, or failing open: nothing to settle, cancel as Django asks
                    value, interrupted = await self.get_response(request), False
                cancelled = cancelled or interrupted
            except BaseException as exc:  # the conversation releases the key, re-raises
                error = exc

    # ------------------------------------------------------------------ the conversation
    def _conversation(self, request: HttpRequest) -> Generator[Step, Any, HttpResponseBase]:
        engine = self._engine
        started = time.perf_counter()
        method = str(request.method)
        path = request.path
        header = request.META.get("HTTP_IDEMPOTENCY_KEY")
        if header is not None and not header.isascii():
            # Headers arrive as latin-1 (PEP 3333, and Django's ASGI request): re-read as
            # UTF-8 so an error names the real character. Valid keys are ASCII.
            header = header.encode("latin-1", "replace").decode("utf-8", "surrogateescape")
        if header is not None and _repeated_key_header(request):
            check: Any = engine.duplicate_key(header)
        else:
            check = engine.check(method, path, header)
        if isinstance(check, (MissingKey, InvalidKey)):
            answer = engine.rejection(check)
            engine.log_decision(answer.decision, method, path, answer.status, started)
            return _answer(answer)
        if not isinstance(check, Keyed):  # no key, and the key is optional here
            engine.log_decision("unkeyed", method, path, 0, started)
            response = cast(HttpResponseBase, (yield _VIEW))
            return response

        body = self._body(request, engine)
        if isinstance(body, Answer):
            engine.log_decision(body.decision, method, path, body.status, started)
            return _answer(body)
        headers = {k.lower(): v for k, v in request.headers.items()}
        if self._scope is not None:
            owner = self._scope(request)
            if not isinstance(owner, str):
                raise TypeError(
                    f"{SETTING}['SCOPE'] must return a str, returned {type(owner).__name__}"
                )
        else:
            owner = engine.scope(headers)
        req = RequestState(
            method,
            path,
            key_hash(owner, check.key),
            fingerprint(
                method,
                path,
                request.META.get("QUERY_STRING", ""),
                body,
                request.META.get("CONTENT_TYPE") or None,
            ),
            started,
        )
        try:
            admitted = yield partial(self._admit, req)
        except StoreError as exc:
            if engine.fail_open:
                engine.log_decision(
                    "fail-open",
                    method,
                    path,
                    0,
                    started,
                    req.key_hash,
                    level=logging.WARNING,
                    error=repr(exc),
                )
                response = cast(HttpResponseBase, (yield _VIEW))
                return response
            answer = engine.store_unavailable()
            engine.log_decision(
                answer.decision,
                method,
                path,
                answer.status,
                started,
                req.key_hash,
                level=logging.WARNING,
                error=repr(exc),
            )
            return _answer(answer)
        if admitted is not None:
            engine.log_decision(
                admitted.decision, method, path, admitted.status, started, req.key_hash
            )
            return _answer(admitted)

        run = _DjangoRun(engine, self.store, req, self._begin_effect, self._borrowed)
        request.META[SCOPE_KEY] = run.state  # mark_outcome_unknown(request.META)
        if self._transactional:
            try:
                yield run.open_effect
            except StoreError as exc:
                yield partial(run.abort, exc)  # released: nothing ran
                return _answer(engine.store_unavailable())
        try:
            response = cast(HttpResponseBase, (yield _VIEW))
        except BaseException as exc:
            yield partial(run.abort, exc)
            raise
        capture = run.capture
        if response.status_code == 403 and self._csrf and _csrf_refused(request):
            req.refused = True  # the view never ran: a retry with the token must run it
        capture.status = response.status_code
        capture.headers = list(response.items())
        if response.streaming:
            return self._stream(response, run)
        capture.add(response.content)  # type: ignore[attr-defined]
        verdict = yield run.finalize
        return self._deliver(response, verdict, run)

    def _admit(self, req: RequestState) -> Answer | None:
        return drive(self._engine.admit(req), self.store)

    @staticmethod
    def _body(request: HttpRequest, engine: Engine) -> bytes | Answer:
        """The whole request body, or the answer that refuses it (too large, cut short)."""
        raw_length = request.META.get("CONTENT_LENGTH") or ""
        try:
            declared = int(raw_length) if raw_length else -1
        except ValueError:
            declared = -1
        if declared > engine.max_body_size:
            return engine.body_too_large()
        try:
            body = request.body
        except RequestDataTooBig:  # over Django's DATA_UPLOAD_MAX_MEMORY_SIZE
            return engine.body_too_large()
        except (UnreadablePostError, OSError) as exc:
            return _incomplete_body(f"reading the body failed: {exc}")
        if len(body) > engine.max_body_size:
            return engine.body_too_large()
        if 0 <= len(body) < declared:
            return _incomplete_body(f"{len(body)} of {declared} bytes arrived")
        return body

    def _deliver(
        self, response: HttpResponseBase, verdict: Verdict, run: _DjangoRun
    ) -> HttpResponseBase:
        """The view's answer if it was recorded, else what to send instead (SPEC §3 record
        before answer)."""
        if verdict == FORWARD:
            return response
        response.close()
        engine = self._engine
        return _answer(engine.instead_of(run.req, verdict))

    # ------------------------------------------------------------------ streaming answers
    def _stream(self, response: Any, run: _DjangoRun) -> HttpResponseBase:
        """A streaming answer flows through, copied; its last chunk waits until the key is
        recorded. A record that cannot land cuts the answer before its end (the client sees
        a broken answer and retries with the same key); a client that leaves mid-answer
        still gets the rest captured and recorded."""
        # The view's own closers (its generator's close, a file's) run after ours: a client
        # that leaves closes the response, and the rest must be drained before its source
        # is closed.
        closers = list(getattr(response, "_resource_closers", ()))
        if closers:
            response._resource_closers.clear()
        if response.is_async:
            response.streaming_content = self._astream(response.streaming_content, run)
        else:
            response.streaming_content = self._sync_stream(response.streaming_content, run)
        if closers:
            response._resource_closers.extend(closers)
        return cast(HttpResponseBase, response)

    @staticmethod
    def _sync_stream(content: Iterator[bytes], run: _DjangoRun) -> Iterator[bytes]:
        capture = run.capture
        held: bytes | None = None
        try:
            for chunk in content:
                capture.add(chunk)
                if held is not None:
                    yield held
                held = chunk
        except GeneratorExit:
            _drain(content, run)
            raise
        except BaseException as exc:
            run.abort(exc)
            raise
        verdict = run.finalize()
        if verdict != FORWARD:
            raise StoreError(
                "the answer could not be recorded, so its end is not sent "
                f"({'lease taken over' if verdict == FENCED else 'store unavailable'})"
            )
        if held is not None:
            yield held

    @staticmethod
    async def _astream(content: AsyncIterator[bytes], run: _DjangoRun) -> AsyncIterator[bytes]:
        # The view's stream is read by a task of its own, so a client that leaves (Django
        # cancels the task sending the answer, or closes this generator) interrupts only the
        # sending: the rest is still read, captured and recorded.
        capture = run.capture
        chunks: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)

        async def read() -> None:
            try:
                async for chunk in content:
                    capture.add(chunk)
                    await chunks.put(chunk)
            except BaseException as exc:
                await chunks.put(_Failed(exc))
                return
            await chunks.put(_END)

        reader = asyncio.ensure_future(read())
        held: bytes | None = None
        try:
            while (item := await chunks.get()) is not _END:
                if isinstance(item, _Failed):
                    await sync_to_async(run.abort, thread_sensitive=True)(item.error)
                    raise item.error
                if held is not None:
                    yield held
                held = item
        except (GeneratorExit, asyncio.CancelledError):
            while (item := await chunks.get()) is not _END:
                if isinstance(item, _Failed):
                    await sync_to_async(run.abort, thread_sensitive=True)(item.error)
                    raise
            await reader
            await sync_to_async(_client_gone, thread_sensitive=True)(run)
            raise
        verdict = await sync_to_async(run.finalize, thread_sensitive=True)()
        if verdict != FORWARD:
            raise StoreError(
                "the answer could not be recorded, so its end is not sent "
                f"({'lease taken over' if verdict == FENCED else 'store unavailable'})"
            )
        if held is not None:
            yield held


_END = object()


class _Failed:
    """The view's stream raised ``error`` (passed from the reading task)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def _to_the_end(work: asyncio.Future[Any]) -> tuple[Any, bool]:
    """``work``'s result, awaited to its end even when this task is cancelled meanwhile.

    Returns:
        ``(result, cancelled)``: whether a cancellation arrived (and was held back).
    """
    cancelled = False
    while True:
        try:
            return await asyncio.shield(work), cancelled
        except asyncio.CancelledError:
            if work.cancelled():
                raise
            cancelled = True


async def _finish_unread(response: Any) -> None:
    """A cancelled request's answer, which nobody will send: a streaming one is read to its
    end (its wrapper records it), then the response is closed."""
    if getattr(response, "streaming", False):
        if response.is_async:
            async for _chunk in response.streaming_content:
                pass
        else:
            await sync_to_async(_exhaust, thread_sensitive=True)(response.streaming_content)
    await sync_to_async(response.close, thread_sensitive=True)()


def _exhaust(chunks: Iterator[bytes]) -> None:
    for _chunk in chunks:
        pass


def _drain(content: Iterator[bytes], run: _DjangoRun) -> None:
    """The client left mid-answer: let the view finish, capture the rest and record it, so
    the retry gets the replay (as the WSGI driver does)."""
    try:
        for chunk in content:
            run.capture.add(chunk)
    except Exception as exc:
        run.abort(exc)
        return
    _client_gone(run)


def _client_gone(run: _DjangoRun) -> None:
    req = run.req
    run.engine.log_decision(
        "client-gone",
        req.method,
        req.path,
        run.capture.status,
        req.started,
        req.key_hash,
        level=logging.WARNING,
        detail="the client left before the end of the answer; it was captured to the end "
        "and is recorded",
    )
    run.finalize()
