"""Idempotency-key parsing and scoping (SPEC §2, IETF draft-ietf-httpapi-idempotency-key-header).

Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from retrysafe._exceptions import InvalidKeyError

__all__ = ["MAX_KEY_LENGTH", "key_hash", "parse_key", "scope_from_authorization"]

#: Longest accepted key, in characters (SPEC §2).
MAX_KEY_LENGTH = 255

# Visible ASCII: 0x21..0x7E (RFC 5234 VCHAR). Space is not visible.
_VCHAR = frozenset(range(0x21, 0x7F))


def parse_key(raw: str) -> str:
    """Parse an ``Idempotency-Key`` header value into the key itself.

    Accepts the structured-field string form of the IETF draft (``"abc"``, RFC 8941 §3.3.3,
    with ``\\"`` and ``\\\\`` escapes) and, for compatibility with Stripe-style clients, a bare
    token (``abc``). Surrounding optional whitespace (SP, HTAB) is ignored.

    Args:
        raw: the header value exactly as received.

    Returns:
        The key: 1–255 visible ASCII characters (0x21–0x7E), plus spaces inside quotes as long
        as at least one character is visible.

    Raises:
        InvalidKeyError: the value is empty, longer than 255 characters, contains characters
            outside visible ASCII, is a quoted string of spaces only, is a bare token containing
            ``"``, or is a malformed quoted string (unterminated, bad escape, trailing data after
            the closing quote). SPEC §2.
    """
    value = raw.strip(" \t")
    if not value:
        raise InvalidKeyError("the key is empty", key=raw)
    if value[0] == '"':
        key = _parse_sf_string(value, raw)
        # Inside a structured-field string a space is legal; everything else must be visible.
        bad = [c for c in key if c != " " and ord(c) not in _VCHAR]
        if not bad and key and not key.strip(" "):
            raise InvalidKeyError(
                "the quoted key is only spaces; a key needs at least one visible character",
                key=raw,
            )
    elif value.isascii() and value.isprintable() and " " not in value and '"' not in value:
        # The common case, checked in C: printable ASCII without space is exactly VCHAR.
        key = value
        bad = []
    else:
        key = value
        bad = [c for c in key if ord(c) not in _VCHAR]
        if not bad:  # all visible, so the one thing wrong is a '"' in a bare key
            raise InvalidKeyError(
                "a bare key cannot contain '\"'; send it as a quoted string with '\"' escaped "
                "as '\\\"'",
                key=raw,
            )
    if bad:
        raise InvalidKeyError(
            f"the key contains a character outside visible ASCII ({bad[0]!r})", key=raw
        )
    if not key:
        raise InvalidKeyError("the key is empty", key=raw)
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"the key is {len(key)} characters long; at most {MAX_KEY_LENGTH} are allowed",
            key=raw,
        )
    return key


def _parse_sf_string(value: str, raw: str) -> str:
    out: list[str] = []
    i = 1
    n = len(value)
    while i < n:
        c = value[i]
        if c == "\\":
            if i + 1 >= n or value[i + 1] not in '"\\':
                raise InvalidKeyError("bad escape in quoted key", key=raw)
            out.append(value[i + 1])
            i += 2
            continue
        if c == '"':
            if i != n - 1:
                raise InvalidKeyError("unexpected characters after the closing quote", key=raw)
            return "".join(out)
        out.append(c)
        i += 1
    raise InvalidKeyError("the quoted key has no closing quote", key=raw)


def scope_from_authorization(headers: Mapping[str, str]) -> str:
    """Default scope: SHA-256 (hex) of the ``Authorization`` header, or ``""`` without one.

    Two callers with different credentials therefore never share a key space (SPEC §2), and the
    credential itself is never stored.

    Args:
        headers: request headers with lower-case names.
    """
    auth = headers.get("authorization")
    if not auth:
        return ""
    return hashlib.sha256(auth.encode("latin-1", "replace")).hexdigest()


def key_hash(scope: str, key: str) -> str:
    """The store's identifier for a (scope, key) pair: SHA-256 hex, 64 characters.

    The raw key never reaches SQL text or a Redis key pattern (SPEC §2).
    """
    return hashlib.sha256(f"{scope}\x00{key}".encode()).hexdigest()
