"""Job values and their validation at submit time (bad input fails here, never later).

A job's idempotency key is minted here — UUIDv4, 122 random bits (SPEC §2) — and inserted
with the job in one write; no retry, restart or crash ever regenerates it.
"""

from __future__ import annotations

import ipaddress
import json as jsonlib
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from retrysafe._exceptions import ConfigurationError, InvalidKeyError, PayloadError
from retrysafe.client._models import Attempt, Job, JobState, NewJob
from retrysafe.core import parse_key

__all__ = [
    "DEFAULT_QUEUE",
    "Attempt",
    "Job",
    "JobState",
    "NewJob",
    "build_job",
    "check_queue",
    "destination_of",
    "job_id_prefix",
    "notify_submitted",
    "on_submit",
]

_TOKEN_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
_MISSING: Any = object()

#: The queue of plain outbox jobs (``Outbox``, ``Worker``, ``reconcile`` and the CLI).
DEFAULT_QUEUE = "default"
_QUEUE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def check_queue(queue: object) -> str:
    """``queue`` when it is a queue name: 1–64 characters of ``a-z 0-9 _ . -``, starting
    with a letter or digit.

    Raises:
        ConfigurationError: anything else.
    """
    if not isinstance(queue, str) or _QUEUE.fullmatch(queue) is None:
        raise ConfigurationError(
            f"queue {queue!r} is not a queue name (1–64 of a-z 0-9 _ . -, starting with a "
            "letter or digit)",
            option="queue",
        )
    return queue


_HEX = frozenset("0123456789abcdef")


def job_id_prefix(text: str) -> str | None:
    """``text`` as the start of a job id (ids are 32 lower-case hex digits, from
    :func:`build_job`): lower-cased; None when no job id can start with it (empty, or not
    hex). The one check of a job id prefix, for every caller that resolves one (the outbox,
    the CLI, webhook deliveries, whose ids are job ids)."""
    prefix = text.lower()
    return prefix if prefix and set(prefix) <= _HEX else None


def destination_of(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the unit of the retry budget and of the limit of
    attempts in flight), as stored with each job: an IPv6 host without its brackets (the
    console's host filter reads it so); :func:`shown_destination` prints it."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


def shown_destination(destination: str) -> str:
    """A stored destination as a URL reads (RFC 3986 §3.2.2): an IPv6 host in brackets,
    ``http://[::1]:8080``, so the port reads apart from it."""
    scheme, sep, authority = destination.partition("://")
    host, colon, port = authority.rpartition(":")
    if sep and colon and ":" in host:
        return f"{scheme}://[{host}]:{port}"
    return destination


def shown_url(url: str, limit: int = 200) -> str:
    """``url`` as error messages show it: without a ``user:password@`` part (never print a
    credential) and at most ``limit`` characters."""
    scheme, sep, rest = url.partition("://")
    if sep:
        authority, slash, path = rest.partition("/")
        if "@" in authority:
            rest = "…@" + authority.rpartition("@")[2] + slash + path
        url = scheme + sep + rest
    return url if len(url) <= limit else url[: limit - 1] + "…"


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _url_string(url: object, option: str = "url") -> str:
    if not isinstance(url, str):
        raise ConfigurationError(
            f"{option} must be a string, got {type(url).__name__}", option=option
        )
    return url


def _check_url(url: object, option: str = "url") -> str:
    """``url`` checked as an http(s) URL with a host and a valid port, printable, no
    whitespace; errors name ``option`` (\"url\", the gateway's \"upstream\") and never print
    a credential.

    Raises:
        ConfigurationError: anything else (``option=option``).
    """
    url = _url_string(url, option)
    shown = shown_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a bad port
    except ValueError as exc:
        raise ConfigurationError(f"{option} {shown!r} is malformed: {exc}", option=option) from None
    if port == 0:  # no server listens on port 0: every attempt would fail to connect
        raise ConfigurationError(f"{option} {shown!r} names port 0, which no server listens on",
                                 option=option)  # fmt: skip
    if parts.scheme not in ("http", "https"):
        raise ConfigurationError(
            f"{option} {shown!r} is not http(s); only http:// and https:// requests are sent",
            option=option,
        )
    if not parts.hostname:
        raise ConfigurationError(f"{option} {shown!r} has no host", option=option)
    if any(c.isspace() for c in url):
        raise ConfigurationError(f"{option} {shown!r} contains whitespace", option=option)
    if not url.isprintable():
        # Control and format characters (NUL, ESC, U+200B, U+FEFF) and lone surrogates:
        # no HTTP client sends them (every attempt would fail, unsent), a surrogate cannot
        # even be stored as UTF-8, and a stored ESC would reach the terminals of `jobs list`.
        bad = next(c for c in url if not c.isprintable())
        what = (
            "a lone surrogate, which is not UTF-8 text (so reads a command-line argument "
            "that is not UTF-8)"
            if "\ud800" <= bad <= "\udfff"
            else "a character that is not printable; percent-encode it"
        )
        raise ConfigurationError(
            f"{option} {shown!r} contains U+{ord(bad):04X}, {what}", option=option
        )
    hostport = parts.netloc.rpartition("@")[2]
    bracketed = "[" in hostport
    if bracketed and re.fullmatch(r"\[[^\]]*\](?::[0-9]*)?", hostport) is None:
        raise ConfigurationError(  # "[::1].": the engine refuses it at every attempt
            f"{option} {shown!r} has text around its bracketed IPv6 host", option=option
        )
    _check_host_name(parts.hostname, shown, url, bracketed=bracketed, option=option)
    return url


_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _numeric(label: str) -> bool:
    """A lower-cased host label that reads as a number: decimal digits, or ``0x`` and hex
    digits (a WHATWG URL parser takes a host ending in one as IPv4)."""
    if label.isdigit():
        return label.isascii()
    return label[:2] == "0x" and _HEX_DIGITS.fullmatch(label[2:]) is not None


def _dotted_quad(host: str) -> bool:
    """``host`` is an IPv4 address written as four decimal numbers, 0–255, no leading zeros
    (what every HTTP client and resolver reads alike; :class:`ipaddress.IPv4Address` takes
    exactly that form)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


#: What an ASCII host name may hold: letters, digits, hyphens, and the underscore (no DNS
#: name has one, but container and /etc/hosts names do and resolve).
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _check_host_name(
    host: str, shown: str, url: str, *, bracketed: bool, option: str = "url"
) -> None:
    """Refuse a host no attempt could ever reach, so that the job is not stored to fail on
    every attempt: an empty label (``a..example``, ``.example``), a label over 63
    characters or a name over 253 (RFC 1035 §2.3.4; a trailing dot is the root), an ASCII
    character no host name holds (``<``, ``%``), a host that ends in a number but is no
    dotted-quad IPv4 address without a trailing dot (``127.1``, ``2130706433``, ``0x7f.1``,
    ``127.0.0.1.``: no top-level domain is numeric, RFC 3696 §2; the engine refuses them,
    or the C resolver reads them its own way), an ``xn--`` label that is no IDNA A-label,
    a bracketed host that is no IPv6 address or carries a zone id (``[v1.x]``,
    ``[fe80::1%25eth0]``: the engine cannot send either), or a non-ASCII name with no IDNA
    form. A non-ASCII name is checked as the engine sends it (IDNA-encoded by
    :func:`retrysafe._wire._as_sent`, ideographic full stops made dots), so ``127。1`` is
    ``127.1``."""
    if bracketed:
        bad_ip = "%" in host
        if not bad_ip:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                bad_ip = True
        if bad_ip:
            raise ConfigurationError(
                f"{option} {shown!r} has a bracketed host that is no IPv6 address the HTTP "
                "engine can send (IPvFuture and zone ids are not)",
                option=option,
            )
        return
    if not host.isascii():
        from retrysafe._wire import WireError, _as_sent

        try:
            encoded = _as_sent(url).raw_host or ""
        except WireError as exc:  # what every attempt would fail with, unsent
            raise ConfigurationError(f"{option} {shown!r}: {exc}", option=option) from None
        host = encoded.lower()
    name = host[:-1] if host.endswith(".") else host
    bad = None
    last = name.rpartition(".")[2].lower()
    if _HOST_NAME.fullmatch(name) is None:
        c = next((c for c in name if not (c.isalnum() or c in "_.-")), "")
        bad = f"contains {c!r}, which no host name holds" if c else "has an empty host"
    elif "" in name.split("."):
        bad = "has an empty label in its host name (two dots, or a leading one)"
    elif len(name) > 253 or max(len(label) for label in name.split(".")) > 63:
        bad = "has a host name longer than DNS allows (63 per label, 253 in all)"
    elif _numeric(last) and (name != host or not _dotted_quad(name)):
        bad = (
            "has a host that ends in a number but is no IPv4 address in dotted-quad form "
            "(four numbers 0-255 without leading zeros and no trailing dot, e.g. 127.0.0.1)"
        )
    elif "xn--" in name.lower() and not _a_labels(name):
        bad = "has an xn-- label that is no valid IDNA A-label (punycode)"
    if bad is not None:
        raise ConfigurationError(f"{option} {shown!r} {bad}", option=option)


def _a_labels(name: str) -> bool:
    """Every ``xn--`` label of ``name`` decodes as an IDNA A-label."""
    import idna

    for label in name.lower().split("."):
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                return False
    return True


def _check_job_url(url: object) -> str:
    """An http(s) URL with a host and no credentials.

    A ``user:password@`` part is refused: job URLs are stored as they are and printed by
    ``retrysafe jobs list`` and ``--json``; send credentials in a header (``Authorization``),
    which is never printed.
    """
    checked = _check_url(url)
    parts = urlsplit(checked)
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(
            f"the URL for host {parts.hostname or ''!r} must not carry credentials "
            "(user:password@): job URLs are stored and printed as they are; send them in an "
            "Authorization header instead",
            option="url",
        )
    return checked


#: Headers the HTTP client writes itself, and the one retrysafe writes: a job that set them
#: would send a malformed or ambiguous request on every attempt (a Content-Length that is not
#: the body's, a second Host, hop-by-hop fields that belong to one connection, RFC 9110
#: §7.6.1), or a second idempotency key.
RESERVED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "host",
        "idempotency-key",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


#: Methods that make no request a job could stand for (RFC 9110 §9.3.6 and §9.3.8).
_NOT_A_JOB = frozenset({"CONNECT", "TRACE"})

#: Control characters a header value may not hold (all but the horizontal tab).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _check_headers(headers: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """The job's extra headers as pairs, each a valid field that the client does not set.

    Raises:
        ConfigurationError: ``option="headers"``.
    """
    if headers is not None and not isinstance(headers, Mapping):
        raise ConfigurationError("headers must map str to str", option="headers")
    pairs: list[tuple[str, str]] = []
    spelled: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigurationError("headers must map str to str", option="headers")
        if not name or not set(name) <= _TOKEN_CHARS:
            # ascii(): a look-alike letter (the Kelvin sign in "X-\u212a") shows as itself.
            raise ConfigurationError(
                f"header name {_clip(ascii(name))} is not a valid header name "
                "(letters, digits and !#$%&'*+-.^_`|~ only)",
                option="headers",
            )
        if any(c in value for c in "\r\n\0"):
            raise ConfigurationError(
                f"header {_clip(repr(name))} has a value with a line break or NUL, which no "
                "header value holds",
                option="headers",
            )
        if not value.isascii() or _CONTROL.search(value):
            # RFC 9110 §5.5: visible ASCII, spaces and tabs. httpx refuses anything else at
            # every attempt, after the job was accepted; aiohttp sends UTF-8 nobody decodes
            # alike.
            raise ConfigurationError(
                f"header {_clip(repr(name))} has a value that is not printable ASCII; "
                "encode it first (percent-encoding, base64, or RFC 8187's UTF-8''… form)",
                option="headers",
            )
        if value != value.strip(" \t"):
            # Not part of a field value (RFC 9110 §5.5): h11 (httpx) refuses it at every
            # attempt, other clients drop it, so the value would not be the one stored.
            raise ConfigurationError(
                f"header {_clip(repr(name))} has a value with leading or trailing whitespace; "
                "strip it first",
                option="headers",
            )
        low = name.lower()
        if low == "idempotency-key":
            raise ConfigurationError(
                "pass the idempotency key as key=…, not as a header", option="headers"
            )
        first = spelled.get(low)
        if first is not None:  # two spellings, or one twice (a multi-valued mapping)
            # Header names are case-insensitive (RFC 9110 §5.1): these are one field twice.
            # A singleton (Content-Type) cannot be sent twice, and aiohttp would send only
            # the last of two spellings; a list field's values are joined with ", " (§5.3).
            raise ConfigurationError(
                f"header {_clip(repr(name))} is given twice"
                + (f" (also as {_clip(repr(first))})" if first != name else "")
                + ": header names ignore letter case; give it once (a list field's values "
                "joined with ', ')",
                option="headers",
            )
        spelled[low] = name
        if low == "content-type" and not value:
            raise ConfigurationError(  # RFC 9110 §8.3: a media type is type/subtype
                "header 'Content-Type' is empty; leave it out, or give a media type",
                option="headers",
            )
        if low in RESERVED_HEADERS:
            raise ConfigurationError(
                f"header {_clip(repr(name))} is set by the HTTP client for each attempt (from "
                "the URL, the body and the connection); a job cannot set it",
                option="headers",
            )
        pairs.append((name, value))
    return pairs


#: The deepest nesting a JSON payload may have (arrays and objects inside each other). Many
#: JSON parsers stop near here (serde_json at 128, Python's at its recursion limit).
MAX_PAYLOAD_DEPTH = 128


def _bad_text(text: str) -> bool:
    """A lone surrogate (``"\\ud800"``) cannot be encoded as UTF-8, so it is not JSON text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find_unserialisable(
    value: Any, path: str, depth: int = 0, parents: frozenset[int] = frozenset()
) -> tuple[str, str] | None:
    """``(path, why)`` of the first value that is not JSON, or None. Never recurses more than
    :data:`MAX_PAYLOAD_DEPTH` levels, so circular and very deep payloads fail cleanly."""
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, str):
        return (path, "a lone surrogate is not UTF-8 text") if _bad_text(value) else None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"{value!r} is not valid JSON")
    if not isinstance(value, (list, tuple, dict)):
        return path, f"{type(value).__name__} is not JSON-serialisable"
    if id(value) in parents:
        return path, "circular reference (the value contains itself)"
    if depth >= MAX_PAYLOAD_DEPTH:
        return path, f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"
    inside = parents | {id(value)}
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                return path, f"object key {k!r} is not a string"
            if _bad_text(k):
                return path, f"object key {k!r} contains a lone surrogate (not UTF-8)"
            found = _find_unserialisable(item, f"{path}.{k}", depth + 1, inside)
            if found:
                return found
        return None
    for i, item in enumerate(value):
        found = _find_unserialisable(item, f"{path}[{i}]", depth + 1, inside)
        if found:
            return found
    return None


#: ``json.dumps(value, separators=(",", ":"), allow_nan=False)``, without making an encoder
#: per call as ``dumps`` does for any non-default argument (an encoder keeps no state
#: between calls).
_COMPACT = jsonlib.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _encode_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes, or :class:`PayloadError` naming the first bad value.

    The encoder runs first (in C) and refuses NaN, infinities, other types and circular
    references itself; what it lets through is looked at after: non-string object keys (it
    would write ``1`` as ``"1"``), nesting deeper than :data:`MAX_PAYLOAD_DEPTH`, and lone
    surrogates (written as ``\\udXXX`` escapes: text without ``\\ud`` holds none). Only a
    payload that fails one of these, or holds a ``\\ud`` escape at all, is walked value by
    value (:func:`_find_unserialisable`), for the path of the bad value: the walk costs
    about twice the encoding.
    """
    text: str | None = None
    failure: Exception | None = None
    try:
        text = _COMPACT.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        failure = exc
    if text is not None and "\\ud" not in text and _containers_fit(value):
        return text.encode()
    found = _find_unserialisable(value, "$")
    if found is not None:
        path, why = found
        raise PayloadError(f"payload cannot be serialised to JSON at {path}: {why}", path=path)
    if text is None:
        raise PayloadError(f"payload cannot be serialised to JSON: {failure}") from failure
    return text.encode()


_CONTAINERS = (dict, list, tuple)


def _containers_fit(value: Any, depth: int = 0) -> bool:
    """Whether every object key of an encodable ``value`` is a string and no container is
    nested deeper than :data:`MAX_PAYLOAD_DEPTH` (the checks the encoder does not make).
    Recursive, like the encoder before it: ``value`` has no cycle (the encoder refuses
    one) and the depth is bounded."""
    if depth >= MAX_PAYLOAD_DEPTH:
        return False
    if isinstance(value, dict):
        for k, item in value.items():
            if type(k) is not str:
                return False
            if isinstance(item, _CONTAINERS) and not _containers_fit(item, depth + 1):
                return False
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, _CONTAINERS) and not _containers_fit(item, depth + 1):
                return False
    return True


def _deadline_at(deadline: float | timedelta | datetime | None, now: float) -> float | None:
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            raise ConfigurationError("deadline datetime must be timezone-aware", option="deadline")
        at = deadline.timestamp()
        if at <= now:
            raise ConfigurationError("deadline is in the past", option="deadline")
        return at
    if isinstance(deadline, timedelta):
        deadline = deadline.total_seconds()
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise ConfigurationError(
            "deadline must be seconds, a timedelta or an aware datetime", option="deadline"
        )
    if not math.isfinite(deadline) or deadline <= 0:
        raise ConfigurationError(
            f"deadline must be > 0 seconds, got {deadline!r}", option="deadline"
        )
    return now + float(deadline)


# The variant digit of a UUID (RFC 9562 §4.1: binary 10xx) for any random hex digit.
_VARIANT = {d: "89ab"[int(d, 16) & 3] for d in "0123456789abcdef"}


def new_key() -> str:
    """A fresh idempotency key: a UUIDv4 in its 36-character text form, 122 random bits
    from :func:`os.urandom` (SPEC §2; RFC 9562 §5.4). What :func:`uuid.uuid4` makes, at
    an eighth of its cost (no :class:`~uuid.UUID` object)."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


def new_job_id() -> str:
    """A fresh job id: 32 lower-case hex digits, 128 random bits from :func:`os.urandom`
    (:func:`job_id_prefix` reads prefixes of it)."""
    return os.urandom(16).hex()


def _job_target(url: object) -> tuple[str, str]:
    """The checked job URL (:func:`_check_job_url`) and its :func:`destination_of`.

    Raises:
        ConfigurationError: as :func:`_check_job_url`.
    """
    url = _url_string(url)  # a string first: the cache hashes it
    return _cached_target(url) if len(url) <= _CACHED_URL_LENGTH else _target_of(url)


#: The longest URL whose checks are cached: the cache holds at most 128 URLs this long.
_CACHED_URL_LENGTH = 2048


def _target_of(url: str) -> tuple[str, str]:
    checked = _check_job_url(url)
    return checked, destination_of(checked)


# Cached: a batch of submissions names a few URLs many times, and parsing one three times
# (the checks, then the destination) cost a fifth of building a job.
_cached_target = lru_cache(maxsize=128)(_target_of)


def build_job(
    url: str,
    *,
    json: Any = _MISSING,
    content: bytes | str | None = None,
    method: str = "POST",
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    deadline: float | timedelta | datetime | None = None,
    now: float,
    queue: str = DEFAULT_QUEUE,
) -> NewJob:
    """Validate a submission and mint its id and key; the job goes to ``queue`` (a name
    already checked by :func:`check_queue`).

    Raises:
        ConfigurationError: a URL that is not http(s) or carries credentials
            (``user:password@``), a bad method (or ``CONNECT``, ``TRACE``) or deadline, a
            header that is malformed or not printable ASCII, or one the
            HTTP client sets itself (:data:`RESERVED_HEADERS`: ``Content-Length``, ``Host``,
            ``Transfer-Encoding``, ``Connection`` and the other hop-by-hop fields), both
            ``json`` and ``content``, or an ``Idempotency-Key`` header (pass ``key=``).
        PayloadError: ``json`` cannot be serialised (NaN, sets, objects, non-string keys,
            lone surrogates, circular references, nesting deeper than
            :data:`MAX_PAYLOAD_DEPTH`), or ``content`` text is not UTF-8.
        InvalidKeyError: ``key`` is not 1–255 visible ASCII characters.
    """
    url, destination = _job_target(url)
    if not isinstance(method, str) or not method or not set(method) <= _TOKEN_CHARS:
        raise ConfigurationError(
            f"method {_clip(repr(method))} is not an HTTP method", option="method"
        )
    method = method.upper()
    if method in _NOT_A_JOB:
        raise ConfigurationError(
            f"method {method} cannot be a job: CONNECT opens a tunnel to the URL's host (the "
            "request carries no path) and TRACE echoes the request back (RFC 9110 §9.3.6, "
            "§9.3.8); neither has an effect a key could make safe to repeat",
            option="method",
        )
    pairs = _check_headers(headers)
    if json is not _MISSING and content is not None:
        raise ConfigurationError("pass json= or content=, not both", option="content")
    if json is not _MISSING:
        body = _encode_json(json)
        if not any(n.lower() == "content-type" for n, _ in pairs):
            pairs.append(("Content-Type", "application/json"))
    elif isinstance(content, str):
        if _bad_text(content):
            raise PayloadError("content contains a lone surrogate; it cannot be sent as UTF-8")
        body = content.encode()
    elif isinstance(content, (bytes, bytearray, memoryview)):
        body = bytes(content)
    elif content is None:
        body = b""
    else:
        raise PayloadError(f"content must be bytes or str, got {type(content).__name__}")
    if key is None:
        key = new_key()
    else:
        if not isinstance(key, str):
            raise InvalidKeyError("the key must be a string", key=repr(key))
        if parse_key(key) != key:
            raise InvalidKeyError("the key must be 1–255 visible ASCII characters", key=key)
    return NewJob(
        id=new_job_id(),
        key=key,
        method=method,
        url=url,
        destination=destination,
        headers=tuple(pairs),
        body=body,
        deadline_at=_deadline_at(deadline, now),
        queue=queue,
    )


# ------------------------------------------------------------------ in-process wake-ups
_listeners: dict[str, set[Callable[[], None]]] = {}
_listeners_lock = threading.Lock()


def on_submit(store_url: str, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` (from any thread) when a job is submitted in this process to the
    store at ``store_url``. Returns the function that unsubscribes."""
    with _listeners_lock:
        _listeners.setdefault(store_url, set()).add(callback)

    def unsubscribe() -> None:
        with _listeners_lock:
            _listeners.get(store_url, set()).discard(callback)

    return unsubscribe


def notify_submitted(store_url: str) -> None:
    """Wake the workers of this process that serve ``store_url``."""
    with _listeners_lock:
        callbacks = list(_listeners.get(store_url, ()))
    for cb in callbacks:
        cb()
