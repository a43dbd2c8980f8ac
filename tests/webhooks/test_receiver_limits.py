"""The receiver checks the headers before it reads a body, and reads at most its limit (SPEC §6).

Most tests call :class:`WebhookMiddleware` directly with an ASGI ``receive()`` that would
yield a huge body in chunks from one reused buffer (so it costs no memory) and counts what the
middleware took; it fails the test on the first chunk read past what is allowed. What the
issue measured (a 300 MiB request with a 1970 timestamp: 164 s, 655 MB before its 401) is
shown here as behaviour: the answer came after zero body chunks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import httpx
import pytest

from retrysafe import ConfigurationError, WebhookVerificationError
from retrysafe._serving import ServerThread
from retrysafe.stores import MemoryStore
from retrysafe.webhooks import WebhookMiddleware, WebhookVerifier, signature_header

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MIB = 1024 * 1024
CHUNK = 64 * 1024
#: A well-formed signature that matches no body: enough to pass the checks made before reading.
SOME_SIGNATURE = "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="

Pairs = list[tuple[bytes, bytes]]


class Feed:
    """An ASGI ``receive()`` that would yield ``total`` bytes of ``content`` in ``chunk``-byte
    messages, then end the body (``end="complete"``) or report the client gone
    (``end="disconnect"``). It fails the test on the first chunk taken past ``allowed`` bytes."""

    def __init__(
        self,
        total: int,
        *,
        content: bytes | None = None,
        chunk: int = CHUNK,
        allowed: int | None = None,
        end: str = "complete",
    ) -> None:
        self.total = total
        self.content = content
        self.block = b"x" * chunk  # one buffer, handed out again and again
        self.chunk = chunk
        self.allowed = total if allowed is None else allowed
        self.end = end
        self.taken = 0  # bytes handed to the middleware
        self.chunks = 0
        self.finished = False

    async def __call__(self) -> dict[str, Any]:
        if self.finished:
            return {"type": "http.disconnect"}
        if self.taken >= self.total:
            self.finished = True
            if self.end == "disconnect":
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": b"", "more_body": False}
        size = min(self.chunk, self.total - self.taken)
        if self.taken + size > self.allowed:
            pytest.fail(f"the middleware read past {self.allowed} bytes (had {self.taken})")
        if self.content is not None:
            body = self.content[self.taken : self.taken + size]
        else:
            body = self.block if size == self.chunk else self.block[:size]
        self.taken += size
        self.chunks += 1
        last = self.taken >= self.total and self.end == "complete"
        if last:
            self.finished = True
        return {"type": "http.request", "body": body, "more_body": not last}


class Recorder:
    """The wrapped app (answers 200 after reading its body) and the middleware's answer."""

    def __init__(self) -> None:
        self.app_bodies: list[bytes] = []
        self.sent: list[MutableMapping[str, Any]] = []

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.app_bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return int(starts[0]["status"]) if starts else None

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def doc(self) -> Any:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


def webhook_headers(
    msg_id: str = "msg_big",
    *,
    body: bytes | None = None,
    timestamp: int | None = None,
    length: int | None = None,
) -> Pairs:
    """Standard Webhooks headers: signed over ``body`` when given, else a well-formed
    signature; ``timestamp`` defaults to now; a Content-Length when ``length`` is given."""
    ts = int(time.time()) if timestamp is None else timestamp
    sig = SOME_SIGNATURE if body is None else signature_header([SECRET], msg_id, ts, body)
    pairs = [
        (b"content-type", b"application/json"),
        (b"webhook-id", msg_id.encode()),
        (b"webhook-timestamp", str(ts).encode()),
        (b"webhook-signature", sig.encode()),
    ]
    if length is not None:
        pairs.append((b"content-length", str(length).encode()))
    return pairs


def call(
    headers: Pairs,
    receive: Feed,
    *,
    store: MemoryStore | None = None,
    **options: Any,
) -> Recorder:
    """One POST /hook through WebhookMiddleware, driven directly (no server)."""
    recorder = Recorder()
    verifier = WebhookVerifier(SECRET, store=store)
    middleware = WebhookMiddleware(recorder.app, verifier=verifier, path="/hook", **options)
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/hook",
        "headers": headers,
        "query_string": b"",
    }
    asyncio.run(middleware(scope, receive, recorder.send))
    return recorder


# ------------------------------------------------------------------ headers before the body
def test_a_stale_300_mib_request_is_refused_before_a_single_body_chunk() -> None:
    """A 300 MiB request with a 1970 timestamp (Content-Length declared) gets its 401 after
    the middleware consumed zero body chunks; the app never ran."""
    feed = Feed(300 * MIB, allowed=0)
    answer = call(webhook_headers(timestamp=1, length=300 * MIB), feed)
    assert answer.status == 401
    assert answer.doc == {"type": "webhook-verification", "detail": "timestamp too old"}
    assert feed.chunks == 0
    assert answer.app_bodies == []


def test_a_stale_chunked_300_mib_request_is_refused_before_a_single_body_chunk() -> None:
    """The same without a Content-Length (a chunked body): 401 after zero chunks."""
    feed = Feed(300 * MIB, allowed=0)
    answer = call(webhook_headers(timestamp=1), feed)
    assert answer.status == 401
    assert answer.doc["detail"] == "timestamp too old"
    assert feed.chunks == 0


# The headers are made when the test runs, not when it is collected: their timestamp must be
# within the receiver's tolerance however long the suite ran before this test.
def _without(name: bytes) -> Callable[[], Pairs]:
    return lambda: [(k, v) for k, v in webhook_headers(length=300 * MIB) if k != name]


def _replaced(name: bytes, value: bytes) -> Callable[[], Pairs]:
    return lambda: [
        (k, value if k == name else v) for k, v in webhook_headers(length=300 * MIB)
    ]


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (_without(b"webhook-id"), "missing header webhook-id"),
        (_without(b"webhook-timestamp"), "missing header webhook-timestamp"),
        (_without(b"webhook-signature"), "missing header webhook-signature"),
        (_replaced(b"webhook-timestamp", b"soon"), "malformed header webhook-timestamp"),
        (_replaced(b"webhook-timestamp", str(10**10).encode()), "timestamp too new"),
        (_replaced(b"webhook-signature", b"v1"), "malformed header webhook-signature"),
        (_replaced(b"webhook-signature", b"v1,not*base64"), "malformed header webhook-signature"),
        (_replaced(b"webhook-signature", b"v1a,abc="), "no v1 signature in webhook-signature"),
        (_replaced(b"webhook-signature", b"v1,AAAA " * 1000), "webhook-signature header too long"),
    ],
    ids=[
        "no-id",
        "no-timestamp",
        "no-signature",
        "bad-timestamp",
        "future",
        "no-comma",
        "bad-base64",
        "no-v1",
        "too-long",
    ],
)
def test_every_header_failure_is_answered_before_the_body_is_read(
    headers: Callable[[], Pairs], reason: str
) -> None:
    """Missing headers, a timestamp outside the tolerance and a malformed signature header are
    each a 401 with their reason, after zero body chunks."""
    feed = Feed(300 * MIB, allowed=0)
    answer = call(headers(), feed)
    assert (answer.status, answer.doc["detail"]) == (401, reason)
    assert feed.chunks == 0


def test_a_wrong_signature_is_still_found_after_the_body_is_read() -> None:
    """Well-formed headers whose signature matches another body: the body is read (it is
    needed to tell), then 401 no matching signature; the app never ran."""
    body = b'{"a": 1}'
    answer = call(webhook_headers(length=len(body)), Feed(len(body), content=body))
    assert (answer.status, answer.doc["detail"]) == (401, "no matching signature")
    assert answer.app_bodies == []


def test_check_headers_needs_no_body() -> None:
    """WebhookVerifier.check_headers accepts well-formed, fresh headers whatever the body, and
    raises WebhookVerificationError for a stale one — for frameworks that read bodies
    themselves."""
    verifier = WebhookVerifier(SECRET)
    verifier.check_headers(dict(webhook_headers()))
    with pytest.raises(WebhookVerificationError) as info:
        verifier.check_headers(dict(webhook_headers(timestamp=1)))
    assert info.value.reason == "timestamp too old"


# ------------------------------------------------------------------------- the body limit
def test_a_fresh_oversized_chunked_body_is_cut_off_as_soon_as_it_passes_the_limit() -> None:
    """A chunked 300 MiB body with fresh, well-formed headers: 413 body-too-large after at
    most the limit plus one chunk was consumed; the app never ran."""
    feed = Feed(300 * MIB, allowed=MIB + CHUNK)
    answer = call(webhook_headers(), feed)
    assert answer.status == 413
    assert answer.headers[b"content-type"] == b"application/problem+json"
    assert answer.doc["type"] == "body-too-large"
    assert answer.doc["max_body_size"] == MIB
    assert feed.taken <= MIB + CHUNK
    assert answer.app_bodies == []


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    """A Content-Length over the limit is answered 413 after zero body chunks."""
    feed = Feed(MIB + 1, allowed=0)
    answer = call(webhook_headers(length=MIB + 1), feed)
    assert (answer.status, answer.doc["type"]) == (413, "body-too-large")
    assert feed.chunks == 0


def test_a_body_of_exactly_the_limit_is_handled_one_byte_more_is_not() -> None:
    """max_body_size=N: a signed N-byte body reaches the app; N + 1 bytes are refused."""
    limit = 1000
    exact = b'{"p": "' + b"a" * (limit - 9) + b'"}'
    assert len(exact) == limit
    ok = call(
        webhook_headers("m1", body=exact),
        Feed(limit, content=exact, chunk=300),
        max_body_size=limit,
    )
    assert ok.status == 200 and ok.app_bodies == [exact]
    over = exact[:-1] + b' "}'
    refused = call(
        webhook_headers("m2", body=over),
        Feed(limit + 1, content=over, chunk=300),
        max_body_size=limit,
    )
    assert (refused.status, refused.doc["max_body_size"]) == (413, limit)
    assert refused.app_bodies == []


def test_an_oversized_delivery_claims_nothing() -> None:
    """A delivery refused with 413 leaves its webhook-id unclaimed: the sender's smaller
    retry of that id is handled, not a 422 conflict."""
    store = MemoryStore()
    big = b'{"p": "' + b"a" * 2000 + b'"}'
    small = b'{"p": "a"}'
    refused = call(
        webhook_headers("same", body=big),
        Feed(len(big), content=big),
        store=store,
        max_body_size=1000,
    )
    handled = call(
        webhook_headers("same", body=small),
        Feed(len(small), content=small),
        store=store,
        max_body_size=1000,
    )
    assert (refused.status, handled.status) == (413, 200)
    assert handled.app_bodies == [small]


def test_the_default_limit_is_one_mib() -> None:
    """Without max_body_size the limit is 1 MiB."""
    middleware = WebhookMiddleware(Recorder().app, verifier=WebhookVerifier(SECRET))
    assert middleware.max_body_size == MIB


@pytest.mark.parametrize("value", [0, -1, 1.5, float("nan"), True, "1024", None])
def test_a_max_body_size_that_is_not_a_positive_int_is_refused(value: object) -> None:
    """max_body_size must be a positive int of bytes: ConfigurationError naming the option."""
    with pytest.raises(ConfigurationError) as info:
        WebhookMiddleware(
            Recorder().app,
            verifier=WebhookVerifier(SECRET),
            max_body_size=value,  # type: ignore[arg-type]
        )
    assert info.value.option == "max_body_size"
    assert "max_body_size" in str(info.value)


# ------------------------------------------------------------- bad Content-Length framing
@pytest.mark.parametrize(
    "value", [b"-1", b"nan", b"NaN", b"inf", b"", b"1e3", b"+5", b"5_0", b"0x10", b"five"]
)
def test_a_malformed_content_length_is_a_400_before_reading(value: bytes) -> None:
    """A Content-Length that is not one decimal number of bytes (negative, NaN, empty, …) is
    a 400 malformed-content-length after zero body chunks (RFC 9112 §6.3)."""
    feed = Feed(10, allowed=0)
    answer = call([*webhook_headers(), (b"content-length", value)], feed)
    assert (answer.status, answer.doc["type"]) == (400, "malformed-content-length")
    assert feed.chunks == 0


@pytest.mark.parametrize("digits", [40, 10_000_000])
def test_a_huge_content_length_is_a_413_before_reading(digits: int) -> None:
    """A Content-Length of 40 digits, or of ten million digits, is a number over the limit:
    413 after zero chunks, no crash on the conversion."""
    feed = Feed(10, allowed=0)
    answer = call([*webhook_headers(), (b"content-length", b"9" * digits)], feed)
    assert (answer.status, answer.doc["type"]) == (413, "body-too-large")
    assert feed.chunks == 0


def test_leading_zeros_are_still_the_same_length() -> None:
    """Content-Length 000…0005 (a hundred digits) is 5 bytes: the signed body is handled."""
    body = b'{"a":1}'
    headers = [*webhook_headers("lz", body=body), (b"content-length", b"0" * 100 + b"7")]
    answer = call(headers, Feed(len(body), content=body))
    assert answer.status == 200 and answer.app_bodies == [body]


def test_several_equal_content_lengths_count_as_one() -> None:
    """Two Content-Length headers with the same value (or one "7, 7" list) are that value."""
    body = b'{"a":1}'
    for extra in ([(b"content-length", b"7")] * 2, [(b"content-length", b"7, 7")]):
        answer = call([*webhook_headers("eq", body=body), *extra], Feed(7, content=body))
        assert answer.status == 200 and answer.app_bodies == [body]


@pytest.mark.parametrize("extra", [[b"7", b"8"], [b"7, 8"], [b"7", b"7, 800000000"]])
def test_conflicting_content_lengths_are_a_400_before_reading(extra: list[bytes]) -> None:
    """Content-Length headers that disagree are a 400 malformed-content-length after zero
    chunks (RFC 9112 §6.3: the framing cannot be trusted)."""
    feed = Feed(7, allowed=0)
    headers = [*webhook_headers(), *((b"content-length", v) for v in extra)]
    answer = call(headers, feed)
    assert (answer.status, answer.doc["type"]) == (400, "malformed-content-length")
    assert "conflicting" in answer.doc["detail"]
    assert feed.chunks == 0


def test_a_body_that_ends_before_its_content_length_is_a_400() -> None:
    """A body of 3 bytes under Content-Length 7 that ends (more_body False) is a 400
    content-length-mismatch; the app never ran."""
    answer = call(webhook_headers(length=7), Feed(3, content=b"{}\n"))
    assert (answer.status, answer.doc["type"]) == (400, "content-length-mismatch")
    assert (
        answer.doc["detail"] == "the body ended after 3 of the 7 bytes its Content-Length declares"
    )
    assert answer.app_bodies == []


def test_a_body_longer_than_its_content_length_is_a_400_without_reading_on() -> None:
    """More bytes than Content-Length declared: 400 content-length-mismatch as soon as the
    excess arrives; nothing past it is read."""
    feed = Feed(10 * CHUNK, allowed=2 * CHUNK)
    answer = call(webhook_headers(length=CHUNK + 1), feed)
    assert (answer.status, answer.doc["type"]) == (400, "content-length-mismatch")
    assert feed.chunks == 2
    assert answer.app_bodies == []


def test_a_client_gone_mid_body_gets_no_answer_and_claims_nothing() -> None:
    """The client disconnects after 3 of 7 declared bytes: no answer is sent (nobody is
    there), the app never ran, and the id is not claimed (its retry is handled)."""
    store = MemoryStore()
    body = b'{"a":1}'
    gone = call(
        webhook_headers("g", body=body, length=7),
        Feed(3, content=body, end="disconnect"),
        store=store,
    )
    assert gone.sent == [] and gone.app_bodies == []
    retry = call(webhook_headers("g", body=body, length=7), Feed(7, content=body), store=store)
    assert retry.status == 200 and retry.app_bodies == [body]


# -------------------------------------------------------------------- over a real socket
@pytest.fixture
def server() -> Iterator[ServerThread]:
    """WebhookMiddleware (memory dedupe, default limit) under uvicorn."""
    recorder = Recorder()
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    with ServerThread(WebhookMiddleware(recorder.app, verifier=verifier, path="/hook")) as srv:
        yield srv


def _status_line(srv: ServerThread, head: bytes) -> bytes:
    """Send only a request head (no body) and return the answer's status line."""
    with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    return answer.split(b"\r\n", 1)[0]


def test_a_stale_300_mib_request_over_a_socket_is_answered_before_its_body_is_sent(
    server: ServerThread,
) -> None:
    """Under uvicorn, a request head declaring 300 MiB with a 1970 timestamp is answered 401
    though the client never sends a byte of its body; the server still serves afterwards."""
    head = b"".join(
        [b"POST /hook HTTP/1.1\r\nhost: x\r\n"]
        + [k + b": " + v + b"\r\n" for k, v in webhook_headers(timestamp=1, length=300 * MIB)]
        + [b"\r\n"]
    )
    assert _status_line(server, head) == b"HTTP/1.1 401 Unauthorized"
    body = b'{"ok": 1}'
    after = httpx.post(
        server.url + "/hook",
        content=body,
        headers=dict((k.decode(), v.decode()) for k, v in webhook_headers("ok", body=body)),
    )
    assert after.status_code == 200
