"""The idempotency middleware's shared logic, driven by the ASGI and the WSGI middleware.

Every rule lives here once: the key check (SPEC §3 first rows, via :func:`core.check_key`),
the claim / decide / take-over / wait loop (via :func:`core.decide`), what is stored and which
headers are replayed (SPEC §4, via :func:`core.should_store`), the problem answers and the log
line. The store conversation is a generator of *store operations* (sans-I/O, as in h11): the
ASGI middleware drives it with ``await``, the WSGI middleware with plain calls, so both
frameworks run the very same steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, TypeVar

from retrysafe._exceptions import (
    ConfigurationError,
    InvalidKeyError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.core import (
    RACE_LIMIT,
    InProgress,
    InvalidKey,
    KeyCheck,
    KeyRecord,
    KeyReused,
    KeyState,
    MissingKey,
    Problem,
    Replay,
    ReplayUnavailable,
    StoredResponse,
    TakeOver,
    check_key,
    decide,
    key_retention,
    releases_unfinished,
    should_store,
)
from retrysafe.observability._telemetry import EVENTS, Telemetry, decision_label
from retrysafe.server._config import DEFAULT_REPLAY_HEADERS, IdempotencyConfig
from retrysafe.server._outcome import ANSWER_EARLY
from retrysafe.testing import waited

__all__ = [
    "FENCED",
    "FORWARD",
    "RECORD_WAIT",
    "UNRECORDED",
    "Answer",
    "Capture",
    "ClaimOutcome",
    "Claimant",
    "Claimed",
    "Engine",
    "Op",
    "RequestState",
    "Verdict",
    "acall_op",
    "adrive",
    "call_op",
    "claim_key",
    "drive",
    "log",
    "settle",
    "status_line",
]

log = logging.getLogger("retrysafe.server")

#: One store operation: ``(method name, positional args, keyword args)``; ``"sleep"`` waits.
Op = tuple[str, tuple[Any, ...], dict[str, Any]]
RawHeaders = list[tuple[bytes, bytes]]
_R = TypeVar("_R")

#: What a driver does with the app's answer once the engine has concluded (record before
#: answer, SPEC §3): ``"forward"`` — nothing is pending (stored, released or outcome unknown),
#: send the answer; ``"fenced"`` — the lease was taken over and the answer is not the key's
#: record: send 409 ``request-in-progress`` instead (the new owner's answer will be replayed);
#: ``"unrecorded"`` — the record could not land: send 503 ``store-unavailable`` and keep
#: recording in the background (:meth:`Engine.record_later`); ``"invalid"`` — the answer is
#: no valid HTTP response (:meth:`Engine.answer_fault`): send 500 ``invalid-answer`` instead
#: (the outcome is unknown: the key stays claimed, as after an exception once the answer
#: started).
Verdict = Literal["forward", "fenced", "unrecorded", "invalid"]
FORWARD: Verdict = "forward"
FENCED: Verdict = "fenced"
UNRECORDED: Verdict = "unrecorded"
INVALID: Verdict = "invalid"

#: RFC 9110 §5.1 and §5.5: a field name is a token; a field value is visible characters
#: (and obs-text), with spaces and tabs only between them.
_FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
#: Header fields already found valid (an app sends the same few again and again), up to
#: _VALID_FIELDS_KEPT of them: a set lookup instead of two regular expressions per field.
_VALID_FIELDS: set[tuple[bytes, bytes]] = set()
_VALID_FIELDS_KEPT = 1024

_POLL_INITIAL = 0.02  # seconds: first wait while polling a running key (in_progress_wait)
_POLL_MAX = 0.25  # seconds: longest single wait while polling
_SETTLE_INITIAL = 0.05  # seconds: first wait before retrying a failed complete/release
_SETTLE_MAX = 0.5  # seconds: longest wait between those retries
#: Seconds a client waits for a failing record before it gets 503 (SPEC §3 record before answer).
RECORD_WAIT = 1.0
_REPLAYED = (b"idempotent-replayed", b"true")


class Answer:
    """A response the middleware gives itself (a problem or a replay).

    Attributes:
        status: HTTP status code.
        headers: raw ``(lower-case name, value)`` byte pairs, Content-Length included.
        body: the body bytes.
        decision: the log's ``decision`` field, e.g. ``"replay"``.
    """

    __slots__ = ("body", "decision", "headers", "status")

    def __init__(self, status: int, headers: RawHeaders, body: bytes, decision: str) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.decision = decision

    def str_headers(self) -> list[tuple[str, str]]:
        """Headers as WSGI wants them: ``(name, value)`` strings."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.headers]

    @property
    def status_line(self) -> str:
        """``"409 Conflict"``: the WSGI status string."""
        return status_line(self.status)


def status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


class RequestState:
    """Per-request values of a protected, keyed request (mutable, slotted).

    Attributes:
        token: the fencing token once claimed.
        claim: ``"new"`` or ``"takeover"``.
        claimed_at: when the claim was taken, on the engine's clock (for ``max_run_time``).
        lost: a renewal found the key taken over: nothing this request writes will land.
        pending: the completing operation still to be recorded in the background, or None.
        handled: the handler ran and its answer was held back for a record that could not
            land (then recorded in the background): a 503 instead must not say "nothing ran".
        refused: the answer came from a check before the handler ran (a framework's CSRF
            check): it is not the operation's outcome, so the key is released, never stored
            (Stripe saves a result only once the endpoint started executing).
    """

    __slots__ = (
        "claim",
        "claimed_at",
        "fingerprint",
        "handled",
        "key_hash",
        "lost",
        "method",
        "path",
        "pending",
        "refused",
        "started",
        "token",
    )

    def __init__(
        self, method: str, path: str, key_hash: str, fingerprint: str, started: float
    ) -> None:
        self.method = method
        self.path = path
        self.key_hash = key_hash
        self.fingerprint = fingerprint
        self.started = started
        self.token = 0
        self.claim = "new"
        self.claimed_at = 0.0
        self.lost = False
        self.pending: Op | None = None
        self.handled = False
        self.refused = False


class Capture:
    """A copy of the response as it streams to the client, up to the replay limit.

    Attributes:
        status: the response status (0 until the response starts).
        headers: the response headers as sent (bytes pairs for ASGI, str pairs for WSGI).
        chunks: body chunks kept so far; emptied once the body exceeds the limit.
        size: body bytes seen, in total.
        overflow: the body exceeded ``limit`` bytes; it cannot be replayed.
        complete: the handler finished the response (last body chunk seen).
        status_line: a WSGI status line that is no status (``status`` is then -1), else None.
    """

    __slots__ = (
        "chunks",
        "complete",
        "headers",
        "limit",
        "overflow",
        "size",
        "status",
        "status_line",
    )

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status = 0
        self.status_line: str | None = None
        self.headers: Iterable[tuple[Any, Any]] = ()
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflow = False
        self.complete = False

    def add(self, chunk: bytes) -> None:
        size = self.size + len(chunk)
        self.size = size
        if self.overflow:
            return
        if size > self.limit:
            self.overflow = True
            self.chunks = []
        elif chunk:
            self.chunks.append(chunk)


def _after_the_end() -> Any:
    """``state["begin_effect"]`` once the response ended."""
    raise ConfigurationError("transaction() called after the response ended", option="transaction")


class Claimant:
    """What the ASGI responder and the WSGI run share while a request holds its claim: the
    engine and store, the request, the copy of its answer, the state dict the app sees under
    ``SCOPE_KEY`` ("outcome unknown", ``transaction()``), and the heartbeat's callbacks. The
    drivers add only their I/O (STYLE: build and decide once, let the faces do the I/O)."""

    __slots__ = ("capture", "engine", "finalized", "req", "state", "store")

    def __init__(self, engine: Engine, store: Any, req: RequestState, opener: Any) -> None:
        self.engine = engine
        self.store = store
        self.req = req
        self.capture = Capture(engine.max_replay_size)
        self.finalized = False
        # The store's opener itself (made once per middleware), never a method of this
        # claimant: the state dict is the claimant's own, and a bound method in it would be a
        # reference cycle, keeping every finished request (a dozen objects) in memory until
        # the garbage collector found it.
        self.state: dict[str, Any] = {"begin_effect": opener}

    def end(self) -> None:
        """The response ended (or was given up): nothing more belongs to it, and
        ``transaction()`` may no longer open the handler's transaction."""
        self.finalized = True
        state = self.state
        state["begin_effect"] = _after_the_end
        state.pop(ANSWER_EARLY, None)  # the ASGI responder's: too late for it now

    def heartbeat(self, kind: Any, renew: Any) -> Any:
        """Start ``kind`` (:class:`~retrysafe._heartbeat.AsyncHeartbeat` or ``Heartbeat``)
        renewing this claim with ``renew``, its callbacks logging through the engine."""
        engine = self.engine
        return kind(
            renew,
            engine.timing,
            clock=engine.clock,
            started=self.req.claimed_at,
            on_lost=self.lease_lost,
            on_expired=self.run_time_exceeded,
            on_error=self.renewal_failed,
        ).start()

    def write_locked(self) -> bool:
        """SQLite transactional mode: the handler's open write transaction holds the
        database's write lock, so no one can take the key over and a renewal would only wait
        for the lock; the drivers skip renewing then."""
        effect = self.state.get("effect")
        return effect is not None and bool(effect.holds_write_lock)

    def lease_lost(self) -> None:
        # After the response's end the record decides: a renewal that went out just before
        # it finds the key completed by it (helper-58: `lease-lost` and `stored` in the same
        # millisecond, PostgreSQL under load); a real take-over makes the record `fenced`.
        if not self.finalized:
            self.engine.lease_lost(self.req)

    def run_time_exceeded(self) -> None:
        self.engine.run_time_exceeded(self.req)

    def renewal_failed(self, exc: BaseException) -> None:
        self.engine.renewal_failed(self.req, exc)


class Engine:
    """The configured rules, resolved once per middleware instance.

    Args:
        config: the middleware configuration.
    """

    __slots__ = (
        "_invalid_answer",
        "_missing_key",
        "_replay_bytes",
        "_replay_str",
        "_stopped",
        "_store_unavailable",
        "_unrecorded",
        "clock",
        "config",
        "fail_open",
        "key_required",
        "key_reused_status",
        "lease",
        "max_body_size",
        "max_replay_size",
        "pending_keys",
        "protected_methods",
        "retention",
        "scope",
        "store_server_errors",
        "telemetry",
        "timing",
        "wait",
    )

    def __init__(self, config: IdempotencyConfig) -> None:
        self.config = config
        self.protected_methods = frozenset(config.protected_methods)
        self.key_required = config.key_required
        self.scope = config.scope
        self.timing = config.lease_timing
        self.lease = self.timing.lease
        # Keys whose answer this process holds but could not record yet (record_later): a
        # retry reaching this process is told to wait, never allowed to take the key over,
        # however long the store was down.
        self.pending_keys: set[str] = set()
        self.retention = config.retention_seconds
        self.wait = config.in_progress_wait_seconds
        self.max_body_size = config.max_body_size
        self.max_replay_size = config.max_replay_size
        self.store_server_errors = config.store_server_errors
        self.key_reused_status = config.key_reused_status
        self.fail_open = config.fail_open
        self.clock = config.clock
        self.telemetry: Telemetry | None = config.telemetry
        names = DEFAULT_REPLAY_HEADERS | frozenset(config.replay_headers)
        self._replay_str = names
        self._replay_bytes = frozenset(n.encode("latin-1") for n in names)
        self._missing_key = self._problem(
            Problem(
                "missing-key",
                400,
                "This endpoint requires an Idempotency-Key header: create one unique key per "
                "operation (e.g. a UUIDv4) and send it with every attempt of that operation.",
            ),
            "missing-key",
        )
        self._invalid_answer = self._problem(
            Problem(
                "invalid-answer",
                500,
                "The request was handled, but its answer is not a valid HTTP response, so it "
                "could neither be sent nor stored. Retry with the same key, never a new one: "
                "the operation may have taken effect (a retry answers 409 while the key is "
                "claimed).",
            ),
            "invalid-answer",
        )
        self._unrecorded = self._problem(
            Problem(
                "store-unavailable",
                503,
                "The request was handled, but the idempotency store is unavailable, so its "
                "answer could not be recorded yet. Retry later with the same key to get that "
                "answer; do not use a new key: the operation may have taken effect.",
                retry_after=config.store_retry_after_seconds,
            ),
            "store-unavailable",
        )
        self._store_unavailable = self._problem(
            Problem(
                "store-unavailable",
                503,
                "The idempotency store is unavailable, so this request cannot be protected "
                "against duplicates. Nothing was run; retry later with the same key.",
                retry_after=config.store_retry_after_seconds,
            ),
            "store-unavailable",
        )

        self._stopped = self._problem(
            Problem(
                "server-stopped",
                503,
                "The server stopped while handling this request, which may have taken effect. "
                "Retry with the same key, never a new one: until the key's lease ends a retry "
                "is told the request is in progress (409); after it, the request runs again.",
                retry_after=max(1, math.ceil(self.lease)),
            ),
            "server-stopped",
        )

    # ------------------------------------------------------------------ key check
    def check(self, method: str, path: str, header: str | None) -> KeyCheck:
        """SPEC §3 first rows: protected? key present and well formed? (``core.check_key``)."""
        required = self.key_required
        if not isinstance(required, bool):
            required = bool(required(method, path)) if method in self.protected_methods else False
        return check_key(
            method, header, protected_methods=self.protected_methods, key_required=required
        )

    @staticmethod
    def duplicate_key(header: str) -> InvalidKey:
        """Two ``Idempotency-Key`` headers: ambiguous, so malformed."""
        return InvalidKey(InvalidKeyError("more than one Idempotency-Key header", key=header))

    # ------------------------------------------------------------------ answers
    @staticmethod
    def _problem(problem: Problem, decision: str, *, replayed: bool = False) -> Answer:
        body = problem.body()
        headers = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in problem.headers(len(body))
        ]
        if replayed:
            headers.append(_REPLAYED)
        return Answer(problem.status, headers, body, decision)

    def rejection(self, check: MissingKey | InvalidKey) -> Answer:
        """400 ``missing-key`` or 400 ``invalid-key`` (detail from ``InvalidKeyError.reason``)."""
        if isinstance(check, MissingKey):
            return self._missing_key
        return self._problem(
            Problem(
                "invalid-key",
                400,
                f"The Idempotency-Key header is malformed: {check.error.reason}. A key is "
                "1-255 visible ASCII characters, sent bare (abc) or as a structured-field "
                'string ("abc").',
            ),
            "invalid-key",
        )

    def body_too_large(self) -> Answer:
        """413 ``body-too-large``: nothing was claimed, the handler did not run."""
        return self._problem(
            Problem(
                "body-too-large",
                413,
                f"The request body exceeds {self.max_body_size} bytes, the most this endpoint "
                "reads to recognise repeated requests.",
                extra={"max_body_size": self.max_body_size},
            ),
            "body-too-large",
        )

    def store_unavailable(self) -> Answer:
        """503 ``store-unavailable`` with ``Retry-After`` (fail closed, SPEC §3)."""
        return self._store_unavailable

    def stopped(self) -> Answer:
        """503 ``server-stopped``: the server cancelled the request (its shutdown grace ran
        out) before any of the answer left; the key stays claimed as outcome-unknown."""
        return self._stopped

    def instead_of(self, req: RequestState, verdict: Verdict) -> Answer:
        """What a driver sends instead of a handler's answer the engine did not let out: 409
        ``request-in-progress`` (fenced: the new owner's answer will be replayed), or 503
        ``store-unavailable``, saying whether the request ran: its answer still waits to be
        recorded (``req.handled``), or nothing happened (the transaction rolled back)."""
        if verdict == FENCED:
            return self.in_progress(1)
        if verdict == INVALID:
            return self._invalid_answer
        return self._unrecorded if req.handled else self._store_unavailable

    def replay(self, response: StoredResponse) -> Answer:
        """The stored status, replayable headers and body, plus ``Idempotent-Replayed: true``."""
        headers: RawHeaders = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers
        ]
        if response.status >= 200 and response.status not in (204, 304):
            body = response.body
            # A HEAD answer's stored Content-Length (its body is empty) is the one it had.
            if body or not any(k == "content-length" for k, _ in response.headers):
                headers.append((b"content-length", str(len(body)).encode("ascii")))
        headers.append(_REPLAYED)
        return Answer(response.status, headers, response.body, "replay")

    def replay_unavailable(self, status: int) -> Answer:
        """The original status with a ``replay-unavailable`` problem (SPEC §4).

        The status stays the original one (a 201 stays 201) and ``Idempotent-Replayed: true``
        is set, so clients classify the operation by its real outcome and never run it again.
        """
        if status < 200 or status in (204, 205, 304):
            status = 200  # these statuses cannot carry the problem body
        return self._problem(
            Problem(
                "replay-unavailable",
                status,
                "This operation already completed, but its response was larger than the "
                "replay limit and was not kept. The operation was not run again.",
            ),
            "replay-unavailable",
            replayed=True,
        )

    def key_reused(self, decision: KeyReused) -> Answer:
        """``key-reused`` (422 by default) with both fingerprints as extension members."""
        return self._problem(
            Problem(
                "key-reused",
                self.key_reused_status,
                "This Idempotency-Key was already used for a different request (method, path, "
                "query or body differ). Use a new key for a new operation.",
                extra={
                    "stored_fingerprint": decision.stored_fingerprint,
                    "fingerprint": decision.fingerprint,
                },
            ),
            "key-reused",
        )

    def in_progress(self, retry_after: int) -> Answer:
        """409 ``request-in-progress`` with ``Retry-After``."""
        return self._problem(
            Problem(
                "request-in-progress",
                409,
                "A request with this Idempotency-Key is still running. Retry after the "
                "indicated delay with the same key to receive its response.",
                retry_after=retry_after,
            ),
            "in-progress",
        )

    # ------------------------------------------------------------------ the store conversation
    def admit(self, req: RequestState) -> Generator[Op, Any, Answer | None]:
        """Claim the key or answer for it (SPEC §3 rows with a valid key).

        Yields store operations; the driver sends back each result. Returns None when the
        handler must run (``req.token`` then holds the fencing token), else the answer. A key
        whose answer this process is still recording in the background answers 503
        ``store-unavailable`` without asking the store.
        """
        if req.key_hash in self.pending_keys:
            return self._store_unavailable
        outcome = yield from claim_key(
            req.key_hash,
            req.fingerprint,
            clock=self.clock,
            lease=self.lease,
            retention=self.retention,
            wait=self.wait,
        )
        if isinstance(outcome, Claimed):
            req.token = outcome.fencing_token
            req.claimed_at = outcome.at
            if outcome.takeover:
                req.claim = "takeover"
            return None
        if isinstance(outcome, Replay):
            return self.replay(outcome.response)
        if isinstance(outcome, KeyReused):
            return self.key_reused(outcome)
        if isinstance(outcome, ReplayUnavailable):
            return self.replay_unavailable(outcome.status)
        return self.in_progress(outcome.retry_after)

    # ------------------------------------------------------------------ while the handler runs
    def renew(self, req: RequestState) -> Generator[Op, Any, bool]:
        """One heartbeat: move the lease to ``now + lease``, fenced by the request's token.

        Returns:
            True when renewed; False when the key is no longer this request's (taken over,
            completed or released): :meth:`lease_lost` is then the caller's next step.
        """
        ok = yield (
            "extend_lease",
            (req.key_hash, req.token),
            {"now": self.clock(), "lease": self.lease},
        )
        if self.telemetry is not None:
            self.telemetry.lease_renewal("renewed" if ok else "lost")
        return bool(ok)

    def lease_lost(self, req: RequestState) -> None:
        """A renewal found the key taken over while the handler still runs: say so loudly.

        Nothing this request writes will land (every write is fenced); its effect may have
        run twice, which only a process stalled for longer than the lease can cause. Not said
        while the answer's record is pending in the background (:meth:`record_later`): a
        renewal that went out beside it finds the key completed once the record landed, and
        the record's own outcome (``stored-late``, or ``fenced``) is the one to tell.
        """
        if req.pending is not None:
            return
        req.lost = True
        self.log_request(
            "lease-lost",
            req,
            0,
            level=logging.ERROR,
            claim=req.claim,
            fencing_token=req.token,
            detail="another attempt took this key over while the handler ran (this process "
            "stalled past the lease, or could not reach the store to renew it for that long), "
            "or the store no longer has it (a Redis without persistence that restarted); its "
            "result will not be written",
        )

    def run_time_exceeded(self, req: RequestState) -> None:
        """The handler ran past ``max_run_time``: renewal stops and the lease runs out."""
        self.log_request(
            "max-run-time",
            req,
            0,
            level=logging.WARNING,
            claim=req.claim,
            detail=f"the handler has run for {self.timing.max_run_time:g} s (max_run_time): "
            "lease renewal stopped; a retry may take the key over once the lease ends",
        )

    def renewal_failed(self, req: RequestState, exc: BaseException) -> None:
        """A renewal raised (store hiccup); the next heartbeat tries again."""
        if self.telemetry is not None:
            self.telemetry.lease_renewal("failed")
        self.log_request(
            "renewal-failed",
            req,
            0,
            level=logging.WARNING,
            error=repr(exc),
        )

    # ------------------------------------------------------------------ after the handler
    def conclude(
        self, req: RequestState, capture: Capture, *, unknown: bool
    ) -> Generator[Op, Any, Verdict]:
        """After a complete response, before its end reaches the client: store it or release
        the key (SPEC §4), and log. Record before answer (SPEC §3): the verdict tells the
        driver whether the answer may go out.

        ``unknown``: the app marked the outcome unknown; the key stays claimed. An answer
        that is no valid HTTP response (:meth:`answer_fault`) is not stored or released
        either: its handler ran, and no server can send its answer, nor could a replay;
        the key stays claimed as outcome-unknown and the verdict is ``"invalid"``.
        """
        if unknown:
            self.log_unknown(req, capture.status)
            return FORWARD
        fault = self.answer_fault(req, capture)
        if fault is not None:
            self.log_unknown(req, capture.status, error=f"invalid answer: {fault}")
            return INVALID
        op = self.finish(req, capture)
        if req.lost:  # a renewal found the key taken over: the late result is not written
            self.log_finish(req, op, False, capture.status)
            return FENCED if op[0] == "complete" else FORWARD
        try:
            ok = yield from settle(op, wait=RECORD_WAIT)
        except StoreError as exc:
            if op[0] != "complete":
                # A 5xx/408/429 says "not done": forward it; the unreleased key's lease runs
                # out (the driver stops renewing), and a retry then runs again.
                self._log_store_failed(req, capture.status, op, exc)
                return FORWARD
            req.pending = op
            req.handled = True
            self.pending_keys.add(req.key_hash)
            self.log_request(
                "unrecorded",
                req,
                capture.status,
                level=logging.ERROR,
                error=repr(exc),
                detail="the answer could not be recorded: the client gets 503 "
                "store-unavailable (unless it left, or had an early answer); the record is "
                "retried in the background while the lease is renewed",
            )
            return UNRECORDED
        self.log_finish(req, op, ok, capture.status)
        return FORWARD if ok or op[0] != "complete" else FENCED

    def record_later(self, req: RequestState) -> Generator[Op, Any, None]:
        """The background half of record-before-answer: retry ``req.pending`` until the
        store applies it (or refuses it: the lease was lost), however long the store is down.
        The driver keeps renewing the lease meanwhile and stops when this returns."""
        op = req.pending
        if op is None:
            return
        try:
            ok = yield from settle(op, wait=None)
        except StoreError as exc:
            self._log_store_failed(req, 0, op, exc)
            return
        finally:
            req.pending = None
            self.pending_keys.discard(req.key_hash)
        status = op[1][2].status if op[0] == "complete" else 0
        if ok:
            self.log_request(
                "stored-late", req, status,
                level=logging.WARNING, claim=req.claim,
                detail="the answer was recorded after the store recovered; retries replay it",
            )
        else:
            self.log_finish(req, op, False, status)

    def abandon(
        self,
        req: RequestState,
        capture: Capture,
        *,
        unknown: bool,
        error: BaseException | str | None,
        undone: bool = False,
    ) -> Generator[Op, Any, bool]:
        """The handler raised (``error``) or stopped without a complete response, and log.

        The key is released so the next attempt runs again only when the unfinished response
        says "not done" (:func:`core.releases_unfinished`: nothing started, or a started 5xx,
        408 or 429), or when ``undone`` (transactional mode rolled the effect back). A
        response that had started otherwise, or one the app marked unknown, keeps the key
        claimed as outcome-unknown (the effect may have happened).

        Returns:
            True when the key stays claimed as outcome-unknown: the driver keeps renewing its
            lease (up to ``max_run_time`` from the claim) instead of letting it run out.
        """
        if unknown or not (
            undone
            or releases_unfinished(capture.status, store_server_errors=self.store_server_errors)
        ):
            self.log_unknown(req, capture.status, error=_describe(error))
            return True
        op = self.release(req)
        if req.lost:  # taken over: the new owner's record is not ours to release
            self.log_finish(req, op, False, capture.status)
            return False
        try:
            ok = yield from settle(op, wait=RECORD_WAIT)
        except StoreError as exc:
            self._log_store_failed(req, capture.status, op, exc)
            return False
        if not ok:
            self.log_finish(req, op, False, capture.status)
            return False
        self.log_request(
            "released",
            req,
            capture.status,
            level=logging.WARNING,
            claim=req.claim,
            error=_describe(error),
        )
        return False

    def end_effect(
        self,
        req: RequestState,
        capture: Capture,
        effect: Any,
        *,
        unknown: bool,
        doomed: bool = False,
    ) -> tuple[Verdict, str | None]:
        """Transactional mode (SPEC §4): finish the handler's open transaction ``effect``.

        A stored response (:meth:`finish` chooses ``complete``) is completed *inside* the
        effect's transaction, fenced by the token, then committed: effect and completion land
        together. A fenced-off completion (lease taken over) rolls the effect back. Anything
        else rolls the effect back. An unknown outcome rolls back and keeps the claim.
        Synchronous: the ASGI driver runs it in a worker thread.

        Args:
            doomed: the handler's ``transaction()`` block raised: roll back whatever it answered.

        Returns:
            ``(verdict, reason)``: what to do with the answer (``"unrecorded"`` here means the
            effect was rolled back because its completion failed: answer 503, nothing
            happened), and None when nothing is left to do, else why the key must now be
            released (the caller settles that release with :meth:`abandon`).
        """
        if unknown:
            effect.rollback()
            self.log_unknown(req, capture.status)
            return FORWARD, None
        fault = self.answer_fault(req, capture) if capture.complete else None
        if fault is not None:
            effect.rollback()
            return INVALID, f"invalid answer: {fault}; effect rolled back"
        op = self.finish(req, capture)
        if op[0] != "complete" or doomed:
            effect.rollback()
            if doomed:
                return FORWARD, "the transaction() block raised"
            if capture.complete:
                return FORWARD, f"response not stored (status {capture.status}); effect rolled back"
            return FORWARD, "incomplete response; effect rolled back"
        try:
            ok = effect.complete_in(*op[1], **op[2])
            if ok:
                effect.commit()
            else:
                effect.rollback()
        except StoreError as exc:
            effect.rollback()
            self._log_store_failed(req, capture.status, op, exc)
            # The release is fenced on state 'running': if the commit did land, it is a no-op.
            return UNRECORDED, f"transactional completion failed: {exc!r}"
        self.log_finish(req, op, ok, capture.status)
        return (FORWARD if ok else FENCED), None

    def _log_store_failed(
        self, req: RequestState, status: int, op: Op, exc: StoreError
    ) -> None:
        self.log_request(
            "store-failed",
            req,
            status,
            level=logging.ERROR,
            error=repr(exc),
            operation=op[0],
        )

    def answer_fault(self, req: RequestState, capture: Capture) -> str | None:
        """Why the handler's complete answer is no valid HTTP response, or None: a status
        that is no final one, 200-599 (RFC 9110 §15; a 1xx is informational, never the
        answer; a WSGI status line that is not three digits and a reason phrase, CR LF
        among what it must not hold), a header name that is no token or a value with a
        control character or with spaces around it (§5.1, §5.5: the characters of response
        splitting among them), a Content-Length that is no number, given twice with two
        values, or not the body's length (§8.6; not for HEAD, 204 and 304). A server
        fails such an answer on its way out (uvicorn: an error, an empty reply) or sends it
        as it is; it was once stored, and every replay then failed the same way for the
        whole retention."""
        if capture.status_line is not None:
            return f"status line {capture.status_line[:100]!r} is not a code and a reason"
        status = capture.status
        if type(status) is not int or not 200 <= status <= 599:
            return f"status {status!r} is not a final status (200-599)"
        declared: bytes | None = None
        for name, value in capture.headers:
            if type(name) is not bytes or type(value) is not bytes:  # WSGI: latin-1 text
                try:
                    name, value = str(name).encode("latin-1"), str(value).encode("latin-1")
                except UnicodeEncodeError:
                    return f"header {name!r}: not latin-1 text"
            if (name, value) in _VALID_FIELDS:
                continue
            if name.lower() == b"content-length":
                if not value.isdigit() or (declared is not None and declared != value):
                    return f"Content-Length {value[:100]!r} is not one number"
                declared = value
                continue
            if not _FIELD_NAME.fullmatch(name):
                return f"header name {name[:100]!r} is not a token"
            if not _FIELD_VALUE.fullmatch(value):
                return f"header {name[:100]!r}: value {value[:100]!r} is not a field value"
            if len(_VALID_FIELDS) < _VALID_FIELDS_KEPT:
                _VALID_FIELDS.add((name, value))
        if (
            declared is not None
            and req.method != "HEAD"
            and status not in (204, 304)
            and int(declared) != capture.size
        ):
            return f"Content-Length {int(declared)} but a body of {capture.size} bytes"
        return None

    def finish(self, req: RequestState, capture: Capture) -> Op:
        """After the handler: complete the key with the response or release it (SPEC §4).

        A complete response whose status :func:`core.should_store` accepts (and that no check
        before the handler gave, ``req.refused``) completes the key
        with its replayable headers and body (an empty body is a valid stored body); a body
        larger than ``max_replay_size`` completes it as not replayable. Anything else (5xx,
        408, 429, no complete response) releases the key so the next attempt runs again.
        """
        status = capture.status
        if capture.complete and not req.refused and should_store(
            status,
            store_server_errors=self.store_server_errors,
            retry_after=status == 409 and _has_retry_after(capture.headers),
        ):
            if capture.overflow:
                response = StoredResponse(
                    capture.status, self._headers(capture, req.method), b"", False
                )
            else:
                chunks = capture.chunks
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                response = StoredResponse(
                    capture.status, self._headers(capture, req.method), body
                )
            return (
                "complete",
                (req.key_hash, req.token, response),
                {"now": self.clock(), "retention": self.retention},
            )
        return ("release", (req.key_hash, req.token), {})

    def release(self, req: RequestState) -> Op:
        """Release the key (the handler raised or the client went away)."""
        return ("release", (req.key_hash, req.token), {})

    def _headers(self, capture: Capture, method: str) -> tuple[tuple[str, str], ...]:
        """The replayable headers of an answer; a HEAD answer keeps its Content-Length too
        (the length a GET's body would have, RFC 9110 §9.3.2; its own body is empty)."""
        replay_bytes, replay_str = self._replay_bytes, self._replay_str
        if method == "HEAD":
            replay_bytes, replay_str = replay_bytes | {b"content-length"}, replay_str | {
                "content-length"
            }
        out: list[tuple[str, str]] = []
        for name, value in capture.headers:
            if isinstance(name, bytes):
                if name.lower() in replay_bytes:
                    out.append((name.decode("latin-1").lower(), value.decode("latin-1")))
            elif name.lower() in replay_str:
                out.append((name.lower(), value))
        return tuple(out)

    # ------------------------------------------------------------------ logging
    def log_decision(
        self,
        decision: str,
        method: str,
        path: str,
        status: int,
        started: float,
        key_hash: str = "",
        *,
        level: int = logging.INFO,
        **fields: Any,
    ) -> None:
        """One structured line on ``retrysafe.server``: ``decision=<name>`` plus fields, and
        the same decision reported to the telemetry (a request's decision, or an event beside
        it: :data:`~retrysafe.observability._telemetry.EVENTS`)."""
        t = self.telemetry
        if t is not None:
            if decision in EVENTS:
                if decision != "renewal-failed":  # counted as a renewal (renewal_failed)
                    t.server_event(decision)
            else:
                t.server_decision(
                    decision_label(decision, fields.get("claim")),
                    method=method,
                    path=path,
                    status=status,
                    seconds=time.perf_counter() - started,
                    key_hash=key_hash,
                )
        if not log.isEnabledFor(level):
            return
        extra = {
            "decision": decision,
            "method": method,
            "path": path,
            "status": status,
            "key_hash": key_hash[:12],
            "duration_ms": round((time.perf_counter() - started) * 1000.0, 3),
        }
        extra.update(fields)
        if level < logging.WARNING:
            log.log(level, "decision=%s", decision, extra=extra)
            return
        # A warning is read by people whose handler prints only the message (Django's
        # default): say what happened there too, not only in the structured fields.
        said = " ".join(f"{name}={fields[name]}" for name in ("error", "detail") if name in fields)
        log.log(
            level, "decision=%s %s %s status=%s%s", decision, method, path, status,
            f" {said}" if said else "", extra=extra,
        )  # fmt: skip

    def log_request(
        self,
        decision: str,
        req: RequestState,
        status: int,
        *,
        level: int = logging.INFO,
        **fields: Any,
    ) -> None:
        """:meth:`log_decision` for a claimed request (its method, path, start and key)."""
        self.log_decision(
            decision, req.method, req.path, status, req.started, req.key_hash, level=level, **fields
        )

    def log_unknown(
        self, req: RequestState, status: int, *, error: BaseException | str | None = None
    ) -> None:
        """The outcome is unknown: the key stays claimed until its lease ends."""
        fields: dict[str, Any] = {}
        if error is not None:
            fields["error"] = _describe(error)
        self.log_request(
            "outcome-unknown",
            req,
            status,
            level=logging.WARNING,
            claim=req.claim,
            detail="the effect may have happened; the key stays claimed (renewed while this "
            "process runs, up to max_run_time of the handler's own time), then its lease runs "
            "out",
            **fields,
        )

    def log_finish(self, req: RequestState, op: Op, ok: bool, status: int) -> None:
        """The line for a request whose handler ran: stored, released or fenced off."""
        if not ok:
            self.log_request(
                "fenced",
                req,
                status,
                level=logging.WARNING,
                claim=req.claim,
                fencing_token=req.token,
                detail=f"lease lost: {op[0]} not written (the key was taken over, or the "
                "store no longer has it: a Redis without persistence that restarted)",
            )
            return
        self.log_decision(
            "stored" if op[0] == "complete" else "released",
            req.method,
            req.path,
            status,
            req.started,
            req.key_hash,
            claim=req.claim,
        )


def _describe(error: BaseException | str | None) -> str:
    if error is None:
        return "incomplete response"
    return error if isinstance(error, str) else repr(error)


def _has_retry_after(headers: Iterable[tuple[Any, Any]]) -> bool:
    for name, _ in headers:
        if (name.lower() if isinstance(name, str) else name.lower().decode("latin-1")) == (
            "retry-after"
        ):
            return True
    return False


# ---------------------------------------------------------------------- the claim
@dataclass(frozen=True, slots=True)
class Claimed:
    """The key is ours: run the work under ``fencing_token``.

    Attributes:
        fencing_token: the token every later write of this claimant is fenced by.
        takeover: the claim took over an expired lease (its claimant stopped renewing).
        at: when it was claimed, on the caller's clock.
    """

    fencing_token: int
    takeover: bool
    at: float


#: What :func:`claim_key` ends with: the key is ours, or the decision that answers for it.
ClaimOutcome = Claimed | Replay | KeyReused | ReplayUnavailable | InProgress


def claim_key(
    key_hash: str,
    fingerprint: str,
    *,
    clock: Callable[[], float],
    lease: float,
    retention: float,
    wait: float = 0.0,
) -> Generator[Op, Any, ClaimOutcome]:
    """The claim conversation of SPEC §3, as store operations (sans-I/O; drive it with
    :func:`drive` or :func:`adrive`): claim the key, or let :func:`core.decide` say what the
    stored record means — take over an expired lease, claim a record released meanwhile, or
    end with the decision (replay, key reused, replay unavailable, in progress). One
    implementation for every claimant of a key: the middleware and the webhook receiver.

    Args:
        key_hash: the store's id of the key (SHA-256 hex of scope and key).
        fingerprint: what makes the work "the same" (SHA-256 hex).
        clock: Unix seconds (the caller's injected clock).
        lease, retention: seconds; the store keeps the record
            :func:`~retrysafe.core.key_retention` seconds (at least the lease).
        wait: seconds a running key is polled for (20 ms backing off to 250 ms, monotonic
            time) before ending with :class:`~retrysafe.core.InProgress`; 0 ends at once.

    Returns:
        :class:`Claimed`, or the decision that answers instead. After
        :data:`~retrysafe.core.RACE_LIMIT` lost races in a row (others claiming and releasing
        the key meanwhile) it ends with ``InProgress`` (1 s).
    """
    args = (key_hash, fingerprint)
    retention = key_retention(retention, lease)
    now = clock()
    try:
        claimed, record = yield (
            "claim", args, {"now": now, "lease": lease, "retention": retention}
        )
    except StoreUnavailableError as unavailable:
        answered = yield from _answered(key_hash, fingerprint, clock(), unavailable)
        return answered
    won: KeyRecord | None = record if claimed else None  # the record this call wrote
    takeover = False
    deadline = -1.0
    delay = _POLL_INITIAL
    races = 0
    while True:
        if won is not None:
            if clock() - now <= lease / 4:
                return Claimed(won.fencing_token, takeover, now)
            renewed_at = yield from _renew_late(key_hash, won.fencing_token, clock, lease)
            if renewed_at is not None:
                return Claimed(won.fencing_token, takeover, renewed_at)
            won = None
            record = yield ("get", (key_hash,), {})  # taken over meanwhile: what is it now?
            now = clock()
        decision = decide(record, fingerprint, now)
        if isinstance(decision, (Replay, KeyReused, ReplayUnavailable)):
            return decision
        if isinstance(decision, InProgress):
            if waited(wait) > 0:  # retrysafe.testing.no_waiting(): answer 409 at once
                t = time.monotonic()
                if deadline < 0:
                    deadline = t + wait
                if t < deadline:
                    yield ("sleep", (min(delay, deadline - t),), {})
                    delay = min(delay * 1.5, _POLL_MAX)
                    record = yield ("get", (key_hash,), {})
                    now = clock()
                    continue
            return decision
        races += 1
        if races > RACE_LIMIT:
            return InProgress(1.0, 1)
        if isinstance(decision, TakeOver):
            token = decision.fencing_token
            new = yield ("take_over", (key_hash, token), {"now": now, "lease": lease})
            if new is not None:
                won, takeover = new, True
                continue
            record = yield ("get", (key_hash,), {})
            now = clock()
            continue
        # Claim: the record was released or expired since we looked; claim it again.
        now = clock()
        claimed, record = yield (
            "claim", args, {"now": now, "lease": lease, "retention": retention}
        )
        if claimed:
            won, takeover = record, False


def _renew_late(
    key_hash: str, token: int, clock: Callable[[], float], lease: float
) -> Generator[Op, Any, float | None]:
    """Renew the claim of ``token``, which took more than a quarter of the lease to land;
    return when the work may start (the renewal's time, from which ``max_run_time`` counts:
    the wait was not the handler's run, a fresh user's check), or None once it was taken over
    meanwhile (the claim is not ours: run nothing).

    The store computes a claim's lease end from the time it was asked for (SQLite on the
    caller's clock). A claim that waited — another process held SQLite's write lock, a slow
    store — lands with that end near or past, and another claimant could take the key over
    and run the work a second time while this one runs it (a fresh user's check: a lock held
    12 s against the 10 s lease, two effects). So :func:`claim_key` renews such a claim,
    fenced by its token, before the work starts (SPEC §3 "Lease renewal"); a claim answered
    in time costs one clock read.

    Raises:
        StoreError: the renewal failed (the claim is never used: its lease runs out).
    """
    at = clock()
    renewed = yield ("extend_lease", (key_hash, token), {"now": at, "lease": lease})
    return at if renewed else None


def _answered(
    key_hash: str, fingerprint: str, now: float, unavailable: StoreUnavailableError
) -> Generator[Op, Any, Replay | KeyReused | ReplayUnavailable | InProgress]:
    """The answer a read can give for a key whose claim could not be written (a read-only
    file, a replica, another process's write lock past busy_timeout): what the claim would
    have led to — a replay, a reused key, or a request still in progress (409, as a claim
    that could be written answers; it was a 503 on WSGI and 409 on ASGI, a fresh user's
    check). A key that needs a write (absent, expired, released, a lease to take over)
    raises ``unavailable`` (503).

    Raises:
        StoreUnavailableError: ``unavailable``, when the key needs a write or cannot be read.
    """
    try:
        record = yield ("get", (key_hash,), {})
    except StoreError:
        raise unavailable from None
    decision = decide(record, fingerprint, now)
    if isinstance(decision, (Replay, KeyReused, ReplayUnavailable, InProgress)):
        return decision
    raise unavailable


def settle(op: Op, *, wait: float | None) -> Generator[Op, Any, bool]:
    """Run a fenced completing or releasing ``op``, retrying while the store is unavailable.

    A store that is briefly unavailable (locked, restarting, a dropped connection) must not
    turn finished work into a lost record, so ``StoreUnavailableError`` is retried with capped
    backoff (50 ms doubling to 500 ms) for ``wait`` seconds, or for ever when ``wait`` is None
    (the background record). The op is fenced by its token, so a retry can never overwrite a
    new owner's record.

    Returns:
        Whether the store applied the operation (False: the claim was taken over). A
        completion retried after "unavailable" that finds the key already completed under
        its own token counts as applied (the earlier try landed).

    Raises:
        StoreError: still unavailable after ``wait`` seconds, or any other store error.
    """
    delay = _SETTLE_INITIAL
    until = None if wait is None else time.monotonic() + wait
    retried = False
    while True:
        try:
            ok = yield op
            if not ok and retried and op[0] == "complete":
                # A try that failed as "unavailable" may have landed all the same (a store
                # that stalled, then ran it): this retry then finds the key completed under
                # its own token, which is this request's record, not a take-over.
                record = yield ("get", (op[1][0],), {})
                ok = (
                    record is not None
                    and record.fencing_token == op[1][1]
                    and record.state is KeyState.COMPLETED
                )
        except StoreUnavailableError:
            if until is not None and time.monotonic() + delay >= until:
                raise
            yield ("sleep", (delay,), {})
            delay = min(delay * 2.0, _SETTLE_MAX)
            retried = True
            continue
        return bool(ok)


# ---------------------------------------------------------------------- drivers
def call_op(store: Any, op: Op) -> Any:
    """Run one store operation synchronously (``"sleep"`` sleeps)."""
    name, args, kwargs = op
    if name == "sleep":
        time.sleep(args[0])
        return None
    return getattr(store, name)(*args, **kwargs)


async def acall_op(store: Any, op: Op) -> Any:
    """Run one store operation on an :class:`~retrysafe.stores.AsyncKeyStore`."""
    name, args, kwargs = op
    if name == "sleep":
        await asyncio.sleep(args[0])
        return None
    return await getattr(store, name)(*args, **kwargs)


def drive(gen: Generator[Op, Any, _R], store: Any) -> _R:
    """Run an engine conversation against a sync store.

    Store errors are thrown into the generator, which may handle them (:meth:`Engine.settle`)
    or let them propagate to the caller.
    """
    try:
        op = next(gen)
        while True:
            try:
                value = call_op(store, op)
            except StoreError as exc:
                op = gen.throw(exc)
                continue
            op = gen.send(value)
    except StopIteration as stop:
        result: _R = stop.value
        return result


async def adrive(gen: Generator[Op, Any, _R], store: Any) -> _R:
    """Run an engine conversation against an async store (see :func:`drive`)."""
    try:
        name, args, kwargs = next(gen)
        while True:
            # acall_op, inlined: one coroutine less per store operation.
            try:
                if name == "sleep":
                    await asyncio.sleep(args[0])
                    value = None
                else:
                    value = await getattr(store, name)(*args, **kwargs)
            except StoreError as exc:
                name, args, kwargs = gen.throw(exc)
                continue
            name, args, kwargs = gen.send(value)
    except StopIteration as stop:
        result: _R = stop.value
        return result
