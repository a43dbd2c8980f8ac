"""WSGI idempotency middleware (PEP 3333): the same engine as the ASGI one, driven synchronously."""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

from retrysafe._exceptions import ConfigurationError, StoreError, StoreUnavailableError
from retrysafe._heartbeat import Heartbeat
from retrysafe.core import InvalidKey, Keyed, MissingKey, Problem, fingerprint, key_hash
from retrysafe.observability._timed import timed_store
from retrysafe.server._config import IdempotencyConfig, resolve_config
from retrysafe.server._engine import (
    FENCED,
    FORWARD,
    INVALID,
    UNRECORDED,
    Answer,
    Claimant,
    Engine,
    RequestState,
    Verdict,
    drive,
)
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
    The lease is renewed from a heartbeat thread while the app runs. The response iterable
    streams through with a one-chunk look-ahead, and the chunks completing a declared
    ``Content-Length`` wait too, until the key is completed (record before answer, SPEC §3); a
    record that cannot land answers 503 ``store-unavailable`` when no chunk has left yet, and
    otherwise aborts the connection before the end. A server that stops iterating because the
    client left still gets the rest of the answer drained, captured and recorded in
    ``close()``, which always closes the app's iterable.

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
        self.store = timed_store(store, self.config.telemetry)
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

        try:
            body = _read_body(environ, engine.max_body_size)
        except _ClientGone as gone:
            # Nothing was claimed and the handler did not run; nobody is left to read this.
            engine.log_decision("disconnect", method, path, 0, started, error=str(gone))
            answer = _incomplete_body(str(gone))
            start_response(answer.status_line, answer.str_headers())
            return [answer.body]
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

        run = _Run(engine, self.store, req, self._begin_effect, start_response)
        environ[SCOPE_KEY] = run.state  # lets the app say "outcome unknown"

        def capturing_start_response(
            status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
        ) -> Write:
            # Held until the first body bytes leave (PEP 3333 lets middleware delay it), so a
            # record that cannot land can still answer 503 instead (record before answer).
            if exc_info is not None and run.started_out:
                raise exc_info[1].with_traceback(exc_info[2])
            capture = run.capture
            capture.status = _status_code(status)
            if capture.status < 0:
                capture.status_line = status if isinstance(status, str) else repr(status)
            run.capture.headers = headers
            run.length = _content_length(headers)
            run.head = (status, headers, exc_info)
            return run.write

        try:
            result = self.app(environ, capturing_start_response)
        except BaseException as exc:
            run.abort(exc)
            raise
        return _Response(result, run)


#: A WSGI status line (PEP 3333): three digits, a space, a reason phrase of visible
#: characters, spaces and tabs (RFC 9112 §4: no CR or LF, which would split the answer);
#: the code alone is taken too, as servers take it.
_STATUS_LINE = re.compile(r"([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")


def _status_code(status: object) -> int:
    """The code of a WSGI status line, or -1 when it is none (the engine's answer check
    then refuses the answer: :meth:`Engine.answer_fault`). An app's bad status line raised
    here, in the middleware's ``start_response``, as if the app had failed before answering:
    the key was released though the handler had acted, and it ran again."""
    match = _STATUS_LINE.fullmatch(status) if isinstance(status, str) else None
    return int(match.group(1)) if match else -1


class _Run(Claimant):
    """Per-request state of a handler that runs under a claimed key; renews its lease."""

    __slots__ = (
        "_start_response",
        "_write",
        "beat",
        "head",
        "held",
        "length",
        "started_out",
    )

    def __init__(
        self,
        engine: Engine,
        store: KeyStore,
        req: RequestState,
        opener: Callable[[], Any],
        start_response: StartResponse,
    ) -> None:
        super().__init__(engine, store, req, opener)
        self._start_response = start_response
        self._write: Write | None = None
        self.head: tuple[str, list[tuple[str, str]], ExcInfo | None] | None = None
        self.started_out = False  # the server's start_response was called
        self.length = -1  # the declared Content-Length, or -1
        self.held: list[bytes] = []  # write()s that complete that length: after the record
        self.beat: Heartbeat = self.heartbeat(Heartbeat, self._renew)

    def start_out(self) -> None:
        """Hand the held status and headers to the server (before the first body bytes)."""
        if not self.started_out and self.head is not None:
            self.started_out = True
            status, headers, exc_info = self.head
            self._write = self._start_response(status, headers, exc_info)

    def write(self, data: bytes) -> object:
        """The legacy ``write()`` callable: captured, and it sends the headers first. Bytes
        that complete a declared Content-Length wait for the record, as the iterable's do
        (SPEC §3 "Record before answer": they went out at once, so a client got the whole
        answer of a key whose record then failed)."""
        self.capture.add(data)
        if 0 <= self.length <= self.capture.size:
            self.held.append(data)  # buffered for transmission (PEP 3333), after the record
            return None
        self.start_out()
        assert self._write is not None, "write() called before start_response()"
        beat = self.beat
        beat.wait_begins()  # the server writes it to the client: the client's time
        try:
            return self._write(data)
        finally:
            beat.wait_ends()

    def answer_instead(self, answer: Answer) -> bytes:
        """Replace the unsent answer with ``answer`` (its status line and headers go to the
        server); returns its body."""
        self.started_out = True
        self._start_response(answer.status_line, answer.str_headers())
        return answer.body

    def _renew(self) -> bool:
        if self.write_locked():
            return True
        return drive(self.engine.renew(self.req), self.store)

    def _end_effect(self, unknown: bool, exc: BaseException | None) -> Verdict:
        """Transactional mode: commit or roll back the handler's transaction, then release
        the key if that is what is left to do."""
        engine = self.engine
        state = self.state
        verdict, reason = engine.end_effect(
            self.req,
            self.capture,
            state["effect"],
            unknown=unknown,
            doomed=bool(state.get("effect_failed")),
        )
        if reason is not None:
            error = reason if exc is None else exc
            conversation = engine.abandon(
                self.req, self.capture, unknown=False, error=error, undone=True
            )
            drive(conversation, self.store)
        return verdict

    def finalize(self) -> Verdict:
        """The response is complete: complete the key (or release it, per SPEC §4) before its
        end leaves; when the record cannot land, keep recording it in a background thread."""
        self.end()
        self.capture.complete = True
        beat = self.beat
        beat.bounded = False
        unknown = outcome_unknown(self.state)
        verdict: Verdict = FORWARD
        try:
            if "effect" in self.state:
                verdict = self._end_effect(unknown, None)
                unknown = False  # rolled back: nothing is left to keep claimed
            else:
                verdict = drive(
                    self.engine.conclude(self.req, self.capture, unknown=unknown), self.store
                )
        finally:
            if verdict == UNRECORDED and self.req.pending is not None:
                threading.Thread(
                    target=self._record_later, name="retrysafe-record", daemon=True
                ).start()
            elif unknown or (verdict == INVALID and "effect" not in self.state):
                beat.bounded = True  # outcome unknown: claimed, renewed up to max_run_time
            else:
                beat.stop()
        return verdict

    def _record_later(self) -> None:
        try:
            drive(self.engine.record_later(self.req), self.store)
        finally:
            self.beat.stop()

    def abort(self, exc: BaseException | None) -> None:
        """The handler raised (``exc``): release the key, or keep it claimed as
        outcome-unknown when the response had started (SPEC §4)."""
        if self.finalized:
            return
        self.end()
        kept = False
        try:
            if "effect" in self.state:
                self._end_effect(outcome_unknown(self.state), exc)
                return
            conversation = self.engine.abandon(
                self.req, self.capture, unknown=outcome_unknown(self.state), error=exc
            )
            kept = drive(conversation, self.store)
        finally:
            if not kept:  # outcome unknown: claimed, renewed up to max_run_time
                self.beat.stop()


class _Response:
    """The app's response iterable: streamed through, copied, and recorded before its end."""

    __slots__ = ("_it", "_result", "_run")

    def __init__(self, result: Iterable[bytes], run: _Run) -> None:
        self._result = result
        self._run = run
        self._it: Iterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        run = self._run
        capture = run.capture
        # Chunks waiting for the record: always the latest one (a one-chunk look-ahead, so a
        # one-chunk answer can still be replaced), and all that complete a Content-Length
        # (write()'s among them).
        held: list[bytes] = run.held
        run.held = []
        it = self._it = iter(self._result)
        try:
            for chunk in it:
                capture.add(chunk)
                if held and not 0 <= run.length <= capture.size:
                    run.start_out()
                    beat = run.beat
                    beat.wait_begins()  # the client's time, not the app's
                    try:
                        yield from held  # the server writes them to the client meanwhile
                    finally:
                        beat.wait_ends()
                    held = []
                held.append(chunk)
        except GeneratorExit:
            raise
        except BaseException as exc:
            run.abort(exc)
            raise
        if run.finalized:
            return  # close() drained and recorded it already
        verdict = run.finalize()
        if verdict == FORWARD:
            run.start_out()
            yield from held
            return
        if run.started_out:
            # Part of the answer left already: cut the connection before its end, so the
            # client sees a broken answer and retries with the same key.
            why = {FENCED: "lease taken over", INVALID: "not a valid HTTP response"}
            raise StoreUnavailableError(
                "the answer could not be recorded, so its end is not sent "
                f"({why.get(verdict, 'store unavailable')})",
                store=repr(run.store),
            )
        yield run.answer_instead(run.engine.instead_of(run.req, verdict))

    def close(self) -> None:
        run = self._run
        try:
            if not run.finalized:
                # The server stopped iterating (the client left): let the app finish, capture
                # the rest of its answer and record it, so the retry gets the replay.
                self._drain()
        finally:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()

    def _drain(self) -> None:
        run = self._run
        capture = run.capture
        it = self._it if self._it is not None else iter(self._result)
        try:
            for chunk in it:
                capture.add(chunk)
        except BaseException as exc:
            run.abort(exc)
            if not isinstance(exc, Exception):
                raise
            return
        req = run.req
        run.engine.log_decision(
            "client-gone", req.method, req.path, capture.status, req.started, req.key_hash,
            level=logging.WARNING,
            detail="the server stopped sending the answer (client gone); it was captured to "
            "the end and is recorded",
        )
        run.finalize()
        run.started_out = True  # nobody is listening: never hand the server headers now


class _ClientGone(Exception):
    """The request body ended before its Content-Length (the client went away)."""


def _incomplete_body(why: str) -> Answer:
    problem = Problem(
        "incomplete-body",
        400,
        f"The request body ended early ({why}); nothing was run. Send the whole body again "
        "with the same Idempotency-Key.",
    )
    body = problem.body()
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in problem.headers(len(body))]
    return Answer(400, headers, body, "incomplete-body")


def _content_length(headers: Iterable[tuple[str, str]]) -> int:
    for name, value in headers:
        if name.lower() == "content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


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
            data = _read_exactly(stream, expected)
            if len(data) < expected:
                raise _ClientGone(f"{len(data)} of {expected} bytes arrived")
            return data
    if not environ.get("wsgi.input_terminated"):
        return b""  # PEP 3333: without a Content-Length there is no body to read
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = stream.read(_READ_CHUNK)
        except OSError as exc:  # a chunked body cut off (werkzeug: "Invalid chunk header")
            raise _ClientGone(f"reading the chunked body failed: {exc}") from exc
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


def _read_exactly(stream: Any, n: int) -> bytes:
    if n == 0:
        return b""
    try:
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
    except OSError as exc:  # the connection broke while reading: the client went away
        raise _ClientGone(f"reading the body failed: {exc!r}") from exc
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
