"""A reverse proxy ASGI app: the gateway forwards every request to one HTTP upstream.

Wrapped in :class:`~retrysafe.server.IdempotencyMiddleware` it gives idempotency to a service
nobody can modify, whatever its language. Request and response bodies stream through (aiohttp
on the upstream side, as every client-side path of retrysafe sends: httpx's own pool made the
gateway 0.07 x the upstream's rate on 3,000 small keyed POSTs); hop-by-hop headers (RFC 9110
§7.6.1) are dropped; ``X-Forwarded-*`` are added; nothing else is added (no ``User-Agent``,
``Accept`` or ``Accept-Encoding`` of the client library's own). A request body goes on framed
as it came: with its ``Content-Length``, or chunked when the client chunked it.

An unreachable upstream answers ``502 bad-gateway`` and a slow one ``504``; both are 5xx:
when nothing reached the upstream (connection refused) the middleware releases the key and
the client's retry runs again; when the request was sent and the answer never came (the
total deadline passed, a reset), the outcome is unknown and the key stays claimed until its
lease ends — except that an answer head merely slow is still awaited after the 504 (while
the key is renewed) and recorded for the retry. A body that breaks off mid-answer ends the
response unfinished (the server cuts the connection) and is logged as one line, never a
traceback.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
from yarl import URL

from retrysafe._exceptions import ConfigurationError
from retrysafe._http import HOP_BY_HOP, drop_tracebacks
from retrysafe._wire import WireError, _from_aiohttp, _Stalled, aiohttp_session
from retrysafe.client._jobs import _check_url, shown_url
from retrysafe.core import Problem
from retrysafe.server._outcome import (
    SCOPE_KEY,
    answer_early,
    can_answer_early,
    mark_client_stalled,
    mark_outcome_unknown,
)

if TYPE_CHECKING:
    import aiohttp

__all__ = ["ReverseProxy", "validate_upstream"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("retrysafe.gateway")

#: Connections the gateway's upstream pool keeps. Requests awaited past the timeout hold
#: theirs; once all are taken, a new request waits for one at the gateway's own gate and,
#: when none frees within the timeout, is answered 502 as never sent (its key released).
_CONNECTIONS = 256

#: Seconds an idle upstream connection is kept for the next request: shorter than the idle
#: timeouts of common servers (gunicorn 2 s; uvicorn, Node.js, Apache 5 s; aiohttp's default
#: is 15 s). A request written to a connection the upstream is closing at that moment fails
#: as possibly sent (the upstream may have read it): a 502 whose key stays claimed.
_KEEPALIVE = 1.5

# Hop-by-hop fields (RFC 9110 §7.6.1) and fields this proxy recomputes (Host, from the
# upstream's URL). ``Expect: 100-continue`` is answered here (the ASGI server sends the 100
# when the body is read) and not passed on: aiohttp would hold the body back for an interim
# answer many upstreams never send.
_HOP_BY_HOP = HOP_BY_HOP | {b"host", b"expect"}

#: Fields aiohttp adds to a request that lacks them; a proxy sends the client's own only
#: (an ``Accept-Encoding: gzip`` of the proxy's would get a client that never asked for it a
#: compressed answer). Host is always set (from the upstream's URL).
_NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")

#: The request on its way out, as the upstream pool's request class sees it (a context
#: variable of the task that sends it): see :class:`_Sending`.
_SENDING: contextvars.ContextVar[_Sending | None] = contextvars.ContextVar(
    "retrysafe_gateway_sending", default=None
)


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

    The upstream side is one pooled aiohttp session (:func:`~retrysafe._wire.aiohttp_session`,
    the outbox's): :data:`_CONNECTIONS` connections, no retries inside (SPEC §5), no
    redirects, no cookie jar (cookies pass through as headers, both ways), answers passed on
    as sent (never decompressed), answer heads and chunk framing capped as for the outbox.

    Raises:
        ConfigurationError: bad upstream URL or timeout <= 0.
    """

    def __init__(self, upstream: str, *, timeout: float = 30.0) -> None:
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
        self._session: aiohttp.ClientSession | None = None
        # Requests in flight to the upstream, at most the pool's connections: the rest wait
        # here, each bounded by the timeout, and one that waited it out was never sent.
        self._gate: anyio.Semaphore | None = None

    def _open(self) -> tuple[aiohttp.ClientSession, anyio.Semaphore]:
        """The upstream session and the gate, opened in the running event loop on first use."""
        if self._session is None or self._gate is None:
            self._session = _session(self._timeout)
            self._gate = anyio.Semaphore(_CONNECTIONS)
        return self._session, self._gate

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

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
        path, refused = _target(scope)
        if refused is None and scope["method"].upper() == "CONNECT":
            # A tunnel to the authority it names: the upstream side would send it there.
            refused = "CONNECT (a tunnel) is not forwarded: the gateway forwards requests only"
        if refused is None and scope["method"] != scope["method"].upper():
            # aiohttp would send it upper-cased: a different method (RFC 9110 §9.1: names
            # are case-sensitive), and `post` under a key would escape the middleware's POST.
            refused = (
                f"the method {scope['method']!r} is not upper-case; method names are "
                "case-sensitive (RFC 9110 §9.1) and the gateway forwards upper-case ones only"
            )
        if refused is not None:
            await _problem(send, Problem("not-forwarded", 400, refused))
            log.warning("request not forwarded: %s", refused, extra={"upstream": self._shown})
            return
        url = self.upstream + path
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        # A request framed by Transfer-Encoding has reached us de-chunked: a Content-Length
        # beside it is not the body's (RFC 9112 §6.3: the encoding wins, and a proxy must
        # not send the length on), so the body goes on chunked. The fields a Connection
        # field names are that connection's only (RFC 9110 §7.6.1), and the forwarding
        # fields are this proxy's to write.
        dropped = _connection_fields(scope["headers"])
        if any(k.lower() == b"transfer-encoding" for k, _ in scope["headers"]):
            dropped |= {b"content-length"}
        headers: list[tuple[bytes, bytes]] = []
        # X-Forwarded-For and Forwarded go on with this hop added to the client's chain (as
        # proxies do); the client's own X-Forwarded-Proto and -Host are replaced by what
        # this hop saw.
        chain: list[bytes] = []
        elements: list[bytes] = []
        host = b""
        for k, v in scope["headers"]:
            name = k.lower()
            if name == b"host" and not host:
                host = v
            if name in dropped:
                continue
            if name == b"x-forwarded-for":
                chain.append(v)
            elif name == b"forwarded":
                elements.append(v)
            elif name not in _FORWARDING:
                headers.append((k, v))
        scheme = str(scope.get("scheme", "http")).encode("latin-1")
        client_addr = scope.get("client")
        peer = str(client_addr[0]).encode("latin-1") if client_addr else b""
        if peer:
            chain.append(peer)
        if chain:
            headers.append((b"x-forwarded-for", b", ".join(chain)))
        elements.append(_forwarded_element(peer, scheme, host))
        headers.append((b"forwarded", b", ".join(elements)))
        headers.append((b"x-forwarded-proto", scheme))
        if host:
            headers.append((b"x-forwarded-host", host))

        session, gate = self._open()
        with anyio.move_on_after(self._timeout) as waited:
            await gate.acquire()
        if waited.cancelled_caught:  # every connection busy for the timeout: never sent
            await self._unreachable(
                send, WireError("PoolTimeout", "no upstream connection came free", sent=False)
            )
            return
        try:
            await self._exchange(session, scope, send, url, headers, receive)
        finally:
            gate.release()

    async def _exchange(
        self,
        session: aiohttp.ClientSession,
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
        sending = _Sending()
        try:
            request = _request(session, scope["method"], url, headers, first, receive, sending)
        except WireError as exc:  # a URL or header field the upstream side cannot send
            await self._unreachable(send, exc)
            return
        answered_early = False  # the client got its 504 while the upstream still worked
        response: aiohttp.ClientResponse | None = None
        complete = False  # the whole answer was read from the upstream
        started = False  # the answer's start went to the client
        broke: WireError | None = None
        # One deadline for the whole exchange, on the upstream's time only: it is stopped
        # while the client takes the answer. A client that takes nothing for as long is
        # stalled: nothing more is sent to it, and the middleware still records the whole
        # answer for the retry (as if it had left).
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
                # Under the middleware, a head slower than the timeout is still awaited.
                if can_answer_early(scope):
                    response, answered_early = await self._head(
                        request, sending, scope, deadline
                    )
                else:
                    response = await request
                if not 100 <= response.status <= 599:
                    # Three digits, so the parser took it; no HTTP status all the same (RFC
                    # 9110 §15), and the server could not send it on: a malformed answer.
                    raise WireError(
                        "RemoteProtocolError",
                        f"the upstream answered status {response.status}, which is no HTTP "
                        "status (100-599)",
                        sent=True,
                    )
                hop = _connection_fields(response.raw_headers)
                out_headers = [
                    (k, v) for k, v in response.raw_headers if k.lower() not in hop
                ]
                head: Message = {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": out_headers,
                }
                # The head leaves with the first bytes of the body (or its end): a body that
                # breaks before any of it came is a 502, not a head the server must cut.
                async for chunk in response.content.iter_any():
                    if not started:
                        await to_client(head)
                        started = True
                    await to_client(
                        {"type": "http.response.body", "body": chunk, "more_body": True}
                    )
                complete = True
                if not started:
                    await to_client(head)
                    started = True
            # Kept without their tracebacks (drop_tracebacks): this frame is in them, and
            # a local naming the error would make a cycle holding the frames' buffers.
            except WireError as exc:
                broke = drop_tracebacks(exc)
            except _Stalled as exc:  # a body that broke HTTP's grammar in a later read
                broke = drop_tracebacks(exc.take())
            except _aiohttp_errors() as exc:
                broke = _from_aiohttp(drop_tracebacks(exc))
            finally:
                if response is not None:
                    # A whole answer's connection goes back to the pool; any other is closed
                    # (its request body may still be on its way: cut off, never completed).
                    if complete:
                        response.release()
                    else:
                        response.close()
        # Answers leave outside the deadline's scope: the last one records the key, and a
        # record must never be cancelled half-way.
        if sending.left:  # cut off upstream, never complete: nobody is left to answer
            log.warning(
                "client left mid-upload: the request was cut off upstream, never completed",
                extra={"upstream": self._shown},
            )
            return
        if broke is not None and not broke.sent:
            await self._unreachable(send, broke)
            return
        if deadline.cancelled_caught:
            broke = WireError(
                "ReadTimeout", f"no complete answer within {self._timeout:g} s", sent=True
            )
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
                extra={"upstream": self._shown, "error": _shown_error(broke)},
            )
            return
        if not started:
            timeout = broke.kind == "ReadTimeout"
            await _problem(
                send,
                Problem(
                    "gateway-timeout" if timeout else "bad-gateway",
                    504 if timeout else 502,
                    f"no complete answer from the upstream ({broke.kind}); it may "
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
                extra={"upstream": self._shown, "error": _shown_error(broke)},
            )
            return
        # The answer broke off mid-body: returning without its end makes the server cut the
        # connection, so the client sees a broken answer (never a complete-looking one).
        log.warning(
            "upstream body broke off",
            extra={"upstream": self._shown, "error": _shown_error(broke)},
        )

    async def _unreachable(self, send: Send, error: WireError) -> None:
        """Nothing reached the upstream: a plain 5xx, the key is released (SPEC §4)."""
        if error.kind == "UnsupportedProtocol":  # the request itself cannot go on
            why = f"the request was not sent upstream: {error}"
        else:
            why = f"upstream unreachable: {error.kind}"
        await _problem(send, Problem("bad-gateway", 502, why))
        log.warning(
            "upstream unreachable" if error.kind != "UnsupportedProtocol" else "request not sent",
            extra={"upstream": self._shown, "error": _shown_error(error)},
        )

    async def _head(
        self,
        request: Awaitable[aiohttp.ClientResponse],
        sending: _Sending,
        scope: Scope,
        deadline: anyio.CancelScope,
    ) -> tuple[aiohttp.ClientResponse, bool]:
        """The upstream's answer head, and whether the client was answered early.

        Under the idempotency middleware (:func:`~retrysafe.server._outcome.answer_early`):
        when no head came within the timeout, the client gets its ``504 gateway-timeout``
        now and the head is still awaited for as long as the key's claim is renewed (up to
        ``max_run_time`` from the claim), so that the upstream's late answer is recorded and
        a retry replays it instead of meeting 409 until the lease ends and then sending the
        request again. ``deadline`` is moved to the end of the whole exchange: the timeout
        from the start, or the end of the renewal after an early answer.

        A request that has not gone out by the timeout (``sending.started`` unset: it is
        still connecting) is given no early answer: the connect timeout (the same timeout)
        ends it as never sent, so its key is released (502), never held as if the upstream
        might have acted.

        Raises:
            WireError: no head within the timeout and no early answer possible, or none
                before the renewal ends (``ReadTimeout``, sent); still not sent after twice
                the timeout (``ConnectTimeout``, not sent); what sending the request raised.
        """
        start = anyio.current_time()
        deadline.deadline = math.inf  # this wait is timed here
        # The task copies the context it is made in (Python 3.10 takes no context argument):
        # this one, where _SENDING names this request.
        context = contextvars.copy_context()
        context.run(_SENDING.set, sending)
        task: asyncio.Task[aiohttp.ClientResponse] = context.run(
            asyncio.ensure_future, _await(request)
        )
        answered = False
        try:
            await asyncio.wait((task,), timeout=self._timeout)
            end = start + self._timeout
            if not task.done() and not sending.started:
                # Not sent yet (it connects): the connect timeout, this timeout too, ends it
                # as never sent.
                await asyncio.wait((task,), timeout=self._timeout)
                if not task.done() and not sending.started:
                    # Given up before any of it left: no await between this check and the
                    # cancel (finally), so it cannot start meanwhile.
                    raise WireError(
                        "ConnectTimeout", "no connection to the upstream came in time", sent=False
                    )
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
                    raise WireError(
                        "ReadTimeout", f"no answer head within {self._timeout:g} s", sent=True
                    )
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
                    raise WireError(
                        "ReadTimeout",
                        f"no answer head while the key was renewed ({left:g} s more)",
                        sent=True,
                    )
            response = task.result()
        except BaseException:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
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


class _Sending:
    """One request on its way upstream: ``started`` once the pool's request class began to
    write it on a connection (before that, it waited for its connect and nothing of it can
    have reached the upstream; see :func:`_session`); ``left`` once its client left before
    the end of its body."""

    __slots__ = ("left", "started")

    def __init__(self) -> None:
        self.started = False
        self.left = False


def _session(timeout: float) -> aiohttp.ClientSession:
    """The upstream pool: :data:`_CONNECTIONS` connections kept idle :data:`_KEEPALIVE`
    seconds, a connect bounded by ``timeout``, reads bounded by the exchange's own deadline,
    nothing added to a request (:data:`_NOT_ADDED`), and requests that say when they start
    to be written."""
    return aiohttp_session(
        limit=_CONNECTIONS,
        connect_timeout=timeout,
        read_timeout=None,
        skip_auto_headers=_NOT_ADDED,
        request_class=_marking_request_class(),
        keepalive_timeout=_KEEPALIVE,
    )


@functools.cache
def _marking_request_class() -> type[aiohttp.ClientRequest]:
    """aiohttp's request class, marking the :data:`_SENDING` request ``started`` as it is
    handed its connection, just before its head is written."""
    import aiohttp

    class Marking(aiohttp.ClientRequest):
        async def send(self, conn: Any) -> aiohttp.ClientResponse:
            sending = _SENDING.get()
            if sending is not None:
                sending.started = True
            return await super().send(conn)

    return Marking


@functools.cache
def _aiohttp_errors() -> type[aiohttp.ClientError]:
    """aiohttp's error base class (imported on first use)."""
    import aiohttp

    return aiohttp.ClientError


def _request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    first: Message,
    receive: Receive,
    sending: _Sending,
) -> Awaitable[aiohttp.ClientResponse]:
    """The upstream request, not yet sent: its answer head when awaited. The body streams
    from the client's ``first`` message on, framed as the client framed it: with its
    ``Content-Length`` (kept in ``headers``), else chunked; an empty first message that is
    also the last one is no body at all (aiohttp adds ``Content-Length: 0`` to a request
    other than GET, HEAD, OPTIONS or TRACE that lacks one).

    Raises:
        WireError: ``UnsupportedProtocol`` (not sent): a header field that is not UTF-8 (the
            upstream side writes fields as UTF-8, so another byte would change on the way).
    """
    fields: list[tuple[str, str]] = []
    for name, value in headers:
        try:
            fields.append((name.decode("ascii"), value.decode("utf-8")))
        except UnicodeDecodeError:
            raise WireError(
                "UnsupportedProtocol",
                f"the request's {name.decode('latin-1')!r} header field is neither ASCII nor "
                "UTF-8: the gateway forwards only those",
                sent=False,
            ) from None
    empty = not first.get("body") and not first.get("more_body", False)
    data = None if empty else _body(first, receive, sending)
    # As received, byte for byte: yarl keeps an encoded URL's dot segments and escapes.
    return session.request(
        method, URL(url, encoded=True), headers=fields, data=data, allow_redirects=False
    )


async def _await(request: Awaitable[aiohttp.ClientResponse]) -> aiohttp.ClientResponse:
    return await request


#: The forwarding fields this proxy writes itself (the client's X-Forwarded-For and
#: Forwarded are kept in the ones it writes, this hop added).
_FORWARDING = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"}
)

#: Fields no Connection field can make hop-by-hop here: the body's framing (dropping
#: Content-Length would send the body chunked) and the route (RFC 9110 §7.6.1: a field meant
#: for every recipient is no connection option).
_NOT_CONNECTION_OPTIONS = frozenset({b"content-length", b"transfer-encoding", b"host"})

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _forwarded_element(peer: bytes, scheme: bytes, host: bytes) -> bytes:
    """This hop's element of a Forwarded field (RFC 7239 §4): ``for`` the peer (an IPv6
    address bracketed, quoted), ``proto`` and ``host`` as seen here; a value that is no
    token is a quoted string."""

    def value(v: bytes) -> bytes:
        if _TOKEN.fullmatch(v):
            return v
        return b'"' + v.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'

    node = b"[" + peer + b"]" if b":" in peer else peer
    parts = [b"for=" + value(node or b"unknown"), b"proto=" + value(scheme)]
    if host:
        parts.append(b"host=" + value(host))
    return b";".join(parts)

_ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/]*")


def _target(scope: Scope) -> tuple[str, str | None]:
    """The path to forward (the request target's, from its first ``/``, as received: dot
    segments and percent-encodings kept), or why the request is not forwarded: a target
    that is no path (``@host/x``, ``*``, ``host:port``) would name another server once
    joined to the upstream's URL (``http://upstream:8000@host/x`` sends to ``host``). An
    absolute-form target (RFC 9112 §3.2.2) goes on by its path (and query): this proxy has
    one upstream."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8")
    if not raw.startswith(b"/"):
        absolute = _ABSOLUTE.match(raw)
        if absolute is None:
            shown = raw[:100].decode("latin-1")
            return "", (
                f"the request target {shown!r} is not a path starting with '/' (origin "
                "form, RFC 9112 §3.2.1): the gateway forwards paths only, to its one upstream"
            )
        raw = raw[absolute.end() :] or b"/"
    if not raw.isascii():
        return "", "the request target holds bytes that are not ASCII; it is not forwarded"
    return raw.decode("ascii"), None


def _connection_fields(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The fields not to pass on: hop-by-hop ones (RFC 9110 §7.6.1), Host and Expect
    (:data:`_HOP_BY_HOP`), and every field a Connection field names but those of
    :data:`_NOT_CONNECTION_OPTIONS`, lower-case."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    named -= _NOT_CONNECTION_OPTIONS
    return _HOP_BY_HOP | named if named else _HOP_BY_HOP


def _shown_error(error: WireError) -> str:
    return f"{error.kind}: {error}"


class _ClientLeft(Exception):
    """The client left before the end of its request body: the upstream must never get the
    request as complete (aiohttp then cuts the connection instead of ending the body)."""


async def _body(message: Message, receive: Receive, sending: _Sending) -> AsyncIterator[bytes]:
    """The body's chunks from ``message`` on; :class:`_ClientLeft` when the client leaves
    before its end (a shortened body must not reach the upstream as the whole one)."""
    while True:
        if message["type"] == "http.disconnect":
            sending.left = True
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
