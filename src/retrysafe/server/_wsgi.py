"""WSGI idempotency middleware (PEP 3333): the same engine as the ASGI one, driven synchronously."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from retrysafe._exceptions import ConfigurationError, StoreError
from retrysafe.core import InvalidKey, Keyed, MissingKey, fingerprint, key_hash
from retrysafe.server._config import IdempotencyConfig, resolve_config
from retrysafe.server._engine import Capture, Engine, RequestState, drive
from retrysafe.server._outcome import SCOPE_KEY, outcome_unknown
from retrysafe.server._transaction import effect_opener
from retrysafe.stores import KeyStore, open_store

__all__ = ["WSGIIdempotencyMiddleware"]

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_READ_CHUNK = 64 * 1024


class WSGIIdempotencyMiddleware:
    """WSGI middleware that makes protected requests safe to retry (SPEC §3, §4).

    The behaviour, configuration and answers are those of
    :class:`~retrysafe.server.IdempotencyMiddleware` (one shared engine); only the I/O differs.
    The response iterable streams through with a one-chunk look-ahead, so the key is completed
    before the last chunk is handed to the server; the app iterable's ``close()`` is always
    called.

    Usage with Flask::

        app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, "sqlite:///keys.db")

    Args:
        app: the WSGI application to protect.
        store: a sync :class:`~retrysafe.stores.KeyStore` or a store URL.
        config: an :class:`IdempotencyConfig`; or pass its fields as keyword ``options``.

    Raises:
        ConfigurationError: invalid options, both ``config`` and options, a bad store URL, or a
            store without the sync :class:`~retrysafe.stores.KeyStore` methods.
    """

    def __init__(
        self,
        app: WSGIApp,
        /,
        store: KeyStore | str,
        *,
        config: IdempotencyConfig | None = None,
        **options: Any,
    ) -> None:
        self.app = app
        self.config = resolve_config(config, options)
        self._owned: Any = None
        if isinstance(store, str):
            store = self._owned = open_store(store)
        if not isinstance(store, KeyStore):
            raise ConfigurationError(
                f"{store!r} is not a sync KeyStore; WSGI needs one", option="store"
            )
        self.store = store
        self._begin_effect = effect_opener(store)
        self._engine = Engine(self.config)
        self._methods = self._engine.protected_methods

    def close(self) -> None:
        """Close the store if this middleware opened it from a URL. Idempotent."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        method: str = environ["REQUEST_METHOD"]
        if method not in self._methods:
            return self.app(environ, start_response)
        started = time.perf_counter()
        engine = self._engine
        raw_path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        path = raw_path.encode("latin-1", "replace").decode("utf-8", "replace")
        header = environ.get("HTTP_IDEMPOTENCY_KEY")
        if header is not None and not header.isascii():
            # PEP 3333 hands bytes over as latin-1; re-read as UTF-8 so an error names the
            # real character. Valid keys are ASCII, so nothing valid changes.
            header = header.encode("latin-1").decode("utf-8", "surrogateescape")
        check = engine.check(method, path, header)
        if isinstance(check, (MissingKey, InvalidKey)):
            answer = engine.rejection(check)
            engine.log_decision(answer.decision, method, path, answer.status, started)
            start_response(answer.status_line, answer.str_headers())
            return [answer.body]
        if not isinstance(check, Keyed):  # Unkeyed: no key, and the key is optional here
            engine.log_decision("unkeyed", method, path, 0, started)
            return self.app(environ, start_response)

        body = _read_body(environ, engine.max_body_size)
        if body is None:
            answer = engine.body_too_large()
            engine.log_decision(answer.decision, method, path, answer.status, started)
            start_response(answer.status_line, answer.str_headers())
            return [answer.body]
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))

        content_type: str | None = environ.get("CONTENT_TYPE") or None
        req = RequestState(
            method,
            path,
            key_hash(engine.scope(_headers(environ)), check.key),
            fingerprint(method, path, environ.get("QUERY_STRING", ""), body, content_type),
            started,
        )
        try:
            answer_or_run = drive(engine.admit(req), self.store)
        except StoreError as exc:
            if engine.fail_open:
                engine.log_decision(
                    "fail-open", method, path, 0, started, req.key_hash,
                    level=logging.WARNING, error=repr(exc),
                )
                return self.app(environ, start_response)
            answer = engine.store_unavailable()
            engine.log_decision(
                answer.decision, method, path, answer.status, started, req.key_hash,
                level=logging.WARNING, error=repr(exc),
            )
            start_response(answer.status_line, answer.str_headers())
            return [answer.body]
        if answer_or_run is not None:
            engine.log_decision(
                answer_or_run.decision, method, path, answer_or_run.status, started, req.key_hash
            )
            start_response(answer_or_run.status_line, answer_or_run.str_headers())
            return [answer_or_run.body]

        run = _Run(engine, self.store, req, self._begin_effect)
        environ[SCOPE_KEY] = run.state  # lets the app say "outcome unknown"

        def capturing_start_response(
            status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
        ) -> Write:
            run.capture.status = int(status.split(" ", 1)[0])
            run.capture.headers = headers
            write = start_response(status, headers, exc_info)

            def capturing_write(data: bytes) -> object:
                run.capture.add(data)
                return write(data)

            return capturing_write

        try:
            result = self.app(environ, capturing_start_response)
        except BaseException as exc:
            run.abort(exc)
            raise
        return _Response(result, run)


class _Run:
    """Per-request state of a handler that runs under a claimed key."""

    __slots__ = ("_opener", "capture", "engine", "finalized", "req", "state", "store")

    def __init__(
        self, engine: Engine, store: KeyStore, req: RequestState, opener: Callable[[], Any]
    ) -> None:
        self.engine = engine
        self.store = store
        self.req = req
        self.capture = Capture(engine.max_replay_size)
        self.finalized = False
        self._opener = opener
        # environ[SCOPE_KEY]: "outcome unknown" and transaction() (SPEC §4 transactional mode).
        self.state: dict[str, Any] = {"begin_effect": self._begin_effect}

    def _begin_effect(self) -> Any:
        if self.finalized:
            raise ConfigurationError(
                "transaction() called after the response ended", option="transaction"
            )
        return self._opener()

    def _end_effect(self, unknown: bool, exc: BaseException | None) -> None:
        """Transactional mode: commit or roll back the handler's transaction, then release
        the key if that is what is left to do."""
        engine = self.engine
        state = self.state
        reason = engine.end_effect(
            self.req,
            self.capture,
            state["effect"],
            unknown=unknown,
            doomed=bool(state.get("effect_failed")),
        )
        if reason is not None:
            error = reason if exc is None else exc
            drive(engine.abandon(self.req, self.capture, unknown=False, error=error), self.store)

    def finalize(self) -> None:
        """The response is complete: complete the key (or release it, per SPEC §4)."""
        self.finalized = True
        self.capture.complete = True
        unknown = outcome_unknown(self.state)
        if "effect" in self.state:
            self._end_effect(unknown, None)
            return
        drive(self.engine.conclude(self.req, self.capture, unknown=unknown), self.store)

    def abort(self, exc: BaseException | None) -> None:
        """The handler raised (``exc``) or the server stopped iterating: release the key."""
        if self.finalized:
            return
        self.finalized = True
        if "effect" in self.state:
            self._end_effect(outcome_unknown(self.state), exc)
            return
        conversation = self.engine.abandon(
            self.req, self.capture, unknown=outcome_unknown(self.state), error=exc
        )
        drive(conversation, self.store)


class _Response:
    """The app's response iterable, streamed with a one-chunk look-ahead and copied."""

    __slots__ = ("_result", "_run")

    def __init__(self, result: Iterable[bytes], run: _Run) -> None:
        self._result = result
        self._run = run

    def __iter__(self) -> Iterator[bytes]:
        run = self._run
        capture = run.capture
        pending = b""
        have = False
        try:
            for chunk in self._result:
                capture.add(chunk)
                if have:
                    yield pending
                pending = chunk
                have = True
        except GeneratorExit:
            raise
        except BaseException as exc:
            run.abort(exc)
            raise
        run.finalize()
        if have:
            yield pending

    def close(self) -> None:
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            # Iteration abandoned before the end (client gone): the next attempt runs again.
            self._run.abort(None)


def _read_body(environ: Environ, limit: int) -> bytes | None:
    """The whole request body, or None when it exceeds ``limit`` bytes."""
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    length = environ.get("CONTENT_LENGTH")
    if length:
        try:
            expected = int(length)
        except ValueError:
            expected = -1
        if expected > limit:
            return None
        if expected >= 0:
            return _read_exactly(stream, expected)
    if not environ.get("wsgi.input_terminated"):
        return b""  # PEP 3333: without a Content-Length there is no body to read
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = stream.read(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


def _read_exactly(stream: Any, n: int) -> bytes:
    if n == 0:
        return b""
    data: bytes = stream.read(n)
    if len(data) >= n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _headers(environ: Environ) -> dict[str, str]:
    """Request headers with lower-case names, rebuilt from the WSGI environ."""
    out = {
        key[5:].replace("_", "-").lower(): value
        for key, value in environ.items()
        if key.startswith("HTTP_")
    }
    if environ.get("CONTENT_TYPE"):
        out["content-type"] = environ["CONTENT_TYPE"]
    if environ.get("CONTENT_LENGTH"):
        out["content-length"] = environ["CONTENT_LENGTH"]
    return out
