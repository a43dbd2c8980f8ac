"""Request fingerprints (SPEC §1): what makes two requests "the same request".

A fingerprint is the SHA-256 of the upper-cased method, the route path, the query with its
parameters sorted, and the canonical body. JSON bodies are canonicalised (object keys sorted,
insignificant whitespace removed) so that bodies differing only in key order or spacing are the
same request; any other body is compared byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from urllib.parse import parse_qsl, urlencode

__all__ = ["canonical_body", "fingerprint", "is_json_content_type"]

# One encoder for every canonical body: json.dumps with these options builds a new encoder
# per call, which costs as much as encoding a small body.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def is_json_content_type(content_type: str | None) -> bool:
    """True for ``application/json`` and any ``+json`` media type (parameters ignored)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def canonical_body(body: bytes, content_type: str | None) -> bytes:
    """Return the canonical form of a request body.

    Args:
        body: the raw body bytes.
        content_type: the request's ``Content-Type`` header, or None.

    Returns:
        For a JSON content type whose body parses as JSON: the compact, key-sorted UTF-8 JSON
        encoding. Otherwise the body unchanged (binary and malformed JSON bodies are compared as
        bytes; they are never an error here).
    """
    if body and is_json_content_type(content_type):
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return body
        return _CANONICAL_JSON.encode(parsed).encode("utf-8")
    return body


def fingerprint(
    method: str,
    path: str,
    query: str,
    body: bytes,
    content_type: str | None = None,
) -> str:
    """SHA-256 (hex, 64 characters) of method, route path, sorted query and canonical body.

    Args:
        method: HTTP method, any case.
        path: the route path without the query string, e.g. ``"/posts"``.
        query: the raw query string without ``?`` (``""`` when absent).
        body: the raw request body.
        content_type: the request's ``Content-Type``; decides whether JSON canonicalisation applies.
    """
    h = hashlib.sha256()
    h.update(method.upper().encode("ascii", "replace"))
    h.update(b"\x00")
    h.update(path.encode("utf-8", "surrogateescape"))
    h.update(b"\x00")
    if query:
        pairs = sorted(parse_qsl(query, keep_blank_values=True))
        h.update(urlencode(pairs).encode("utf-8"))
    h.update(b"\x00")
    h.update(canonical_body(body, content_type))
    return h.hexdigest()
