"""The receiving side: verify Standard Webhooks and handle each ``webhook-id`` once.

Senders deliver at least once, so a receiver sees duplicates (a lost 200, a replay from the
DLQ). :class:`WebhookVerifier` checks the signature and timestamp, then claims the
``webhook-id`` through the very claim conversation the idempotency middleware runs
(:func:`retrysafe.server._engine.claim_key`, deciding with :func:`core.decide`, SPEC §3, §6):
the first delivery runs the handler (its lease renewed while it runs) and completes the claim;
a duplicate — the same id with the same body — is acknowledged without running it; the same
id with *another* body is a conflict (:class:`~retrysafe.WebhookIdReusedError`, 422), never a
silent duplicate; a handler that fails releases the claim so the sender's retry runs it again.
Use it directly (:meth:`WebhookVerifier.receive` / :meth:`WebhookVerifier.areceive`), as a
decorator (:meth:`WebhookVerifier.handler`) or as pure ASGI middleware
(:class:`WebhookMiddleware`). The async paths use the store's async face: no store call blocks
the event loop.

SPEC §6: a receiver checks the headers before it reads the body and bounds the body. The
middleware answers a missing header, a stale timestamp or a malformed signature header with 401
before it takes a single body chunk (:meth:`WebhookVerifier.check_headers`), refuses a declared
``Content-Length`` over ``max_body_size`` unread and cuts a longer body off as soon as it passes
the limit (413), so a request costs at most ``max_body_size`` bytes of memory whatever it sends.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from retrysafe._exceptions import (
    ConfigurationError,
    StoreError,
    WebhookIdReusedError,
    WebhookVerificationError,
)
from retrysafe._heartbeat import AsyncHeartbeat, Heartbeat
from retrysafe.core import (
    InProgress,
    KeyReused,
    LeaseTiming,
    StoredResponse,
    lease_timing,
)
from retrysafe.server._asgi import _content_length
from retrysafe.server._config import MAX_RETENTION
from retrysafe.server._engine import (
    RECORD_WAIT,
    Claimed,
    ClaimOutcome,
    Op,
    adrive,
    claim_key,
    drive,
    settle,
)
from retrysafe.stores._base import AsyncKeyStore, KeyStore
from retrysafe.webhooks._policy import DEFAULT_MAX_PAYLOAD
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

#: The largest webhook body :class:`WebhookMiddleware` reads by default, in bytes (1 MiB): the
#: largest payload a sender records by default (``_policy.DEFAULT_MAX_PAYLOAD``).
DEFAULT_MAX_BODY_SIZE = DEFAULT_MAX_PAYLOAD
#: The reason :func:`~retrysafe.webhooks._signing.verify` gives when only the signature itself
#: failed: every header is present and well formed, the timestamp within the tolerance.
_NO_MATCH = "no matching signature"

logger = logging.getLogger("retrysafe.webhooks")

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
        lease: seconds a delivery's claim holds without renewal (default 10 s): how long a
            receiver that died mid-handler blocks the id. A live handler renews it every
            ``heartbeat`` seconds (default lease / 3), up to ``max_run_time`` (default 600 s).
        clock: Unix-seconds clock.

    Raises:
        ConfigurationError: a malformed secret, bad durations (see
            :func:`~retrysafe.core.lease_timing`).
    """

    def __init__(
        self,
        secret: str | Iterable[str],
        *,
        store: KeyStore | str | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        retention: float = 7 * 24 * 3600.0,
        lease: float = 10.0,
        heartbeat: float | None = None,
        max_run_time: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        secrets = [secret] if isinstance(secret, str) else list(secret)
        self._keys = [parse_secret(s) for s in secrets]
        if not self._keys:
            raise ConfigurationError("at least one secret is needed", option="secret")
        for name, value, upper in (
            ("tolerance", tolerance, 86_400.0),
            ("retention", retention, MAX_RETENTION),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value <= upper
            ):
                raise ConfigurationError(
                    f"{name} must be > 0 and at most {upper:g} seconds, got {value!r}",
                    option=name,
                )
        self.timing: LeaseTiming = lease_timing(
            lease, heartbeat=heartbeat, max_run_time=max_run_time
        )
        self._owns_store = isinstance(store, str)
        if isinstance(store, str):
            from retrysafe.stores import open_store

            self.store: KeyStore | None = open_store(store)
        else:
            self.store = store
        self._astore: AsyncKeyStore | None = None
        self.tolerance = float(tolerance)
        self.retention = float(retention)
        self.lease = self.timing.lease
        self._clock = clock

    def close(self) -> None:
        """Close the store if this verifier opened it from a URL. Idempotent."""
        if self._owns_store and self.store is not None:
            self.store.close()
            self._owns_store = False

    def check_headers(self, headers: Headers) -> None:
        """Check everything that can be checked before the body is read (SPEC §6).

        The ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` headers are
        present, the timestamp is within the tolerance and the signature header is well
        formed (at most 4096 characters, at least one ``v1,<base64>``). Call it before reading
        a body your framework reads for you, so a stale or unsigned request costs nothing;
        :meth:`verify` still checks the signature against the body afterwards.

        Args:
            headers: as for :meth:`verify`.

        Raises:
            WebhookVerificationError: a missing or malformed header, or a timestamp outside
                the tolerance (its ``reason`` says which; answer 401).
            TypeError: headers of another type.
        """
        # The rules live once, in verify(): run them over an empty body. When the headers are
        # sound, only the signature can fail, and that is decided once the body is read.
        try:
            verify(self._keys, headers, b"", now=self._clock(), tolerance=self.tolerance)
        except WebhookVerificationError as exc:
            if exc.reason != _NO_MATCH:
                raise

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
        except RecursionError:
            raise WebhookVerificationError(
                "body is JSON nested too deeply to parse", webhook_id=webhook_id
            ) from None
        return webhook_id, payload

    # ------------------------------------------------------------------ the claim, once
    @staticmethod
    def _key_hash(webhook_id: str) -> str:
        return hashlib.sha256(b"webhook-id\x00" + webhook_id.encode()).hexdigest()

    def _claim(self, webhook_id: str, body: bytes) -> Generator[Op, Any, ClaimOutcome]:
        """The middleware's claim conversation for this delivery (fingerprint: the body)."""
        return claim_key(
            self._key_hash(webhook_id),
            hashlib.sha256(body).hexdigest(),
            clock=self._clock,
            lease=self.timing.lease,
            retention=self.retention,
        )

    def _renew(self, webhook_id: str, token: int) -> Op:
        return (
            "extend_lease",
            (self._key_hash(webhook_id), token),
            {"now": self._clock(), "lease": self.timing.lease},
        )

    def _finish(self, webhook_id: str, token: int, done: bool) -> Op:
        """Complete the claim (the handler succeeded) or release it (it failed)."""
        key_hash = self._key_hash(webhook_id)
        if done:
            return (
                "complete",
                (key_hash, token, _ACK),
                {"now": self._clock(), "retention": self.retention},
            )
        return ("release", (key_hash, token), {})

    @staticmethod
    def _answered(webhook_id: str, payload: Any, outcome: ClaimOutcome) -> Receipt:
        """The receipt for a delivery that does not run (or the conflict it is)."""
        if isinstance(outcome, KeyReused):
            raise WebhookIdReusedError(
                f"webhook-id {webhook_id!r} was already received with another body: a sender "
                "bug or a forged redelivery, not a duplicate",
                webhook_id=webhook_id,
                stored_fingerprint=outcome.stored_fingerprint,
                fingerprint=outcome.fingerprint,
            )
        busy = isinstance(outcome, InProgress)
        return Receipt(webhook_id, payload, not busy, busy)

    def receive(self, headers: Headers, body: Body, handler: Callable[[Any], _T]) -> Receipt:
        """Verify, then run ``handler(payload)`` once per ``webhook-id``.

        Raises:
            WebhookVerificationError: verification failed (answer 400/401; the handler did
                not run).
            WebhookIdReusedError: the id was already received with another body (answer
                422; the handler did not run).
            StoreError: the store could not claim the id, or could not record the handled
                one within a second (answer 503; the sender retries).
            Exception: whatever the handler raised (the claim is released, so the sender's
                retry runs it again).
            TypeError: headers or body of another type (see :meth:`verify`).
        """
        body = as_body(body)
        webhook_id, payload = self.verify(headers, body)
        store = self.store
        if store is None:
            return Receipt(webhook_id, payload, False, False, handler(payload))
        outcome = drive(self._claim(webhook_id, body), store)
        if not isinstance(outcome, Claimed):
            return self._answered(webhook_id, payload, outcome)
        token = outcome.fencing_token
        beat = Heartbeat(
            lambda: bool(drive(_one(self._renew(webhook_id, token)), store)),
            self.timing,
            clock=self._clock,
            started=outcome.at,
        ).start()
        try:
            result = handler(payload)
        except BaseException:
            beat.stop()
            drive(settle(self._finish(webhook_id, token, False), wait=RECORD_WAIT), store)
            raise
        try:
            drive(settle(self._finish(webhook_id, token, True), wait=RECORD_WAIT), store)
        finally:
            beat.stop()
        return Receipt(webhook_id, payload, False, False, result)

    def _async_store(self) -> AsyncKeyStore:
        if self._astore is None:
            from retrysafe.stores import as_async_key_store

            assert self.store is not None
            self._astore = as_async_key_store(self.store)
        return self._astore

    async def aclaim(self, webhook_id: str, body: bytes) -> ClaimOutcome:
        """Claim a verified delivery on the store's async face (see :meth:`areceive`)."""
        return await adrive(self._claim(webhook_id, body), self._async_store())

    def aheartbeat(self, webhook_id: str, claimed: Claimed) -> AsyncHeartbeat:
        """Renew a claimed delivery's lease from the event loop until ``stop()``."""
        astore = self._async_store()
        token = claimed.fencing_token

        async def renew() -> bool:
            return bool(await adrive(_one(self._renew(webhook_id, token)), astore))

        return AsyncHeartbeat(renew, self.timing, clock=self._clock, started=claimed.at).start()

    async def afinish(
        self, webhook_id: str, claimed: Claimed, done: bool, *, wait: float | None = RECORD_WAIT
    ) -> bool:
        """Complete (``done``) or release a claimed delivery on the async face, retrying a
        briefly unavailable store for ``wait`` seconds (default one; None: until it is
        available again). Returns False when the claim was taken over (nothing written).

        Raises:
            StoreError: still unavailable after ``wait``, or any other store error.
        """
        op = self._finish(webhook_id, claimed.fencing_token, done)
        return await adrive(settle(op, wait=wait), self._async_store())

    async def areceive(
        self,
        headers: Headers,
        body: Body,
        handler: Callable[[Any], Awaitable[_T]],
    ) -> Receipt:
        """:meth:`receive` for an async handler; every store call uses the store's async face."""
        body = as_body(body)
        webhook_id, payload = self.verify(headers, body)
        if self.store is None:
            return Receipt(webhook_id, payload, False, False, await handler(payload))
        outcome = await self.aclaim(webhook_id, body)
        if not isinstance(outcome, Claimed):
            return self._answered(webhook_id, payload, outcome)
        beat = self.aheartbeat(webhook_id, outcome)
        try:
            result = await handler(payload)
        except BaseException:
            beat.stop()
            await self.afinish(webhook_id, outcome, False)
            raise
        try:
            await self.afinish(webhook_id, outcome, True)
        finally:
            beat.stop()
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


def _one(op: Op) -> Generator[Op, Any, Any]:
    """A conversation of one store operation."""
    return (yield op)


class WebhookMiddleware:
    """Pure ASGI middleware that verifies webhooks on ``path`` and passes each
    ``webhook-id`` to the app once.

    Answers without calling the app (problem+json ``{"type": …}`` documents for 4xx/5xx):

    - before reading the body: 401 ``webhook-verification`` for a missing header, a timestamp
      outside the tolerance or a malformed ``webhook-signature`` (the body is never read);
      400 ``malformed-content-length`` for a ``Content-Length`` that is not one decimal number
      (or several that disagree, RFC 9112 §6.3); 413 ``body-too-large`` for a declared length
      over ``max_body_size``;
    - while reading it: 413 ``body-too-large`` as soon as the body passes ``max_body_size``
      (nothing more is read); 400 ``content-length-mismatch`` for a body longer or shorter
      than its ``Content-Length``; nothing at all when the client disconnects;
    - after reading it: 401 ``webhook-verification`` when no signature matches the body or it
      is not JSON, 200 ``{"duplicate": true}`` for an id already handled with the same body,
      422 ``webhook-id-reused`` for an id already received with another body, 409 with
      ``Retry-After`` while another delivery of it runs, 503 when the store cannot claim it.

    Nothing is claimed before the body is read and verified. While the app runs the claim's
    lease is renewed. A 2xx from the app completes the id before the end of the answer
    leaves (record before answer: when the store cannot record it within a second, the
    sender gets 503 ``store-unavailable`` instead and the record is retried in the
    background, the claim renewed meanwhile); anything else (or an exception) releases it so
    the sender's retry runs again. Other paths and methods pass through.

    Args:
        app: the ASGI application.
        verifier: a :class:`WebhookVerifier` (with a store, for deduplication).
        path: the webhook path (exact match), or None for every POST.
        max_body_size: the largest body read, in bytes (default 1 MiB); a request costs at
            most about this much memory.

    Raises:
        ConfigurationError: ``max_body_size`` is not a positive ``int``.
    """

    def __init__(
        self,
        app: _App,
        *,
        verifier: WebhookVerifier,
        path: str | None = None,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    ) -> None:
        if (
            isinstance(max_body_size, bool)
            or not isinstance(max_body_size, int)
            or max_body_size <= 0
        ):
            raise ConfigurationError(
                f"max_body_size must be a positive int of bytes, got {max_body_size!r}",
                option="max_body_size",
            )
        self.app = app
        self.verifier = verifier
        self.path = path
        self.max_body_size = max_body_size
        self._background: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: _Message, receive: _Receive, send: _Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or (self.path is not None and scope.get("path") != self.path)
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self.verifier.check_headers(headers)
        except WebhookVerificationError as exc:
            await _answer(send, 401, {"type": "webhook-verification", "detail": exc.reason})
            return
        read = await _read_body(scope["headers"], receive, self.max_body_size)
        if read is None:  # the client went away: nobody to answer, nothing claimed
            return
        if isinstance(read, _Refusal):
            await _answer(send, read.status, read.doc)
            return
        body = read
        try:
            webhook_id, _ = self.verifier.verify(headers, body)
        except WebhookVerificationError as exc:
            await _answer(send, 401, {"type": "webhook-verification", "detail": exc.reason})
            return
        verifier = self.verifier
        claimed: Claimed | None = None
        if verifier.store is not None:
            try:
                outcome = await verifier.aclaim(webhook_id, body)
            except StoreError:
                await _answer(send, 503, {"type": "store-unavailable"}, retry_after=True)
                return
            if isinstance(outcome, KeyReused):
                await _answer(
                    send,
                    422,
                    {
                        "type": "webhook-id-reused",
                        "webhook_id": webhook_id,
                        "detail": "this webhook-id was already received with another body",
                    },
                )
                return
            if isinstance(outcome, InProgress):
                await _answer(send, 409, {"in_progress": True}, retry_after=True)
                return
            if not isinstance(outcome, Claimed):
                await _answer(send, 200, {"duplicate": True, "webhook_id": webhook_id})
                return
            claimed = outcome
        sent_body = False

        async def replay() -> _Message:
            nonlocal sent_body
            if sent_body:
                return {"type": "http.disconnect"}
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}

        if claimed is None:
            await self.app(scope, replay, send)
            return
        beat = verifier.aheartbeat(webhook_id, claimed)
        answer = _RecordFirst(verifier, webhook_id, claimed, send)
        try:
            await self.app(scope, replay, answer)
        except BaseException:
            if answer.state is None:  # nothing recorded: the sender's retry runs it again
                beat.stop()
                await verifier.afinish(webhook_id, claimed, False)
            else:
                self._settled(answer, beat)
            raise
        if answer.state is None:
            # No complete answer went out: a 2xx the app started without ending it is
            # recorded all the same (its effect is done), anything else is released.
            await answer.record(answer.status is not None and 200 <= answer.status < 300)
        self._settled(answer, beat)

    def _settled(self, answer: _RecordFirst, beat: AsyncHeartbeat) -> None:
        """Stop renewing the claim, or, for a handled delivery whose record could not land,
        keep renewing it while the record is retried in the background."""
        if answer.state != "unrecorded":
            beat.stop()
            return
        task = asyncio.ensure_future(answer.record_later(beat))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _RecordFirst:
    """The app's ``send`` for a claimed delivery: a 2xx's end leaves only once the
    ``webhook-id`` is recorded as handled (record before answer, as the idempotency middleware
    does, SPEC §3), so a sender never takes an unrecorded 2xx for done.

    The start of the answer waits for its first body message; the message that ends it (the
    last, or the one that completes a declared ``Content-Length``) waits for the record. When
    the record cannot land within :data:`~retrysafe.server._engine.RECORD_WAIT` (the store is
    down or locked), the sender gets 503 ``store-unavailable`` instead of the app's answer
    (or, when part of a streamed answer already left, the answer is cut before its end), and
    the record is retried in the background while the claim's lease is renewed: a
    redelivery meanwhile gets 409, and once the record lands, ``duplicate``. ``state``: None
    until the delivery is settled, then ``"settled"`` (completed or released, or taken over)
    or ``"unrecorded"``.
    """

    __slots__ = (
        "claimed", "held", "length", "send", "size", "state", "status", "verifier", "webhook_id",
    )  # fmt: skip

    def __init__(
        self, verifier: WebhookVerifier, webhook_id: str, claimed: Claimed, send: _Send
    ) -> None:
        self.verifier = verifier
        self.webhook_id = webhook_id
        self.claimed = claimed
        self.send = send
        self.status: int | None = None
        self.held: _Message | None = None
        self.state: str | None = None
        self.length = -1  # the answer's declared Content-Length (-1: none)
        self.size = 0  # body bytes the app has sent

    async def __call__(self, message: _Message) -> None:
        if self.state == "unrecorded":
            return  # the sender was told 503: the app's answer goes nowhere
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.length = _content_length(message.get("headers") or ())
            self.held = message
            return
        if kind == "http.response.body":
            self.size += len(message.get("body", b""))
        # The end of the answer: the last body message, or the one that completes a declared
        # Content-Length (a client has the whole answer then, whatever follows).
        if kind == "http.response.body" and (
            not message.get("more_body", False) or 0 <= self.length <= self.size
        ):
            ok = self.status is not None and 200 <= self.status < 300
            if self.state is None and not await self.record(ok) and ok:
                if self.held is not None:
                    self.held = None
                    await _answer(
                        self.send,
                        503,
                        {
                            "type": "store-unavailable",
                            "detail": "the delivery was handled but could not be recorded; "
                            "retry it: it is not run again once the record lands",
                        },
                        retry_after=True,
                    )
                    return
                # Part of the answer left: cut it before its end, so no 2xx is complete.
                raise StoreError(
                    f"webhook-id {self.webhook_id!r} was handled but could not be recorded"
                )
        if self.held is not None:
            held, self.held = self.held, None
            await self.send(held)
        await self.send(message)

    async def record(self, done: bool) -> bool:
        """Complete (``done``) or release the claim, settling :attr:`state`; False when a
        completion could not land (``"unrecorded"``: :meth:`record_later` retries it). A
        release that cannot land is left to the lease: the sender's retry runs it again."""
        try:
            await self.verifier.afinish(self.webhook_id, self.claimed, done)
        except StoreError as exc:
            if not done:
                self.state = "settled"
                logger.warning(
                    "webhook-id %s: the failed delivery's claim could not be released (%s); "
                    "a redelivery runs it after the lease ends",
                    self.webhook_id,
                    exc,
                )
                return True
            self.state = "unrecorded"
            logger.error(
                "webhook-id %s was handled but could not be recorded (%s): answered 503 "
                "store-unavailable; the record is retried in the background while the "
                "claim's lease is renewed",
                self.webhook_id,
                exc,
            )
            return False
        self.state = "settled"
        return True

    async def record_later(self, beat: AsyncHeartbeat) -> None:
        """Retry the completion until the store takes it (or the claim was taken over),
        renewing the claim meanwhile; then stop renewing."""
        try:
            ok = await self.verifier.afinish(self.webhook_id, self.claimed, True, wait=None)
        except StoreError as exc:
            logger.error("webhook-id %s: the late record failed (%s)", self.webhook_id, exc)
        else:
            if ok:
                logger.warning(
                    "webhook-id %s was recorded after the store recovered; redeliveries "
                    "are duplicates",
                    self.webhook_id,
                )
            else:
                logger.warning(
                    "webhook-id %s: the claim was taken over before the late record",
                    self.webhook_id,
                )
        finally:
            beat.stop()


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A request refused while its body was framed or read: the answer to send."""

    status: int
    doc: dict[str, Any]


def _too_large(limit: int) -> _Refusal:
    return _Refusal(
        413,
        {
            "type": "body-too-large",
            "detail": f"the request body exceeds {limit} bytes, the most this receiver reads",
            "max_body_size": limit,
        },
    )


def _malformed_length(detail: str) -> _Refusal:
    return _Refusal(400, {"type": "malformed-content-length", "detail": detail})


def _declared_length(
    raw_headers: Iterable[tuple[bytes, bytes]], limit: int
) -> int | _Refusal | None:
    """The ``Content-Length`` the request declares, None when it declares none.

    RFC 9112 §6.3: one decimal number of bytes; several headers (or a ``"7, 7"`` list) must
    all agree. A length over ``limit`` comes back as ``limit + 1`` without converting its
    digits (a 10 MB string of them is still just "too large").
    """
    values: set[bytes] = set()
    for name, raw in raw_headers:
        if name.lower() != b"content-length":
            continue
        for item in raw.split(b","):
            digits = item.strip(b" \t")
            if not digits or not digits.isdigit():  # bytes.isdigit(): ASCII 0-9 only
                return _malformed_length(
                    "Content-Length must be one decimal number of bytes, got "
                    f"{raw[:40].decode('latin-1')!r}"
                )
            values.add(digits.lstrip(b"0") or b"0")
    if not values:
        return None
    if len(values) > 1:
        return _malformed_length("conflicting Content-Length headers")
    (digits,) = values
    if len(digits) > len(str(limit)):
        return limit + 1
    return min(int(digits), limit + 1)


async def _read_body(
    raw_headers: Iterable[tuple[bytes, bytes]], receive: _Receive, limit: int
) -> bytes | _Refusal | None:
    """The request body, read only while it stays within ``limit`` bytes and its declared
    ``Content-Length``; the refusal to answer instead; None when the client went away.

    A declared length over the limit is refused before anything is read; a body that passes
    the limit (or its declared length) is refused at the chunk that does, so at most ``limit``
    bytes plus one chunk are ever held.
    """
    declared = _declared_length(raw_headers, limit)
    if isinstance(declared, _Refusal):
        return declared
    if declared is not None and declared > limit:
        return _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                return _too_large(limit)
            if declared is not None and size > declared:
                break
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if declared is not None and size != declared:
        detail = (
            f"the body is longer than its Content-Length of {declared} bytes"
            if size > declared
            else f"the body ended after {size} of the {declared} bytes its Content-Length declares"
        )
        return _Refusal(400, {"type": "content-length-mismatch", "detail": detail})
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _answer(send: _Send, status: int, doc: dict[str, Any], retry_after: bool = False) -> None:
    body = json.dumps(doc).encode()
    ctype = b"application/problem+json" if status >= 400 else b"application/json"
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
