"""SPEC §2, fuzzed: the ``Idempotency-Key`` parser against an independent reading of the rule
(RFC 8941 §3.3.3 sf-string or a bare token; 1–255 visible ASCII characters after unescaping).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from retrysafe import InvalidKeyError
from retrysafe.core import MAX_KEY_LENGTH, parse_key

VCHAR = "".join(map(chr, range(0x21, 0x7F)))
BARE = VCHAR.replace('"', "")
QUOTABLE = " " + VCHAR  # what an sf-string may hold (escaped where needed)
OWS = st.text(" \t", max_size=3)

_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_BARE = re.compile(r"[\x21\x23-\x7e]+")


def oracle(raw: str) -> str | None:
    """SPEC §2 read independently: the key ``raw`` names, or None when it is malformed."""
    value = raw.strip(" \t")
    if value.startswith('"'):
        m = _SF_STRING.fullmatch(value)
        if m is None:
            return None
        key = re.sub(r'\\(["\\])', r"\1", m.group(1))
    elif _BARE.fullmatch(value):
        key = value
    else:
        return None
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not key.strip(" "):
        return None
    return key


def sf_quote(key: str) -> str:
    """The RFC 8941 sf-string serialisation of ``key``."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


bare_keys = st.text(BARE, min_size=1, max_size=MAX_KEY_LENGTH)
keys = st.text(QUOTABLE, min_size=1, max_size=MAX_KEY_LENGTH).filter(lambda k: k.strip(" "))
# Header values near the rule: pieces of quoted strings, escapes, stray quotes and
# backslashes, whitespace and characters outside visible ASCII, in any order.
pieces = st.one_of(
    st.text(QUOTABLE, max_size=8),
    st.sampled_from(['"', "\\", '\\"', "\\\\", "\\a", " ", "\t", "\x00", "\x7f", "é", "\n"]),
    st.characters(),
)
near_misses = st.lists(pieces, max_size=12).map("".join)


@given(key=bare_keys, before=OWS, after=OWS)
def test_a_bare_token_is_the_key(key: str, before: str, after: str) -> None:
    """Any 1–255 visible ASCII characters without ``"``, with optional whitespace around,
    parse to themselves."""
    assert parse_key(before + key + after) == key


@given(key=keys, before=OWS, after=OWS)
def test_every_key_round_trips_through_its_sf_string(key: str, before: str, after: str) -> None:
    """Quoting any valid key (spaces, ``"`` and ``\\`` included) and parsing it gives the key
    back."""
    assert parse_key(before + sf_quote(key) + after) == key


@given(key=bare_keys)
def test_quoted_and_bare_forms_of_a_key_agree(key: str) -> None:
    """A key that can be sent bare names the same key sent quoted."""
    assert parse_key(key) == parse_key(sf_quote(key))


@given(raw=st.one_of(near_misses, st.text(), bare_keys, keys.map(sf_quote)))
@example(raw='"' + "k" * MAX_KEY_LENGTH + '"')
@example(raw='"' + "\\\\" * MAX_KEY_LENGTH + '"')  # 510 characters, a 255-character key
@example(raw='"' + "k" * (MAX_KEY_LENGTH + 1) + '"')
@example(raw='""')
@example(raw='"a"b"')
def test_the_parser_agrees_with_the_rule_on_any_text(raw: str) -> None:
    """For any header value the parser returns the key the rule names, or refuses it with
    InvalidKeyError (never another exception) carrying the raw value."""
    want = oracle(raw)
    try:
        got: str | InvalidKeyError = parse_key(raw)
    except InvalidKeyError as exc:
        got = exc
    if isinstance(got, InvalidKeyError):
        assert want is None, f"refused a valid key: {got.reason}"
        assert got.key == raw[:300] and got.reason
    else:
        assert got == want


@given(key=keys, extra=st.integers(1, 40))
def test_a_key_longer_than_255_characters_is_refused(key: str, extra: int) -> None:
    """Over 255 characters after unescaping is refused in both forms."""
    long_key = (key + "k" * MAX_KEY_LENGTH)[: MAX_KEY_LENGTH + extra]
    with pytest.raises(InvalidKeyError, match="at most 255"):
        parse_key(sf_quote(long_key))
    bare = long_key.replace(" ", "x").replace('"', "x")
    with pytest.raises(InvalidKeyError, match="at most 255"):
        parse_key(bare)


REFUSED_LOW = [chr(c) for c in range(0x300) if not 0x21 <= c <= 0x7E]


@pytest.mark.parametrize("form", ["bare", "quoted"])
def test_every_character_outside_visible_ascii_is_refused(form: str) -> None:
    """Each character from U+0000 to U+02FF outside 0x21–0x7E makes a key malformed wherever
    it stands inside it (a space inside quotes excepted: it is legal there)."""
    for c in REFUSED_LOW:
        for raw_key in (f"a{c}b", f"{c}ab", f"ab{c}"):
            if form == "quoted":
                if c == " ":
                    continue
                raw = sf_quote(raw_key)
            else:
                if c in " \t" and raw_key != f"a{c}b":
                    continue  # leading or trailing SP/HTAB is whitespace around the value
                raw = raw_key
            with pytest.raises(InvalidKeyError):
                parse_key(raw)


@given(key=bare_keys, c=st.characters(min_codepoint=0x300), where=st.integers(0, 255))
def test_any_character_beyond_ascii_is_refused(key: str, c: str, where: int) -> None:
    """Any character above U+02FF (surrogates included) inside a key is refused, bare or
    quoted."""
    at = where % (len(key) + 1)
    raw_key = key[:at] + c + key[at:]
    for raw in (raw_key, sf_quote(raw_key)):
        with pytest.raises(InvalidKeyError, match="visible ASCII"):
            parse_key(raw)


@given(key=bare_keys, where=st.integers(0, 255))
def test_a_quote_in_a_bare_key_is_refused(key: str, where: int) -> None:
    """A ``"`` anywhere in a bare key (not the first character) is refused."""
    at = 1 + where % len(key)
    with pytest.raises(InvalidKeyError, match="bare key cannot contain"):
        parse_key(key[:at] + '"' + key[at:])


@given(key=keys, c=st.sampled_from(sorted(set(QUOTABLE) - {'"', "\\"})), where=st.integers(0))
def test_a_backslash_escapes_only_a_quote_or_a_backslash(key: str, c: str, where: int) -> None:
    """Inside quotes, ``\\`` followed by anything but ``"`` or ``\\`` is refused."""
    tokens = ["\\" + ch if ch in '"\\' else ch for ch in key]
    at = where % (len(tokens) + 1)
    quoted = "".join(tokens[:at]) + "\\" + c + "".join(tokens[at:])
    with pytest.raises(InvalidKeyError, match="escape"):
        parse_key('"' + quoted + '"')
