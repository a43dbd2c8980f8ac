"""The HTTP engine under every client-side path: one request out, one answer (or one
classified failure) back.

Two engines share one contract, :class:`Engine`:

* :class:`AiohttpEngine` — the default. aiohttp's connection pool and HTTP/1.1 parser,
  driven directly: on this project's 2-core machine it sends 10–15× as many requests per
  second as httpx's own pool (README, *Performance*; ``benchmarks/http_engines.py``).
* :class:`HttpxEngine` — when the caller hands over an ``httpx`` transport (``MockTransport``
  in tests, a proxy, an instrumented transport): httpx stays the API and the seam.

Both give the same guarantees, which is what lets the worker switch engines freely:

* **no retries inside** — an engine sends once; retries live in one layer (SPEC §5);
* **timeouts** — connect (``connect_timeout``) and between reads (``read_timeout``); the
  caller bounds the whole exchange (the per-attempt total);
* **bounded memory** — the answer's body is read to its end (a 2xx whose body breaks off is a
  truncated answer, SPEC §5) but only its first ``keep`` bytes are kept: a 50 MB body costs
  one read buffer, not 50 MB;
* **TLS verified** against the system's trust store, server name checked;
* **no redirects, no proxies from the environment, no compression asked for** (the body is
  read as sent);
* **the SSRF guard** (SPEC §6), given as an :class:`AddressGuard`: every new connection's
  addresses are resolved once and checked, and the connection goes to a checked address;
* **driver errors translated in one place per engine** into :class:`WireError`, whose
  ``sent`` says which row of the SPEC §5 table applies: False when no byte of the request
  can have reached the server (refused, DNS failure, connect timeout, TLS handshake failed,
  destination refused by the guard), True otherwise (the effect may have committed).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import ipaddress
import logging
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from retrysafe._http import drop_tracebacks, no_cookie_jar

if TYPE_CHECKING:
    import aiohttp
    import httpx
    from yarl import URL

__all__ = [
    "TESTED_AIOHTTP",
    "AddressGuard",
    "AiohttpEngine",
    "Answer",
    "Engine",
    "HttpxEngine",
    "WireError",
    "aiohttp_session",
    "check_aiohttp",
    "check_transport",
    "make_engine",
    "total_timeout",
]

logger = logging.getLogger("retrysafe.client")

Headers = Sequence[tuple[str, str]]

#: The largest answer header line and field (bytes), and the most fields, the default engine
#: takes (httpx's h11 takes as much; aiohttp's defaults are 8,190 bytes and 128 fields).
_MAX_HEADER_LINE = 128 * 1024
_MAX_HEADER_FIELDS = 1024

#: The most bytes of one answer's head (its status line and header fields together) the
#: default engine reads; a longer head is a protocol error (sent, so retried with the same
#: key). The two limits above alone let one answer's head hold 128 MiB, which the parser
#: keeps in memory, and any endpoint may send it (a webhook receiver): a fresh user's
#: endpoint of 1,000 fields of 100 KiB each took a worker at concurrency 8 to 1.6 GB.
MAX_ANSWER_HEAD = 256 * 1024
#: Bytes of an answer's chunk framing (sizes, CRLFs) past which framing over
#: 1/``FRAMING_SHARE`` of the body is a malformed answer: about 11,000 chunks of 16 bytes or
#: 13,000 of one byte, some 30 ms of the worker's CPU. Chunks of 48 bytes and more (framing
#: 6 bytes each) are never refused for their framing; a server's usual chunks are kilobytes.
MAX_FRAMING = 64 * 1024
FRAMING_SHARE = 8


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete HTTP answer.

    Attributes:
        status: the status code.
        headers: the answer's header fields (case-insensitive lookup with ``.get``).
        body: the first ``keep`` bytes of the body (as sent: never decompressed).
        size: the body's whole length in bytes (all of it was read).
        raw_headers: every header field as received, in order, duplicates kept (proxies).
        reason: the reason phrase (may be empty).
    """

    status: int
    headers: Mapping[str, str]
    body: bytes
    size: int
    raw_headers: Sequence[tuple[bytes, bytes]] = ()
    reason: str = ""


#: The longest message a :class:`WireError` keeps, in characters (longer ones end in "…").
_MESSAGE_CHARS = 1000


class WireError(Exception):
    """No complete answer: what went wrong, and whether the request may have been sent.

    Attributes:
        kind: a short, stable name of what happened, as recorded in an attempt's
            ``error_type`` (``"ConnectError"``, ``"ConnectTimeout"``, ``"ReadTimeout"``,
            ``"RemoteProtocolError"``, ``"ReadError"``, ``"WriteError"``,
            ``"UnsupportedProtocol"``, ``"DestinationRefused"``, or the class name of an
            unexpected error).
        sent: False when no byte of the request can have reached the server.
        expected: False for an error no engine should raise (a bug, logged with its traceback).
    """

    def __init__(self, kind: str, message: str, *, sent: bool, expected: bool = True) -> None:
        # One line: a job's last_error and the tables show it (aiohttp's parser errors span
        # lines: "Bad status line:\n  Expected HTTP/…").
        # At most _MESSAGE_CHARS characters: a parser's error quotes the line it refused,
        # which may be a 256 KiB run of junk (four times that as a bytes repr).
        text = " ".join(message[: 4 * _MESSAGE_CHARS].split())
        if len(text) > _MESSAGE_CHARS or (text and len(message) > 4 * _MESSAGE_CHARS):
            text = text[: _MESSAGE_CHARS - 1] + "…"
        super().__init__(text or kind)
        self.kind = kind
        self.sent = sent
        self.expected = expected


class AddressGuard(Protocol):
    """Checks destinations before any connection is made (the SSRF guard, SPEC §6)."""

    def check_literal(self, host: str, port: int, url: str) -> None:
        """Refuse an IP-literal host (raise :class:`WireError`, ``sent=False``)."""

    def resolve(self, host: str, port: int, url: str) -> list[str]:
        """Resolve a host name (blocking) and check every address; return them in resolver
        order, or raise :class:`WireError` (``sent=False``)."""


class Engine(Protocol):
    """One HTTP exchange at a time per call; many calls may run concurrently."""

    async def send(
        self, method: str, url: str, *, headers: Headers, body: bytes | None, keep: int
    ) -> Answer:
        """Send one request and read its whole answer, keeping the first ``keep`` body bytes.

        Raises:
            WireError: no complete answer (see its ``sent``). Cancellation propagates.
        """

    async def aclose(self) -> None:
        """Close every pooled connection. Idempotent."""


def total_timeout(seconds: float, loop: asyncio.AbstractEventLoop | None = None) -> _Deadline:
    """An async context manager that cancels its block after ``seconds`` and raises
    ``asyncio.TimeoutError`` (``TimeoutError`` on Python 3.11+).

    The rule is ``asyncio.timeout``'s (3.11+: a cancellation from outside while the timer runs
    stays a cancellation, told apart by the task's cancel count), on one timer handle and no
    look-up of the running loop when ``loop`` is given: the attempt's hot path (the worker
    sends thousands a second; ``asyncio.timeout`` asks for the running loop three times, a
    ``getpid`` system call each on Python 3.11).

    Args:
        seconds: the limit, in seconds.
        loop: the running event loop, if the caller knows it (default: looked up on entry).
    """
    return _Deadline(seconds, loop)


class _Deadline:
    """See :func:`total_timeout`. One use per instance, inside a task."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_seconds", "_task")

    def __init__(self, seconds: float, loop: asyncio.AbstractEventLoop | None) -> None:
        self._seconds = seconds
        self._loop = loop
        self._fired = False
        self._cancelling = 0

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop() if self._loop is None else self._loop
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("total_timeout() must be used inside a task")
        self._task = task
        if sys.version_info >= (3, 11):  # tasks count cancellations from 3.11 on
            self._cancelling = task.cancelling()
        self._handle = loop.call_later(self._seconds, self._fire)

    def _fire(self) -> None:
        self._fired = True
        self._task.cancel()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        self._handle.cancel()
        if self._fired:
            left = 0
            if sys.version_info >= (3, 11):
                left = self._task.uncancel()
            if exc_type is asyncio.CancelledError and left <= self._cancelling:
                raise asyncio.TimeoutError from exc


# ---------------------------------------------------------------------------- aiohttp


def _user_agent() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"retrysafe/{version('retrysafe')}"
    except PackageNotFoundError:  # pragma: no cover (running from a source tree)
        return "retrysafe"


def aiohttp_session(
    *,
    limit: int,
    connect_timeout: float,
    read_timeout: float | None,
    guard: AddressGuard | None = None,
    headers: Mapping[str, str] | None = None,
    skip_auto_headers: Sequence[str] = (),
    request_class: type[aiohttp.ClientRequest] | None = None,
    keepalive_timeout: float = 15.0,
) -> aiohttp.ClientSession:
    """A pooled aiohttp session as every client-side path of retrysafe sends with (the
    outbox's engine, the gateway's upstream side), opened in the running event loop: at most
    ``limit`` connections in all, a TCP connect bounded by ``connect_timeout`` seconds and
    each read by ``read_timeout`` (None: the caller bounds the exchange), the connections on
    :func:`_connector_class`'s protocol (the answer's head and framing capped, a connection
    closed at the first byte nobody asked for), the SSRF ``guard`` (every new connection
    resolved and checked; no DNS cache then), answers read as sent (never decompressed), no
    redirects, no proxies or credentials from the environment, no cookie jar, and **no
    retries inside** (SPEC §5). ``headers`` go on every request; ``skip_auto_headers`` are
    the fields aiohttp would otherwise add; ``request_class`` replaces aiohttp's own; an idle
    connection is kept ``keepalive_timeout`` seconds (aiohttp's default 15)."""
    import aiohttp

    resolver = None if guard is None else _guard_resolver(guard)
    connector = _connector_class()(
        limit=limit,
        limit_per_host=0,
        # With the guard, every new connection resolves and checks (no DNS cache):
        # nothing connects to an address that was not checked for it.
        use_dns_cache=guard is None,
        resolver=resolver,
        ssl=True,
        keepalive_timeout=keepalive_timeout,
    )
    extra: dict[str, Any] = {}
    if request_class is not None:
        extra["request_class"] = request_class
    if skip_auto_headers:
        extra["skip_auto_headers"] = tuple(skip_auto_headers)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout, sock_read=read_timeout
        ),
        headers=headers,
        # aiohttp's defaults (8,190-byte lines and fields, 128 fields) refuse answers that
        # other clients take; an answer over these is a protocol error (sent, unknown).
        max_line_size=_MAX_HEADER_LINE,
        max_field_size=_MAX_HEADER_LINE,
        max_headers=_MAX_HEADER_FIELDS,
        auto_decompress=False,
        trust_env=False,
        raise_for_status=False,
        # No cookie jar: each job is its own request, and a Set-Cookie in one answer (an
        # API's session, a webhook receiver's, one gateway client's) must never ride along
        # on the next request to that host — it may be another tenant's.
        cookie_jar=aiohttp.DummyCookieJar(),
        **extra,
    )
    # aiohttp re-sends PUT, DELETE (and GET, HEAD, OPTIONS, TRACE) once, by itself, when the
    # connection breaks (ClientOSError, ServerDisconnectedError), on any connection: a second
    # request per attempt, after the first may have committed. No retries inside (SPEC §5):
    # there is no public switch, only this attribute.
    session._retry_connection = False
    return session


class AiohttpEngine:
    """The default engine: aiohttp, one pooled ``ClientSession``, opened on first use in the
    running event loop (so construct it anywhere; use it in one loop).

    Args:
        connect_timeout: seconds to open a connection (TCP and TLS).
        read_timeout: seconds to wait for each read of the answer.
        max_connections: connections in the pool (all hosts together).
        guard: the SSRF guard, or None to connect anywhere.
        attempt_timeout: the caller's promise that every :meth:`send` runs under
            :func:`total_timeout` of at most this many seconds (the outbox's attempts do).
            When ``read_timeout`` is at least that long, a read timer could never fire
            before the total one (it starts later, once the request is written), so
            aiohttp's per-read timers, two per request, are left out: about 6 % of the
            instructions of a small request (docs/performance.md). Reads that wait on a
            body still get :func:`_read_body`'s own bound.
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int = 100,
        guard: AddressGuard | None = None,
        attempt_timeout: float | None = None,
    ) -> None:
        check_aiohttp()
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._timed_reads = attempt_timeout is None or read_timeout < attempt_timeout
        self._max_connections = max(1, max_connections)
        self._guard = guard
        self._literal_ok: set[str] = set()
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        self._session = aiohttp_session(
            limit=self._max_connections,
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout if self._timed_reads else None,
            guard=self._guard,
            # "identity" said out loud: without Accept-Encoding a server may use any coding
            # (RFC 9110 §12.5.3), and a compressed problem document would lose its type.
            headers={"User-Agent": _user_agent(), "Accept-Encoding": "identity"},
        )
        return self._session

    def _check_literal(self, url: str) -> None:
        # Keyed by the URL up to its path (scheme and authority): the same string always
        # names the same host and port, so later jobs to an origin parse nothing.
        key = "/".join(url.split("/", 3)[:3])
        if key in self._literal_ok:
            return
        from yarl import URL

        parsed = URL(url)
        host = parsed.raw_host or ""
        port = parsed.explicit_port or (443 if parsed.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            pass  # a name: the resolver checks it when a connection is opened
        else:
            assert self._guard is not None
            self._guard.check_literal(host, port, url)
        if len(self._literal_ok) < 4096:
            self._literal_ok.add(key)

    async def send(
        self, method: str, url: str, *, headers: Headers, body: bytes | None, keep: int
    ) -> Answer:
        import aiohttp

        session = self._session or self._open()
        try:
            if self._guard is not None:
                self._check_literal(url)
            async with session.request(
                method,
                _as_sent(url),
                headers=headers,
                data=body,
                allow_redirects=False,
                # No Content-Type of aiohttp's own (application/octet-stream) on a body sent
                # without one: the request goes as the job stored it. Asked for only then:
                # skipping costs aiohttp a header copy per request.
                skip_auto_headers=(
                    None if _has_content_type(headers) else _NO_CONTENT_TYPE
                ),
            ) as response:
                kept, size = await _read_body(response, keep, self._read_timeout)
                return Answer(
                    response.status,
                    response.headers,
                    kept,
                    size,
                    response.raw_headers,
                    response.reason or "",
                )
        except _Stalled as exc:
            raise exc.take() from None
        except aiohttp.ClientError as exc:
            drop_tracebacks(exc)
            raise _from_aiohttp(exc) from exc
        except (ValueError, LookupError) as exc:  # a URL or header aiohttp cannot send
            raise WireError("UnsupportedProtocol", str(exc), sent=False) from exc

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


_NO_CONTENT_TYPE = ("Content-Type",)


def _has_content_type(headers: Headers) -> bool:
    """Whether ``headers`` name a Content-Type (a loop, not ``any()`` over a generator: this
    runs once per request)."""
    for name, _ in headers:  # noqa: SIM110
        if len(name) == 12 and name.lower() == "content-type":
            return True
    return False


#: A URL every character of which may appear in a URI as it is (RFC 3986 §2: unreserved,
#: reserved, and ``%`` only as the start of a percent-encoded octet).
_SENDABLE = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")


def _as_sent(url: str) -> URL:
    """``url`` as the request will carry it: byte for byte when it may go on the wire as it
    is, so that ``%2F`` in a signed query, ``%3B`` in a path segment or ``%2e%2e`` stay what
    the job stored (aiohttp would otherwise decode and re-encode them, and a signed URL would
    no longer match its signature). Any other URL (non-ASCII text, a bare ``%``, a literal
    ``.`` or ``..`` segment) is normalised as httpx normalises it, so both engines send the
    same request target. The last :data:`_SENT_CACHED` URLs of up to
    :data:`_CACHED_URL_LENGTH` characters are kept (a webhook endpoint's URL, an API's one
    endpoint: the same string on every attempt; yarl's ``URL`` is immutable).

    Raises:
        WireError: ``UnsupportedProtocol`` (not sent) for a URL httpx cannot normalise.
    """
    if len(url) <= _CACHED_URL_LENGTH:
        return _as_sent_cached(url)
    return _parse_as_sent(url)


#: How many URLs :func:`_as_sent` keeps, and the longest it keeps (at most 2 MiB in all).
_SENT_CACHED = 1024
_CACHED_URL_LENGTH = 2048


def _parse_as_sent(url: str) -> URL:
    from yarl import URL

    if _SENDABLE.fullmatch(url) is None or "/." in url:
        import httpx

        try:
            url = str(httpx.URL(url))
        except httpx.InvalidURL as exc:  # nothing was sent: as aiohttp's own InvalidURL
            raise WireError("UnsupportedProtocol", str(exc), sent=False) from exc
    return URL(url, encoded=True)


_as_sent_cached = functools.lru_cache(maxsize=_SENT_CACHED)(_parse_as_sent)


def _from_aiohttp(exc: aiohttp.ClientError) -> WireError:
    """aiohttp's errors, translated once (the order matters: subclasses first)."""
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    message = str(exc)
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        if isinstance(cause, _Refused):
            return cause.error
        # Refused, unreachable, DNS failure, TLS handshake or certificate: nothing was sent.
        return WireError("ConnectError", message, sent=False)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return WireError("ConnectTimeout", message, sent=False)
    if isinstance(exc, (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)):
        return WireError("UnsupportedProtocol", message, sent=False)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return WireError("ReadTimeout", message, sent=True)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        # Its message is the answer's head when the server closed after sending one (a
        # RawResponseMessage's repr): say that, not the repr.
        head = exc.message
        code = getattr(head, "code", None)
        if isinstance(head, str) and head:
            return WireError("RemoteProtocolError", head, sent=True)
        after = f" after the status line ({code})" if isinstance(code, int) else ""
        return WireError("RemoteProtocolError", f"server disconnected{after}", sent=True)
    if isinstance(exc, aiohttp.ClientPayloadError):
        # aiohttp wraps the parser's error ("<ContentLengthError: 400, message='Not enough
        # data…'>", a 400 of its own again): keep its words, not its repr.
        causes = (*exc.args, exc.__cause__, exc.__context__)
        inner = next((c for c in causes if isinstance(c, HttpProcessingError)), None)
        if inner is not None and inner.message:
            head = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
            head = head.split(": <", 1)[0] or "truncated answer"
            message = f"{head}: {inner.message}"
        return WireError("ReadError", message or "truncated answer", sent=True)
    if isinstance(exc, aiohttp.ClientResponseError):
        # An answer that breaks HTTP's grammar: aiohttp words it as a 400 of its own ("400,
        # message=…"), which reads as though the server had answered 400.
        return WireError("RemoteProtocolError", f"malformed answer: {exc.message}", sent=True)
    if isinstance(exc, aiohttp.ClientOSError):
        return WireError("ReadError", message, sent=True)
    if isinstance(exc, aiohttp.ClientConnectionResetError):  # writing to a lost connection
        return WireError("WriteError", message or "connection lost", sent=True)
    if isinstance(exc, aiohttp.ClientConnectionError):  # "Failed to send bytes into …"
        return WireError("ReadError", message or "connection lost", sent=True)
    return WireError(type(exc).__name__, message, sent=True, expected=False)


async def _read_body(
    response: aiohttp.ClientResponse, keep: int, read_timeout: float
) -> tuple[bytes, int]:
    """Read ``response``'s body to its end; return its first ``keep`` bytes and its size.

    aiohttp's ``sock_read`` bounds every read but one: a body that breaks the HTTP grammar
    after its headers were read (a bad chunk size in a later packet) is reported on the
    connection, not on the body stream, and its read timer is dropped, so the read would wait
    for ever. A read that has to wait is therefore bounded here too; when it expires on a
    connection that already failed, the error is a protocol error, else a read timeout.
    """
    content = response.content
    connection = response.connection
    protocol = None if connection is None else connection.protocol
    try:
        return await _read_all(content, protocol, keep, read_timeout)
    except BaseException:
        # What the body's stream still holds is never read now, and aiohttp's response,
        # stream and protocol refer to one another (a cycle a full collection frees): let
        # go of the bytes now (a broken chunked body's 64 KiB chunks added up to 128 MB
        # over 1,000 attempts, a fresh user's check).
        content._buffer.clear()
        content._size = 0
        raise


async def _read_all(
    content: aiohttp.StreamReader, protocol: Any, keep: int, read_timeout: float
) -> tuple[bytes, int]:
    """:func:`_read_body`'s loop."""
    kept = b""
    size = 0
    while True:
        chunk = content.read_nowait(-1)  # what is buffered: no timer for a body already here
        if not chunk:
            if content.at_eof():
                break
            timer = asyncio.get_running_loop().call_later(
                read_timeout, _stall, content, protocol, read_timeout
            )
            try:
                chunk = await content.readany()
            finally:
                timer.cancel()
            if not chunk:
                break
        if size < keep:
            kept += chunk[: keep - size]
        size += len(chunk)
    return kept, size


class _Stalled(Exception):
    """Ends a body read that waited ``read_timeout`` for nothing (see :func:`_read_body`)."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error: WireError | None = error

    def take(self) -> WireError:
        """The error, handed over once: this exception forgets it and its own traceback (the
        body read's frames and buffers), so the error raised in its place, whose context
        this is, makes no reference cycle with it."""
        error, self.error = self.error, None
        self.__traceback__ = None
        assert error is not None, "a stalled read's error is taken once"
        return error


def _stall(content: aiohttp.StreamReader, protocol: Any, read_timeout: float) -> None:
    """End the waiting read of ``content``: the connection's own error, or a read timeout."""
    failed = None if protocol is None else protocol.exception()
    if failed is not None:
        error = _failed_mid_body(failed)
    else:
        error = WireError("ReadTimeout", f"no answer data for {read_timeout:g} s", sent=True)
    content.set_exception(_Stalled(error))


def _failed_mid_body(failed: BaseException) -> WireError:
    """The error of an answer whose connection failed (``failed``) before the body's end:
    the parser's own words when it failed on the answer."""
    message = getattr(failed, "message", None)
    if isinstance(message, str) and message:
        return WireError("RemoteProtocolError", f"malformed answer: {message}", sent=True)
    return WireError(
        "RemoteProtocolError",
        f"the connection failed before the answer's end ({failed!r})",
        sent=True,
    )


#: An answer head's end: its empty line, after CRLF or a bare LF.
_HEAD_END = re.compile(rb"\n\r?\n")


def _head_end(tail: bytes, data: bytes, start: int) -> int:
    """Where in ``data``, from ``start``, an answer's head ends (just after its empty line),
    or -1; ``tail``: the head's last bytes before ``data`` (its end split between two reads;
    looked at from ``start`` 0 only). One scan from ``start``: a read of many heads is split
    in linear time."""
    if start == 0 and tail:
        joined = tail + data[:2]
        found = _HEAD_END.search(joined)
        if found is not None and found.end() > len(tail):
            return found.end() - len(tail)
    found = _HEAD_END.search(data, start)
    return -1 if found is None else found.end()


class _Refused(OSError):
    """Carries a guard's refusal through aiohttp's resolver call (which wraps OSErrors)."""

    def __init__(self, error: WireError) -> None:
        super().__init__(str(error))
        self.error = error


#: The aiohttp releases the engine was tested with (``pyproject.toml`` asks for 3.11 or later).
TESTED_AIOHTTP = "3.11 to 3.14"


#: The names of aiohttp's modules the engine imports, besides the classes whose methods and
#: attributes :func:`_aiohttp_gaps` checks.
_AIOHTTP_NAMES = (
    ("client_reqrep", "ConnectionKey"),
    ("connector", "Connection"),
    ("tracing", "Trace"),
    ("http_exceptions", "HttpProcessingError"),
    ("abc", "AbstractResolver"),
    ("abc", "ResolveResult"),
)


def _aiohttp_name(module: str, name: str) -> Any:
    """``aiohttp.<module>.<name>``, or None when that module or name is not there."""
    try:
        return getattr(importlib.import_module(f"aiohttp.{module}"), name, None)
    except ImportError:
        return None


def _aiohttp_gaps() -> list[str]:
    """What of aiohttp's internals that :func:`_protocol_class`, :func:`_connector_class` and
    :func:`_guard_resolver` drive is not there: names they import, methods they override or
    call, and attributes the classes' own ``__init__`` sets (read from its code, no instance
    made)."""

    def sets(cls: Any, name: str) -> bool:
        code = getattr(getattr(cls, "__init__", None), "__code__", None)
        return code is not None and name in code.co_names

    gaps = [f"aiohttp.{m}.{n}" for m, n in _AIOHTTP_NAMES if _aiohttp_name(m, n) is None]
    # (module, class, methods called or overridden, attributes its __init__ sets)
    classes = (
        (
            "client_proto",
            "ResponseHandler",
            ("set_response_params", "feed_data", "data_received", "set_exception"),
            ("_payload",),
        ),
        (
            "streams",
            "StreamReader",
            ("is_eof", "exception", "set_exception"),
            ("total_bytes", "_buffer", "_size"),
        ),
        ("connector", "BaseConnector", (), ("_factory", "_loop")),
    )
    for module, name, methods, attributes in classes:
        cls = _aiohttp_name(module, name)
        if cls is None:
            gaps.append(f"aiohttp.{module}.{name}")
            continue
        gaps += [f"{name}.{m}" for m in methods if not callable(getattr(cls, m, None))]
        gaps += [f"{name}.{a}" for a in attributes if not sets(cls, a)]
        if name == "ResponseHandler" and not hasattr(cls, "should_close"):
            gaps.append("ResponseHandler.should_close")  # a property
    return gaps


def check_aiohttp() -> None:
    """Refuse an aiohttp whose internals are not those the default engine drives (its head
    and framing caps, the stray-answer check): with them gone it would still send, without
    the bounds that keep a hostile endpoint from taking the worker's memory.

    Raises:
        ConfigurationError: (``option="transport"``) the installed aiohttp lacks one of them;
            the message names them, the tested releases (:data:`TESTED_AIOHTTP`) and the ways
            out: such an aiohttp, or ``transport=httpx.AsyncHTTPTransport()`` (httpx's own
            pool, slower, its own bounds).
    """
    gaps = _aiohttp_gaps()
    if not gaps:
        return
    import aiohttp

    from retrysafe._exceptions import ConfigurationError

    raise ConfigurationError(
        f"retrysafe's HTTP engine drives aiohttp's connection internals, and aiohttp "
        f"{aiohttp.__version__} lacks {', '.join(gaps)} (tested with aiohttp "
        f"{TESTED_AIOHTTP}): install a tested release (pip install 'aiohttp>=3.11,<3.15'), "
        "or, from Python, pass transport=httpx.AsyncHTTPTransport() to send through httpx's "
        "own pool",
        option="transport",
    )


@functools.cache
def _protocol_class() -> type[aiohttp.client_proto.ResponseHandler]:
    """aiohttp's connection protocol, giving its parser at most :data:`MAX_ANSWER_HEAD`
    bytes of heads per answer (every byte from the request, or from the end of an answer
    nobody asked for, to the end of the final head, 1xx heads included, counted before the
    parser gets it), each head apart from what follows it in the same read, the body
    phase's framing bounded (:meth:`HeadCapped._body_read`), and a connection closed at the
    first byte nobody asked for."""
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.http_exceptions import HttpProcessingError

    class HeadCapped(ResponseHandler):
        #: Bytes of the awaited answer's head still allowed, or None: an answer's body is
        #: being read (its final head arrived).
        _head_left: int | None = None
        #: A final (not 1xx) answer's head arrived since the head was awaited.
        _answered = False
        #: The last two bytes of the head read so far (an end split between two reads).
        _head_tail = b""

        #: Bytes read in the answer's body phase, and of them since the body last grew.
        _fed = 0
        _idle = 0

        def _await_head(self) -> None:
            self._head_left = MAX_ANSWER_HEAD
            self._answered = False
            self._head_tail = b""
            self._fed = self._idle = 0

        def _body_read(self, payload: Any, data: bytes) -> None:
            """``data`` of the answer's body phase to the parser; what of it is no body
            (chunk sizes, trailer fields) is counted. Refused: a run of more than
            :data:`MAX_ANSWER_HEAD` bytes in which the body did not grow (trailer fields,
            which the parser keeps: ~100 MB took 1.6 GB), and over :data:`MAX_FRAMING` bytes
            of framing that are over 1/:data:`FRAMING_SHARE` of the body (chunks of a few
            bytes, which cost the worker a call each: one endpoint streaming them took a
            core until the attempt's timeout, other destinations' jobs waited). The parser may
            hold part of a read back (it pauses every 16,384 chunks or so) and deliver it
            later, so the framing rule leaves the last read out of the framing and adds it
            to the body."""
            before = getattr(payload, "total_bytes", 0)
            super().data_received(data)
            body = getattr(payload, "total_bytes", 0)
            self._fed += len(data)
            self._idle = 0 if body > before else self._idle + len(data)
            framing = self._fed - body
            if payload.is_eof():
                return
            # What the parser held back of this read counts as framing above; it is at
            # most this read, body or not: the framing rule goes by what is sure. Bytes
            # since the body last grew (trailer fields) have their own rule.
            sure, most = framing - self._idle - len(data), body + len(data)
            if self._idle > MAX_ANSWER_HEAD:
                self._refuse(
                    f"over {MAX_ANSWER_HEAD:,} bytes of the answer without any body "
                    "(trailer fields)"
                )
            elif sure > MAX_FRAMING and sure * FRAMING_SHARE > most:
                self._refuse(
                    f"the answer's framing (chunk sizes) is over {MAX_FRAMING:,} bytes and "
                    f"1/{FRAMING_SHARE} of its body (chunks of a few bytes)"
                )

        def _refuse(self, why: str) -> None:
            """End the answer as malformed (``why``) and close the connection."""
            if self.transport is not None:
                self.transport.close()
            self.set_exception(HttpProcessingError(message=why))

        def set_response_params(self, *args: Any, **kwargs: Any) -> None:
            super().set_response_params(*args, **kwargs)
            self._await_head()  # a request's answer is awaited from now on

        def feed_data(self, data: Any, size: int = 0) -> None:
            super().feed_data(data, size)
            code = getattr(data[0], "code", None) if isinstance(data, tuple) and data else None
            if isinstance(code, int) and not (100 <= code < 200 and code != 101):
                self._answered = True  # a final answer (1xx ones are interim)

        def data_received(self, data: bytes) -> None:
            if not data:  # aiohttp's own call, resuming its parser after a pause
                payload = self._payload
                before = getattr(payload, "total_bytes", 0)
                super().data_received(data)
                if getattr(payload, "total_bytes", 0) > before:
                    self._idle = 0  # the body grew: what came before it was no trailer
                return
            if self._head_left is None:
                payload = self._payload
                if payload is None:
                    self._await_head()  # bytes before the request's answer was asked for
                elif payload.is_eof():
                    # Bytes after a complete answer, before the next request: an answer
                    # nobody asked for. Nothing reads it, so its messages would pile up
                    # while the connection waits in the pool: the connection is closed.
                    if self.transport is not None:
                        self.transport.close()
                    return
                else:
                    self._body_read(payload, data)
                    return
            pos, size = 0, len(data)
            while pos < size:
                # The head ends at its first empty line (CRLF, or a bare LF that the parser
                # takes too); each head, 1xx ones included, goes to the parser apart from
                # what follows it: the parser drops every answer of a read it fails on, so
                # bytes sent after a complete answer (a Content-Length counted in
                # characters, a 204 with a body) voided it. They fail only what follows the
                # answer now (the connection is closed, never reused).
                end = _head_end(self._head_tail, data, pos)
                stop = size if end < 0 else end
                left = (self._head_left or 0) - (stop - pos)
                if left < 0:
                    self._head_left = None
                    self._refuse(f"the answer's head is over {MAX_ANSWER_HEAD:,} bytes")
                    return
                self._head_left = left
                # A head that goes on in the next read keeps its last bytes (its end may
                # be split between the two); the next head starts afresh.
                self._head_tail = (self._head_tail + data[pos:stop])[-2:] if end < 0 else b""
                super().data_received(data if (pos, stop) == (0, size) else data[pos:stop])
                pos = stop
                if self._answered:
                    self._head_left = None
                    payload = self._payload
                    if pos < size and payload is not None:
                        self._body_read(payload, data[pos:])
                    elif pos < size:
                        super().data_received(data[pos:])
                    return
                if self.exception() is not None:
                    return  # the parser failed: nothing more is read

        def set_exception(self, exc: BaseException, *args: Any, **kwargs: Any) -> None:
            # Kept on the protocol, whose frames its traceback names: a cycle holding the
            # read's buffers until a full collection (see drop_tracebacks).
            drop_tracebacks(exc)
            super().set_exception(exc, *args, **kwargs)
            # A body that breaks HTTP's grammar in a later read (a bad chunk size): aiohttp
            # fails the connection but leaves the body's read waiting, to its timeout (the
            # whole attempt, counted as congested). End that read now, with the error.
            payload = self._payload
            if (
                isinstance(exc, HttpProcessingError)
                and payload is not None
                and not payload.is_eof()
                and payload.exception() is None
            ):
                payload.set_exception(_Stalled(_failed_mid_body(exc)))

    return HeadCapped


@functools.cache
def _connector_class() -> type[aiohttp.TCPConnector]:
    """aiohttp's connector, on :func:`_protocol_class`'s protocol, except that a pooled
    connection which received data while it
    waited (an answer nobody asked for: a server that answered one request twice) is closed
    instead of reused. aiohttp checks for leftover data only when a connection goes back to
    the pool, so data that arrived later was read by the next request as its own answer: a
    job SUCCEEDED in a millisecond whose request never reached the server. An answer that
    arrives after the next request left cannot be told apart by any HTTP/1.1 client."""
    import aiohttp

    protocol = _protocol_class()

    class Capped(aiohttp.TCPConnector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._factory = functools.partial(protocol, loop=self._loop)

    if not inspect.iscoroutinefunction(getattr(aiohttp.TCPConnector, "_get", None)):
        return Capped  # an aiohttp whose pool works otherwise: as it is

    from aiohttp.client_reqrep import ConnectionKey
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace

    class Connector(Capped):
        async def _get(self, key: ConnectionKey, traces: list[Trace]) -> Connection | None:
            while True:
                conn = await super()._get(key, traces)
                if conn is None:
                    return None
                protocol = getattr(conn, "protocol", None)
                if protocol is None or not getattr(protocol, "should_close", False):
                    return conn
                conn.close()  # closes the connection: nothing in it belongs to a request

    return Connector


def _guard_resolver(guard: AddressGuard) -> aiohttp.abc.AbstractResolver:
    """An aiohttp resolver that returns only checked addresses (or refuses the host)."""
    from aiohttp.abc import AbstractResolver, ResolveResult

    class GuardResolver(AbstractResolver):
        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ) -> list[ResolveResult]:
            try:
                addresses = await asyncio.to_thread(guard.resolve, host, port, f"{host}:{port}")
            except WireError as exc:
                raise _Refused(exc) from exc
            return [
                ResolveResult(
                    hostname=host,
                    host=address,
                    port=port,
                    family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                    proto=0,
                    flags=socket.AI_NUMERICHOST,
                )
                for address in addresses
            ]

        async def close(self) -> None:
            return None

    return GuardResolver()


# ---------------------------------------------------------------------------- httpx


class HttpxEngine:
    """An engine over a caller's ``httpx`` transport (tests, proxies, instrumentation).

    The answer is streamed: only ``keep`` bytes of its body are held.

    Args:
        transport: the transport that sends; it is closed with the engine.
        connect_timeout, read_timeout: as for :class:`AiohttpEngine` (httpx's ``connect``,
            ``read``, ``write`` and ``pool`` timeouts).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        *,
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        import httpx

        timeout = httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=read_timeout, pool=read_timeout
        )
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=timeout,
            follow_redirects=False,
            trust_env=False,
            headers={"Accept-Encoding": "identity"},
            # As the default engine: no cookie is kept from one answer for another request.
            cookies=no_cookie_jar(),
        )

    async def send(
        self, method: str, url: str, *, headers: Headers, body: bytes | None, keep: int
    ) -> Answer:
        import httpx

        try:
            async with self._client.stream(
                method, url, headers=list(headers), content=body
            ) as response:
                kept = b""
                size = 0
                if response.is_stream_consumed:
                    # The transport answered with a body it had already read (MockTransport,
                    # a buffering transport): streaming it again raises StreamConsumed.
                    whole = response.content
                    kept, size = whole[:keep], len(whole)
                else:
                    async for chunk in response.aiter_raw():
                        if size < keep:
                            kept += chunk[: keep - size]
                        size += len(chunk)
                return Answer(
                    response.status_code,
                    response.headers,
                    kept,
                    size,
                    response.headers.raw,
                    response.reason_phrase,
                )
        except httpx.HTTPError as exc:
            raise _from_httpx(exc) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def _from_httpx(exc: httpx.HTTPError) -> WireError:
    """httpx's errors, translated once: the class name is the kind (a transport's own
    subclass keeps its name), and the "not sent" classes are httpx's connect failures."""
    import httpx

    not_sent = (
        httpx.ConnectError,
        httpx.ConnectTimeout,
        httpx.PoolTimeout,
        httpx.UnsupportedProtocol,
    )
    return WireError(type(exc).__name__, str(exc), sent=not isinstance(exc, not_sent))


def check_transport(transport: object) -> None:
    """Refuse anything but ``None`` or an async httpx transport, when it is given rather than
    when the first job fails on it; with ``None`` (the default engine), an aiohttp the engine
    cannot drive (:func:`check_aiohttp`).

    Raises:
        ConfigurationError: ``transport`` has no ``handle_async_request`` (a sync
            ``httpx.HTTPTransport``, a client instead of a transport, any other object); or
            it is None and the installed aiohttp lacks what the default engine drives.
    """
    if transport is None:
        check_aiohttp()
        return
    from retrysafe._exceptions import ConfigurationError

    handle = getattr(transport, "handle_async_request", None)
    if isinstance(transport, type):
        problem = f"the class {transport.__name__}, not an instance (add the parentheses)"
    elif not callable(handle):
        problem = f"not {type(transport).__name__}"
        if callable(getattr(transport, "handle_request", None)):
            problem += " (a sync transport; use httpx.AsyncHTTPTransport or httpx.MockTransport)"
        elif hasattr(transport, "send") and hasattr(transport, "aclose"):
            problem += " (a client; pass its transport, or httpx.AsyncHTTPTransport())"
    elif _not_implemented(transport):
        problem = f"{type(transport).__name__}, which does not implement handle_async_request"
    elif inspect.isfunction(getattr(handle, "__func__", handle)) and not (
        inspect.iscoroutinefunction(handle)
    ):
        problem = f"{type(transport).__name__}, whose handle_async_request is not async def"
    else:
        return
    raise ConfigurationError(
        f"transport must be an httpx.AsyncBaseTransport instance (it needs an async "
        f"handle_async_request): {problem}",
        option="transport",
    )


def _not_implemented(transport: object) -> bool:
    """Whether ``transport`` inherits httpx's abstract ``handle_async_request`` unchanged."""
    import httpx

    base = httpx.AsyncBaseTransport.handle_async_request
    return getattr(type(transport), "handle_async_request", None) is base


def make_engine(
    *,
    connect_timeout: float,
    read_timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
    max_connections: int = 100,
    guard: AddressGuard | None = None,
    attempt_timeout: float | None = None,
) -> Engine:
    """The engine for a client-side path: :class:`HttpxEngine` over ``transport`` when one
    is given (with ``guard``, the caller wraps the transport itself), else the default
    :class:`AiohttpEngine` (``attempt_timeout``: as there)."""
    if transport is not None:
        return HttpxEngine(transport, connect_timeout=connect_timeout, read_timeout=read_timeout)
    return AiohttpEngine(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_connections=max_connections,
        guard=guard,
        attempt_timeout=attempt_timeout,
    )
