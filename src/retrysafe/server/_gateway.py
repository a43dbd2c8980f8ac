"""A reverse proxy ASGI app: the gateway forwards every request to one HTTP upstream.

Wrapped in :class:`~retrysafe.server.IdempotencyMiddleware` it gives idempotency to a service
nobody can modify, whatever its language. Request and response bodies stream through (httpx on
the upstream side); hop-by-hop headers (RFC 9110 §7.6.1) are dropped; ``X-Forwarded-*`` are
added. An unreachable upstream answers ``502 bad-gateway`` and a slow one ``504``; both are
5xx: when nothing reached the upstream (connection refused) the middleware releases the key
and the client's retry runs again; when the request was sent and the answer never came (the
total deadline passed, a reset), the outcome is unknown and the key stays claimed until its
lease ends — except that an answer head merely slow is still awaited after the 504 (while the
key is renewed) and recorded for the retry. A body that breaks off mid-answer ends the
response unfinished (the server cuts the connection) and is logged as one line, never a
traceback.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from retrysafe._exceptions import ConfigurationError
from retrysafe._http import HOP_BY_HOP, drop_tracebacks, no_cookie_jar
from retrysafe.client._jobs import _check_url, shown_url
from retrysafe.core import Problem
from retrysafe.server._outcome import (
    SCOPE_KEY,
    answer_early,
    can_answer_early,
    mark_client_stalled,
    mark_outcome_unknown,
)

__all__ = ["ReverseProxy", "validate_upstream"]

# Failures that prove the request never reached the upstream.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("retrysafe.gateway")

#: Connections the gateway's own upstream client keeps (max_connections). Requests awaited
#: past the timeout hold theirs; once all are taken, a new request waits for one and, when
#: none frees within the timeout, is answered 502 as never sent (its key released).
_CONNECTIONS = 256

# Hop-by-hop fields (RFC 9110 §7.6.1) and fields this proxy recomputes.
_HOP_BY_HOP = HOP_BY_HOP | {b"host"}


def validate_upstream(url: str) -> str:
    """Return ``url`` without a trailing slash.

    Raises:
        ConfigurationError: not an absolute ``http://`` or ``https://`` URL with a host and a
            valid port (the outbox's own check of a job's URL, which never prints a
            ``user:password@`` part), or one with a query or fragment.
    """
    _check_url(url, option="upstream")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigurationError(
            f"upstream {shown_url(url)!r} must not carry a query or fragment", option="upstream"
        )
    return url.rstrip("/")


class ReverseProxy:
    """ASGI app forwarding HTTP requests to ``upstream``.

    Args:
        upstream: base URL, e.g. ``http://127.0.0.1:8000`` (a path prefix is kept).
        timeout: total seconds one upstream exchange may take, from sending the request to the
            last body byte (default 30 s): a slow-drip upstream is cut off at the deadline.
            The time the client takes to read the answer is not counted (a slow client never
            makes an upstream that answered look timed out); a client that takes nothing for
            ``timeout`` seconds is stalled: nothing more is sent to it, and the idempotency
            middleware still records the whole answer for its retry. Under the middleware, a
            request whose answer head has not come by then is answered 504 at once and its
            head still awaited while its key is renewed, so that the late answer is recorded
            (:meth:`_head`).
        client: an ``httpx.AsyncClient`` to use (tests); by default one is created with
            transport-level retries off, so retries happen in one layer only (SPEC §5).

    Raises:
        ConfigurationError: bad upstream URL or timeout <= 0.
    """

    def __init__(
        self, upstream: str, *, timeout: float = 30.0, client: httpx.AsyncClient | None = None
    ) -> None:
        if isinstance(timeout, bool) or not (
            isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0
        ):
            raise ConfigurationError(
                f"gateway timeout must be a finite number of seconds > 0, got {timeout!r}",
                option="timeout",
            )
        self.upstream = validate_upstream(upstream)
        self._shown = shown_url(self.upstream)  # as logs show it: no credentials
        self._timeout = timeout
        self._client = client
        # Requests in flight to the upstream, at most the pool's connections (our own client
        # only): the rest wait here, not in httpcore's queue, whose every pass compares each
        # queued request with each connection (a burst of 300 slow requests made the
        # gateway CPU-bound there). None with a client of one's own: its limits are its own.
        self._gate: anyio.Semaphore | None = None

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._gate = anyio.Semaphore(_CONNECTIONS)
            self._client = httpx.AsyncClient(
                # The pool's limits go to the transport: a client given its own transport
                # ignores its `limits` (the pool was httpx's default 100, not 256).
                transport=httpx.AsyncHTTPTransport(
                    retries=0,
                    limits=httpx.Limits(
                        max_connections=_CONNECTIONS, max_keepalive_connections=64
                    ),
                ),
                timeout=httpx.Timeout(self._timeout),
                follow_redirects=False,
                trust_env=False,
                # Cookies pass through as headers, both ways; the client keeps none (a jar
                # would add one user's session cookie to the next anonymous request).
                cookies=no_cookie_jar(),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets are not proxied
            return
        await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("raw_path") or scope["path"].encode("utf-8")
        if isinstance(path, bytes):
            path = path.decode("latin-1")
        url = self.upstream + path
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # A request framed by Transfer-Encoding has reached us de-chunked: a Content-Length
        # beside it is not the body's (RFC 9112 §6.3: the encoding wins, and a proxy must
        # not send the length on), so the body goes on chunked.
        drop = _HOP_BY_HOP
        if any(k.lower() == b"transfer-encoding" for k, _ in scope["headers"]):
            drop = _HOP_BY_HOP | {b"content-length"}
        headers: list[tuple[bytes, bytes]] = [
            (k, v) for k, v in scope["headers"] if k.lower() not in drop
        ]
        client_addr = scope.get("client")
        if client_addr:
            headers.append((b"x-forwarded-for", str(client_addr[0]).encode("latin-1")))
        headers.append((b"x-forwarded-proto", str(scope.get("scheme", "http")).encode("latin-1")))
        for k, v in scope["headers"]:
            if k == b"host":
                headers.append((b"x-forwarded-host", v))
                break

        client = self._get_client()
        gate = self._gate
        if gate is None:
            await self._exchange(client, scope, send, url, headers, receive)
            return
        with anyio.move_on_after(self._timeout) as waited:
            await gate.acquire()
        if waited.cancelled_caught:  # every connection busy for the timeout: never sent
            await self._unreachable(send, httpx.PoolTimeout("no upstream connection came free"))
            return
        try:
            await self._exchange(client, scope, send, url, headers, receive)
        finally:
            gate.release()

    async def _exchange(
        self,
        client: httpx.AsyncClient,
        scope: Scope,
        send: Send,
        url: str,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
    ) -> None:
        """One upstream exchange, its answer sent on (or the problem that replaces it)."""
        first = await receive()  # after the gate: a client that left meanwhile sends nothing
        if first["type"] == "http.disconnect":
            log.warning(
                "client left before its request went out: nothing sent upstream",
                extra={"upstream": self._shown},
            )
            return
        # Under the middleware, a head slower than the timeout is still awaited (_head):
        # no read of it may time out before the key's renewal does.
        early = can_answer_early(scope)
        request = client.build_request(
            scope["method"], url, headers=headers, content=(body := _RequestBody(receive, first)),
            timeout=httpx.Timeout(self._timeout, read=None) if early else httpx.USE_CLIENT_DEFAULT,
        )  # fmt: skip
        answered_early = False  # the client got its 504 while the upstream still worked
        left_mid_body = False  # the client left before the end of its request body
        response: httpx.Response | None = None
        started = False  # the answer's start went to the client
        broke: BaseException | None = None
        unreachable: BaseException | None = None
        # One deadline for the whole exchange (httpx's own timeouts are per read), on the
        # upstream's time only: it is stopped while the client takes the answer. A client
        # that takes nothing for as long is stalled: nothing more is sent to it, and the
        # middleware still records the whole answer for the retry (as if it had left).
        stalled = False
        with anyio.move_on_after(self._timeout) as deadline:

            async def to_client(message: Message) -> None:
                nonlocal stalled
                if stalled and SCOPE_KEY not in scope:
                    return  # no middleware to record it: nobody takes the rest
                left = deadline.deadline - anyio.current_time()
                deadline.deadline = math.inf
                try:
                    with anyio.move_on_after(None if stalled else self._timeout) as wait:
                        await send(message)
                    if wait.cancelled_caught:
                        stalled = True
                        mark_client_stalled(scope)
                        log.warning(
                            "client stalled: it took no part of the answer for %g s; the "
                            "answer is still read and recorded for its retry",
                            self._timeout,
                            extra={"upstream": self._shown},
                        )
                finally:
                    deadline.deadline = anyio.current_time() + left

            try:
                if early:
                    response, answered_early = await self._head(
                        client, request, body, scope, deadline
                    )
                else:
                    response = await client.send(request, stream=True)
                if not 100 <= response.status_code <= 599:
                    # Three digits, so the parser took it; no HTTP status all the same (RFC
                    # 9110 §15), and the server could not send it on: a malformed answer.
                    raise httpx.RemoteProtocolError(
                        f"the upstream answered status {response.status_code}, which is "
                        "no HTTP status (100-599)"
                    )
                out_headers = [
                    (k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP
                ]
                head: Message = {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
                # The head leaves with the first bytes of the body (or its end): a body that
                # breaks before any of it came is a 502, not a head the server must cut.
                async for chunk in response.aiter_raw():
                    if chunk:
                        if not started:
                            await to_client(head)
                            started = True
                        await to_client(
                            {"type": "http.response.body", "body": chunk, "more_body": True}
                        )
                if not started:
                    await to_client(head)
                    started = True
            # Kept without their tracebacks (drop_tracebacks): this frame is in them, and
            # a local naming the error would make a cycle holding the frames' buffers.
            except _ClientLeft:
                left_mid_body = True
            except _NOT_SENT as exc:
                unreachable = drop_tracebacks(exc)
            except httpx.HTTPError as exc:
                broke = drop_tracebacks(exc)
            finally:
                if response is None or broke is not None:
                    _reclaim_orphans(client)  # a cancelled request's connection (see there)
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
        # Answers leave outside the deadline's scope: the last one records the key, and a
        # record must never be cancelled half-way.
        if left_mid_body:  # cut off upstream, never complete: nobody is left to answer
            log.warning(
                "client left mid-upload: the request was cut off upstream, never completed",
                extra={"upstream": self._shown},
            )
            return
        if unreachable is not None:
            await self._unreachable(send, unreachable)
            return
        if deadline.cancelled_caught:
            broke = httpx.ReadTimeout(f"no complete answer within {self._timeout:g} s")
        if broke is None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        # The request may have reached the upstream and committed: "I don't know" (SPEC §0).
        # Releasing the key would let a retry run the effect twice, so the key stays claimed
        # until its lease ends; repeats meanwhile get 409 request-in-progress.
        mark_outcome_unknown(scope)
        if answered_early:  # the client has its 504; the key stays claimed (outcome unknown)
            log.warning(
                "upstream outcome unknown: no complete answer while the key was renewed",
                extra={"upstream": self._shown, "error": repr(broke)},
            )
            return
        if not started:
            timeout = isinstance(broke, httpx.TimeoutException)
            await _problem(
                send,
                Problem(
                    "gateway-timeout" if timeout else "bad-gateway",
                    504 if timeout else 502,
                    f"no complete answer from the upstream ({type(broke).__name__}); it may "
                    "have acted on the request."
                    + (
                        " The key stays claimed while this gateway renews it (up to its "
                        "maximum run time), then until its lease ends (409 "
                        "request-in-progress meanwhile); a retry with the same "
                        "Idempotency-Key after that sends the request to the upstream again."
                        if SCOPE_KEY in scope
                        else ""
                    ),
                ),
            )
            log.warning(
                "upstream outcome unknown",
                extra={"upstream": self._shown, "error": repr(broke)},
            )
            return
        # The answer broke off mid-body: returning without its end makes the server cut the
        # connection, so the client sees a broken answer (never a complete-looking one).
        log.warning(
            "upstream body broke off",
            extra={"upstream": self._shown, "error": repr(broke)},
        )

    async def _unreachable(self, send: Send, error: BaseException) -> None:
        """Nothing reached the upstream: a plain 5xx, the key is released (SPEC §4)."""
        await _problem(
            send, Problem("bad-gateway", 502, f"upstream unreachable: {type(error).__name__}")
        )
        log.warning("upstream unreachable", extra={"upstream": self._shown, "error": repr(error)})

    async def _head(
        self,
        client: httpx.AsyncClient,
        request: httpx.Request,
        body: _RequestBody,
        scope: Scope,
        deadline: anyio.CancelScope,
    ) -> tuple[httpx.Response, bool]:
        """The upstream's answer head, and whether the client was answered early.

        Under the idempotency middleware (:func:`~retrysafe.server._outcome.answer_early`):
        when no head came within the timeout, the client gets its ``504 gateway-timeout``
        now and the head is still awaited for as long as the key's claim is renewed (up to
        ``max_run_time`` from the claim), so that the upstream's late answer is recorded and
        a retry replays it instead of meeting 409 until the lease ends and then sending the
        request again. ``deadline`` is moved to the end of the whole exchange: the timeout
        from the start, or the end of the renewal after an early answer.

        A request that has not gone out by the timeout (``body`` never asked for: it waits
        for a connection of the pool, or for its connect) is given no early answer: httpx's
        own pool and connect timeouts (the same timeout) end it as never sent, so its key is
        released (502), never held as if the upstream might have acted.

        Raises:
            httpx.ReadTimeout: no head within the timeout and no early answer possible, or
                none before the renewal ends.
            httpx.HTTPError: what sending the request raised.
        """
        start = anyio.current_time()
        deadline.deadline = math.inf  # this wait is timed here
        task = asyncio.ensure_future(client.send(request, stream=True))
        answered = False
        try:
            await asyncio.wait((task,), timeout=self._timeout)
            end = start + self._timeout
            if not task.done() and not body.started:
                # Not sent yet (it waits for a pooled connection, or connects): httpx's own
                # pool and connect timeouts, this timeout too, end it as never sent.
                await asyncio.wait((task,), timeout=self._timeout)
                if not task.done() and not body.started:
                    # Given up before any of it left: no await between this check and the
                    # cancel (finally), so it cannot start meanwhile.
                    raise httpx.PoolTimeout("no connection to the upstream came in time")
            if not task.done():
                problem = Problem(
                    "gateway-timeout",
                    504,
                    f"no answer from the upstream within {self._timeout:g} s; it may still be "
                    "acting on the request. The gateway waits for its answer while it renews "
                    "the key, and records it: a retry with the same Idempotency-Key gets 409 "
                    "request-in-progress until then, and that answer after (an error answer "
                    "- 5xx, 408, 429 - is not kept: that retry is sent again). Should the "
                    "gateway stop first, the key stays claimed until its lease ends, and a "
                    "retry after that sends the request again.",
                )
                left = await answer_early(scope, problem.status, *_encoded(problem))
                if left is None:
                    raise httpx.ReadTimeout(f"no answer head within {self._timeout:g} s")
                answered = True
                log.warning(
                    "upstream slow: the client got 504; the answer is awaited up to %g s more "
                    "and recorded for its retry",
                    left,
                    extra={"upstream": self._shown},
                )
                end = anyio.current_time() + left
                await asyncio.wait((task,), timeout=left)
                if not task.done():
                    raise httpx.ReadTimeout(
                        f"no answer head while the key was renewed ({left:g} s more)"
                    )
            response = task.result()
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                with anyio.CancelScope(shield=True):
                    await task.result().aclose()
            raise
        finally:
            if not task.done():
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait((task,))
            if not task.cancelled():
                task.exception()  # retrieved: the failure is the caller's, as raised here
        deadline.deadline = end
        return response, answered


def _reclaim_orphans(client: httpx.AsyncClient) -> int:
    """Drop from ``client``'s pool the connections cancelled requests left behind: made for
    a request, never connected, owned by none. httpcore 1.0.9 keeps them for ever (neither
    idle nor closed nor available) until every slot is taken and each request times out
    waiting for one (encode/httpcore#1093); the gateway cancels upstream requests at its
    deadlines and at shutdown. Returns how many; 0 where the pool is not httpcore's."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    connections = getattr(pool, "_connections", None)
    requests = getattr(pool, "_requests", None)
    if not isinstance(connections, list) or not isinstance(requests, list):
        return 0
    owned = {id(getattr(r, "connection", None)) for r in requests}
    orphans = [
        c
        for c in connections
        if id(c) not in owned
        and getattr(c, "_connection", False) is None
        and getattr(c, "_connect_failed", None) is False
    ]
    for connection in orphans:
        connections.remove(connection)
    return len(orphans)


class _ClientLeft(Exception):
    """The client left before the end of its request body: the upstream must never get the
    request as complete (httpcore then cuts the connection instead of ending the body)."""


class _RequestBody:
    """The client's request body as httpx streams it on, from its ``first`` message (read
    before anything is sent). ``started`` once httpx asked for its first chunk, which it
    does after writing the request head to the connection (httpcore sends the head, then
    the body): before that, the request waited for a connection and nothing of it reached
    the upstream."""

    __slots__ = ("first", "receive", "started")

    def __init__(self, receive: Receive, first: Message) -> None:
        self.receive = receive
        self.first = first
        self.started = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self.started = True
        return _body(self.first, self.receive)


async def _body(message: Message, receive: Receive) -> AsyncIterator[bytes]:
    """The body's chunks from ``message`` on; :class:`_ClientLeft` when the client leaves
    before its end (a shortened body must not reach the upstream as the whole one)."""
    while True:
        if message["type"] == "http.disconnect":
            raise _ClientLeft("the client left before the end of its request body")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return
        message = await receive()


def _encoded(problem: Problem) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """``problem``'s ASGI headers and body."""
    body = problem.body()
    return [(k.encode(), v.encode()) for k, v in problem.headers(len(body))], body


async def _problem(send: Send, problem: Problem) -> None:
    headers, body = _encoded(problem)
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
