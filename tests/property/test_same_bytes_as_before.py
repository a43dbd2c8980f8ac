"""SPEC §1–§4, fuzzed against the past: canonical bodies, fingerprints, key hashes and stored
headers are the same bytes as before the fast paths (orjson, one-buffer hashing, the headers
encoder), with orjson and without it, so every stored key is found again and its fingerprint
still matches its repeats after an upgrade."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from retrysafe.core import _fingerprint as current

from . import _fingerprint_before as before

JSON = "application/json"
orjson = pytest.importorskip("orjson")  # the fast path is what these tests hold to the past
#: Each test runs with the fast encoder (orjson) and with the fallback (orjson absent).
ENCODERS = pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])


def encoder(fast: bool) -> mock._patch[object]:
    """The fingerprint module as it runs with orjson (``fast``) or without it."""
    return mock.patch.object(current, "orjson", orjson if fast else None)


# ---------------------------------------------------------------------- JSON texts, as sent
# Numbers as clients write them: every way of spelling a float, integers of any size, and the
# literals the standard library reads (NaN, Infinity) or refuses to make exact (1e400).
_FLOAT_SPELLINGS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: f"{f:e}"),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: f"{f:.17g}"),
    st.decimals(allow_nan=False, allow_infinity=False).map(str),
    st.builds(
        "{}{}.{}{}{}".format,
        st.sampled_from(["", "-"]),
        st.integers(0, 10**20),
        st.integers(0, 10**20),
        st.sampled_from(["", "e", "E", "e+", "e-", "E-"]),
        st.integers(0, 400).map(str),
    ),
)
_NUMBERS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=2**63 - 2, max_value=2**65).map(str),  # around orjson's 64 bits
    st.integers(max_value=-(2**63) + 2, min_value=-(2**65)).map(str),
    _FLOAT_SPELLINGS,
    st.sampled_from(
        ["NaN", "Infinity", "-Infinity", "1e400", "-0", "-0.0", "0.1", "1E16", "1e16", "1e-7",
         "0.30000000000000004", "0.3000000000000000444", "9007199254740993", "5e-324"]
    ),
)  # fmt: skip
# Strings: raw text (any code point but lone surrogates, which cannot be sent raw in UTF-8),
# and escapes, lone surrogates and control characters included.
_CHARS = st.characters(exclude_categories=["Cs"])
_STRINGS = st.one_of(
    st.text(_CHARS, max_size=6).map(lambda t: json.dumps(t, ensure_ascii=False)),
    st.text(_CHARS, max_size=6).map(json.dumps),
    st.lists(st.integers(0, 0xFFFF), max_size=4).map(
        lambda cps: '"' + "".join(f"\\u{c:04x}" for c in cps) + '"'
    ),
    st.sampled_from(['"\\ud800"', '"\\udc00x"', '"\\ud83d\\ude00"', '"a\\/b"', '"\\u0000\\n"']),
)
# Few distinct member names, so duplicates (at any depth) come up often.
_NAMES = st.one_of(st.sampled_from(['"a"', '"b"', '"é"', '"\\u0061"', '"A"', '""']), _STRINGS)
_SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])


def _array(items: list[str], space: str) -> str:
    return "[" + space + ("," + space).join(items) + space + "]"


def _object(members: list[tuple[str, str]], space: str) -> str:
    inner = ("," + space).join(f"{k}{space}:{space}{v}" for k, v in members)
    return "{" + space + inner + space + "}"


_JSON_TEXTS = st.recursive(
    st.one_of(_NUMBERS, _STRINGS, st.sampled_from(["true", "false", "null"])),
    lambda inner: st.one_of(
        st.builds(_array, st.lists(inner, max_size=4), _SPACE),
        st.builds(_object, st.lists(st.tuples(_NAMES, inner), max_size=4), _SPACE),
    ),
    max_leaves=16,
)
_ENCODINGS = st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be"]
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A request body: usually JSON text in some encoding, sometimes broken or arbitrary."""
    kind = draw(st.sampled_from(["json", "json", "json", "encoded", "deep", "broken", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "deep":  # nesting beyond orjson's limit, and beyond the parser's
        depth = draw(st.sampled_from([200, 260, 300, 1200]))
        leaf = draw(st.sampled_from(["1", "1.5", '"x"', "{}"]))
        return ("[" * depth + leaf + "]" * depth).encode()
    text = draw(_JSON_TEXTS)
    if kind == "broken":
        cut = draw(st.integers(0, len(text)))
        return text[:cut].encode() + draw(st.binary(max_size=3))
    encoding = draw(_ENCODINGS) if kind == "encoded" else "utf-8"
    return text.encode(encoding, "surrogatepass")


@ENCODERS
@given(body=bodies())
@example(body=b'{"b":1,"a":[1.5,NaN,-Infinity,2]}')
@example(body=b'{"a":NaN,"b":[-Infinity,Infinity]}')  # no other float to hide them
@example(body=b'{"a":1e16,"b":1E+16,"c":1e-7}')
@example(body=b'{"a":18446744073709551616,"b":-9223372036854775809}')
@example(body=b'{"k":"\\ud800","\\udfff":0}')
@example(body=b'{"a":1,"b":{"a":1,"a":2}}')
@example(body=b'{"\xc3\xa9":1,"z":2,"\xf0\x9f\x98\x80":3,"\xef\xbf\xbf":4}')
@example(body='{"\u2028":"\x7f\u2029"}'.encode())
def test_canonical_bodies_are_the_bytes_they_always_were(fast: bool, body: bytes) -> None:
    """For any body — JSON in any encoding, floats of every spelling, huge integers, NaN,
    escapes and lone surrogates, duplicate members, deep nesting, broken or binary bytes —
    the canonical form is the one the implementation before orjson gave."""
    with encoder(fast):
        for media in (JSON, "application/merge-patch+json; charset=utf-8", "text/plain"):
            assert current.canonical_body(body, media) == before.canonical_body(body, media)


@ENCODERS
@given(
    method=st.sampled_from(["POST", "patch", "PUT"]),
    path=st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    query=st.text(max_size=12),
    body=bodies(),
    content_type=st.one_of(
        st.none(),
        st.sampled_from(
            ["application/json", "APPLICATION/JSON", "application/json; charset=utf-8",
             " application/json ", "application/problem+json", "text/plain", ""]
        ),
    ),
)  # fmt: skip
def test_fingerprints_are_the_hashes_they_always_were(
    fast: bool, method: str, path: str, query: str, body: bytes, content_type: str | None
) -> None:
    """A request's fingerprint is the one the implementation before orjson computed, so a
    key stored before the upgrade still matches its repeats after it."""
    with encoder(fast):
        got = current.fingerprint(method, path, query, body, content_type)
    assert got == before.fingerprint(method, path, query, body, content_type)


def test_the_fast_path_is_taken_for_plain_json() -> None:
    """With orjson installed, a JSON body without floats is encoded by orjson (the fast path
    these tests hold to the past is the one requests take)."""
    with mock.patch.object(current, "_CANONICAL_JSON") as stdlib:
        assert current.canonical_body(b'{"b": [1, true], "a": "x"}', JSON) == (
            b'{"a":"x","b":[1,true]}'
        )
    stdlib.encode.assert_not_called()


def _key_hash_before(scope: str, key: str) -> str:
    """``retrysafe.core.key_hash`` before it hashed one buffer (commit 289c1b6), verbatim."""
    import hashlib

    h = hashlib.sha256()
    h.update(scope.encode("utf-8"))
    h.update(b"\x00")
    h.update(key.encode("utf-8"))
    return h.hexdigest()


@given(scope=st.one_of(st.just(""), st.text(_CHARS, max_size=70)), key=st.text(_CHARS, max_size=40))
def test_key_hashes_are_the_ones_they_always_were(scope: str, key: str) -> None:
    """The store's id of a (scope, key) pair is unchanged, so stored keys are found again."""
    from retrysafe.core import key_hash

    assert key_hash(scope, key) == _key_hash_before(scope, key)


@given(headers=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=20)), max_size=6))
def test_stored_headers_are_the_json_they_always_were(headers: list[tuple[str, str]]) -> None:
    """A stored response's headers are written as the same JSON text as before (what
    ``json.dumps`` wrote), so records written by either version read the same."""
    from retrysafe.stores._keys import headers_json

    assert headers_json(headers) == json.dumps([list(p) for p in headers])
    assert json.loads(headers_json(headers)) == [list(p) for p in headers]
