"""SPEC §2: idempotency keys, scopes and key hashes."""

from __future__ import annotations

import pytest

from retrysafe import InvalidKeyError
from retrysafe.core import MAX_KEY_LENGTH, key_hash, parse_key, scope_from_authorization


def test_bare_token_is_accepted() -> None:
    """A bare token (Stripe style) is the key itself."""
    key = "8e03978e-40d5-43e8-bc93-6894a57f9324"
    assert parse_key(key) == key


def test_structured_field_string_is_unquoted() -> None:
    """The IETF draft's sf-string form is unquoted, escapes resolved."""
    assert parse_key('"abc"') == "abc"
    assert parse_key(r'"a\"b\\c"') == 'a"b\\c'


def test_surrounding_whitespace_is_ignored() -> None:
    """Optional whitespace around the field value is not part of the key."""
    assert parse_key('  "abc"\t') == "abc"
    assert parse_key(" abc ") == "abc"


def test_quoted_key_may_hold_spaces_beside_a_visible_character() -> None:
    """Inside quotes a space is legal as long as one character is visible."""
    assert parse_key('" a "') == " a "
    assert parse_key('"a b"') == "a b"


def test_longest_key_is_accepted() -> None:
    """255 visible ASCII characters is the upper bound, inclusive."""
    assert parse_key("k" * MAX_KEY_LENGTH) == "k" * MAX_KEY_LENGTH


@pytest.mark.parametrize(
    ("raw", "reason_part"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ('""', "empty"),
        ("k" * 256, "256 characters"),
        ('"' + "k" * 256 + '"', "256 characters"),
        ("clé", "visible ASCII"),
        ("a\x00b", "visible ASCII"),
        ("a\x7fb", "visible ASCII"),
        ("a b", "visible ASCII"),
        ('"abc', "closing quote"),
        ('"a\\qb"', "escape"),
        ('"abc"def', "after the closing quote"),
        ('"   "', "only spaces"),
        ('" \t "', "visible ASCII"),
        ('abc"', "bare key cannot contain"),
        ('a"b', "bare key cannot contain"),
        ('ab"c', "bare key cannot contain"),
    ],
)
def test_malformed_keys_are_rejected_with_a_reason(raw: str, reason_part: str) -> None:
    """Empty, too long, invisible, spaces-only, bare-quote and badly quoted keys are refused."""
    with pytest.raises(InvalidKeyError) as info:
        parse_key(raw)
    assert reason_part in info.value.reason
    assert info.value.key == raw[:300]


def test_scope_is_a_hash_of_the_credentials() -> None:
    """The default scope hashes Authorization, never stores it, and is empty without one."""
    a = scope_from_authorization({"authorization": "Bearer tenant-a"})
    b = scope_from_authorization({"authorization": "Bearer tenant-b"})
    assert a != b and len(a) == 64 and "tenant" not in a
    assert scope_from_authorization({}) == ""


def test_key_hash_separates_scopes() -> None:
    """The same key in two scopes gives two store identifiers."""
    assert key_hash("a", "k") != key_hash("b", "k")
    assert key_hash("", "ab") != key_hash("a", "b")
    assert len(key_hash("", "k")) == 64
