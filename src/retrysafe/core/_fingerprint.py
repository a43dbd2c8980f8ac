"""Request fingerprints (SPEC §1): what makes two requests "the same request".

A fingerprint is the SHA-256 of:

- the upper-cased method and the route path;
- the query, its parameters sorted by name with a stable sort: distinct names may come in any
  order (``a=1&b=2`` is ``b=2&a=1``), but repeated parameters keep their relative order
  (``a=1&a=100`` is not ``a=100&a=1``); blank values are kept;
- the media type of ``Content-Type``: type/subtype, lower-cased, parameters such as ``charset``
  ignored (SPEC §1 names the media type), absent or empty → ``""``. The same bytes sent as
  ``application/json`` and as ``text/plain`` are two requests;
- the canonical body. A JSON body (``application/json`` or any ``+json`` type) is re-encoded with
  object keys sorted and insignificant whitespace removed, so bodies differing only in key order
  or spacing are the same request. A JSON body with a duplicate member name at any depth
  (``{"a":1,"a":2}``) is not canonicalised: parsers disagree on which member wins, so its raw
  bytes are hashed. Malformed JSON and every other body are compared byte for byte.

Speed: with orjson installed (``pip install retrysafe[fast]``) the canonical body is encoded by
orjson, which writes the same bytes as the standard library for every value it accepts: sorted
keys (code-point order is UTF-8 byte order), the same escapes, integers up to 64 bits. It is
handed no float (those keep the standard library's ``repr``), and whatever it refuses (larger
integers, lone surrogates, deep nesting) falls back to the standard library, so a body's
fingerprint never depends on whether orjson is installed
(``tests/property/test_same_bytes_as_before.py`` proves it against the implementation before).

The hashed bytes are ``[prefix] method NUL path NUL query NUL body``. For ``application/json``,
the common case, the media type is implied and there is no prefix, so such a request keeps the
fingerprint earlier versions gave it (unless it repeats a query parameter or a JSON member).
Any other media type (including none) is hashed in the prefix
``b"media-type" NUL <length> NUL <media type>``; an un-prefixed message starts with an
upper-cased method, never with a lower-case letter, so the two forms never coincide.
"""

from __future__ import annotations

import decimal
import hashlib
import json
import math
from operator import itemgetter
from typing import Any
from urllib.parse import parse_qsl, urlencode

try:  # optional: the fast encoder of canonical bodies (see the module docstring)
    import orjson
except ImportError:  # pragma: no cover - the fallback is tested with orjson patched out
    orjson = None  # type: ignore[assignment]

__all__ = ["canonical_body", "fingerprint", "is_json_content_type"]

# One encoder and one decoder for every canonical body: json.dumps/json.loads with options
# build a new encoder/decoder per call, which costs as much as handling a small body.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)

# The media type whose fingerprints carry no prefix (see the module docstring).
_IMPLIED_MEDIA_TYPE = "application/json"

_by_name = itemgetter(0)


class _DuplicateMemberError(ValueError):
    """A JSON object names a member twice (a ValueError, so it falls back like bad JSON)."""


def _no_duplicate_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Called by the C scanner once per object, at every depth; dict() and len() stay in C.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateMemberError
    return obj


class _InexactNumberError(ValueError):
    """A JSON number that a float cannot hold exactly (a ValueError: it falls back to bytes)."""


class _Float(float):
    """A JSON number with a fraction or an exponent. orjson refuses to encode it (a float
    subclass under ``OPT_PASSTHROUGH_SUBCLASS``), so a body holding one is encoded by the
    standard library, whose ``float.__repr__`` is the canonical form (orjson writes ``1e16``
    where ``repr`` writes ``1e+16``)."""

    __slots__ = ()


def _exact_float(text: str) -> float:
    # Called only for numbers with a fraction or an exponent. A float that does not hold the
    # literal exactly would merge different requests ("1e400" and "2e400" both become
    # Infinity; "0.30000000000000004" and "0.3000000000000000444" one double), so such a
    # body is compared as bytes instead. Exactness: the float's shortest repr reads back as
    # the same decimal value as the literal.
    value = float(text)
    if not math.isfinite(value) or (
        repr(value) != text and decimal.Decimal(repr(value)) != decimal.Decimal(text)
    ):
        raise _InexactNumberError(text)
    return _Float(value)


# Integers stay exact in Python whatever their size, so only floats need the check. NaN and
# Infinity (which the standard library reads and writes) become _Float too: orjson would write
# them as null.
_STRICT_JSON = json.JSONDecoder(
    object_pairs_hook=_no_duplicate_members, parse_float=_exact_float, parse_constant=_Float
)


def _media_type(content_type: str | None) -> str:
    if not content_type:
        return ""
    if content_type == _IMPLIED_MEDIA_TYPE:  # the common case, as most clients send it
        return content_type
    return content_type.split(";", 1)[0].strip().lower()


def _is_json_media(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


def is_json_content_type(content_type: str | None) -> bool:
    """True for ``application/json`` and any ``+json`` media type (parameters ignored)."""
    return _is_json_media(_media_type(content_type))


def canonical_body(body: bytes, content_type: str | None) -> bytes:
    """Return the canonical form of a request body (SPEC §1).

    Args:
        body: the raw body bytes.
        content_type: the request's ``Content-Type`` header, or None.

    Returns:
        For a JSON content type whose body parses as JSON without a duplicate member name at
        any depth and whose numbers a float holds exactly: the compact, key-sorted UTF-8 JSON
        encoding. Otherwise the body unchanged (binary bodies, malformed JSON, duplicate
        members, numbers a float would round — ``1e400``, ``0.3000000000000000444`` — and
        nesting too deep to parse are compared as bytes; they are never an error here).
    """
    if body and is_json_content_type(content_type):
        return _canonical_json(body)
    return body


def _canonical_json(body: bytes) -> bytes:
    # What json.loads does with bytes: UTF-8, or UTF-16/32 told by a BOM or zero bytes. A
    # first byte that is ASCII but not NUL, followed by a non-NUL, is always UTF-8; deciding
    # that here skips json.detect_encoding, which costs about as much as the duplicate check.
    plainly_utf8 = 0 < body[0] < 0x80 and body[1:2] != b"\x00"
    encoding = "utf-8" if plainly_utf8 else json.detect_encoding(body)
    try:
        parsed = _STRICT_JSON.decode(body.decode(encoding, "surrogatepass"))
    except (ValueError, RecursionError):  # includes UnicodeDecodeError, _DuplicateMemberError
        return body
    if orjson is not None:
        try:
            encoded: bytes = orjson.dumps(parsed, option=_ORJSON_OPTIONS)
        except TypeError:  # a float, an integer beyond 64 bits, a lone surrogate, deep nesting
            pass
        else:
            return encoded
    # surrogatepass: "\ud800" is valid JSON text but a lone surrogate, which strict UTF-8
    # refuses to encode.
    try:
        return _CANONICAL_JSON.encode(parsed).encode("utf-8", "surrogatepass")
    except RecursionError:  # parsed just inside the stack's depth; encoding went deeper
        return body


# Sorted keys; subclasses of built-in types (our _Float) go to ``default``, which is unset, so
# orjson raises TypeError (orjson.JSONEncodeError) for them instead of encoding them its way.
_ORJSON_OPTIONS = 0 if orjson is None else orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS


def fingerprint(
    method: str,
    path: str,
    query: str,
    body: bytes,
    content_type: str | None = None,
) -> str:
    """SHA-256 of what makes a request "the same request" (SPEC §1).

    Hashed: the upper-cased method; the route path; the query with its parameters stably
    sorted by name (repeated parameters keep their order, blank values kept, percent-escapes
    that are not UTF-8 kept as their bytes); the media type of ``content_type`` (type/subtype,
    lower-cased, parameters ignored); and the canonical body (:func:`canonical_body`). The
    module docstring gives the byte layout.

    Args:
        method: HTTP method, any case.
        path: the route path without the query string, e.g. ``"/posts"``.
        query: the raw query string without ``?`` (``""`` when absent), as the server decoded
            it (ASGI and WSGI: Latin-1).
        body: the raw request body.
        content_type: the request's ``Content-Type`` or None; its media type is hashed and
            decides whether JSON canonicalisation applies.

    Returns:
        64 lower-case hex digits.
    """
    media = content_type if content_type == _IMPLIED_MEDIA_TYPE else _media_type(content_type)
    raw_path = path.encode("utf-8", "surrogateescape")
    if query:
        # surrogateescape both ways: "%FF" and "%FE" stay two bytes instead of both decoding
        # to U+FFFD; valid UTF-8 round-trips exactly as before.
        pairs = parse_qsl(query, keep_blank_values=True, errors="surrogateescape")
        pairs.sort(key=_by_name)  # stable: repeated names keep their order
        raw_query = urlencode(pairs, errors="surrogateescape").encode("ascii")
    else:
        raw_query = b""
    # Everything before the body in one piece (the body, up to 1 MiB, is not copied).
    head = b"%b\x00%b\x00%b\x00" % (method.upper().encode("ascii", "replace"), raw_path, raw_query)
    if b"\x00" in raw_path:
        # ASGI servers percent-decode the path, so it can hold NUL, the separator below: its
        # length goes first, so "/a\0b=1" cannot pass for "/a" with query "b=1". A lower-case
        # prefix, which no upper-cased method can start with; paths without NUL keep the
        # layout (and the fingerprints) they always had.
        head = b"path\x00%d\x00" % len(raw_path) + head
    if media != _IMPLIED_MEDIA_TYPE:
        encoded = media.encode("utf-8", "surrogateescape")
        head = b"media-type\x00%d\x00%b" % (len(encoded), encoded) + head
    h = hashlib.sha256(head)
    h.update(_canonical_json(body) if body and _is_json_media(media) else body)
    return h.hexdigest()
