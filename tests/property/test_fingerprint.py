"""SPEC §1, fuzzed: equal requests hash equal; a change of method, path, query, body or media
type hashes different."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from hypothesis import assume, given
from hypothesis import strategies as st

from retrysafe.core import canonical_body, fingerprint

TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
methods = st.text(TOKEN, min_size=1, max_size=8)  # RFC 9110 tokens: what a server passes on
# Route paths as ASGI and WSGI servers hand them over (decoded text; no lone surrogates).
paths = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
names = st.text("abcxyz_-.~%é", min_size=1, max_size=4)
values = st.text(st.characters(exclude_categories=["Cs"]), max_size=6)
pairs = st.lists(st.tuples(names, values), max_size=5)
media_types = st.sampled_from(
    ["application/json", "application/merge-patch+json", "text/plain",
     "application/x-www-form-urlencoded", "application/octet-stream", ""]
)  # fmt: skip
JSON_TYPES = ["application/json", "application/merge-patch+json", "application/vnd.x+json"]

json_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_text, inner, max_size=4),
    max_leaves=12,
)


def stable_sorted(items: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted(items, key=lambda p: p[0])


def shuffled_json(
    value: Any, data: st.DataObject, *, ensure_ascii: bool, indent: int | None
) -> str:
    """``value`` re-encoded with its object members in another order and other spacing."""

    def reorder(v: Any) -> Any:
        if isinstance(v, dict):
            keys = data.draw(st.permutations(list(v)))
            return {k: reorder(v[k]) for k in keys}
        if isinstance(v, list):
            return [reorder(x) for x in v]
        return v

    return json.dumps(reorder(value), ensure_ascii=ensure_ascii, indent=indent)


@given(method=methods, path=paths, query=pairs, body=st.binary(max_size=32), media=media_types)
def test_the_same_request_hashes_the_same(
    method: str, path: str, query: list[tuple[str, str]], body: bytes, media: str
) -> None:
    """A fingerprint is a function of the request: 64 hex digits, the same every time, and
    the method's letter case does not count."""
    q = urlencode(query)
    fp = fingerprint(method, path, q, body, media)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fingerprint(method.lower(), path, q, body, media) == fp
    assert fingerprint(method.upper(), path, q, body, media) == fp


@given(
    value=json_values,
    media=st.sampled_from(JSON_TYPES),
    ensure_ascii=st.booleans(),
    indent=st.one_of(st.none(), st.integers(0, 3)),
    data=st.data(),
)
def test_json_bodies_differing_only_in_member_order_and_spacing_are_equal(
    value: Any, media: str, ensure_ascii: bool, indent: int | None, data: st.DataObject
) -> None:
    """Any JSON value, re-encoded with its members in another order, other whitespace or
    ``\\u`` escapes, is the same request under any JSON media type."""
    a = json.dumps(value).encode()
    b = shuffled_json(value, data, ensure_ascii=ensure_ascii, indent=indent).encode()
    assert fingerprint("POST", "/p", "", a, media) == fingerprint("POST", "/p", "", b, media)


@given(query=pairs, data=st.data())
def test_reinterleaving_distinct_query_names_is_the_same_request(
    query: list[tuple[str, str]], data: st.DataObject
) -> None:
    """Parameters may arrive in any order as long as each name's values keep their order."""
    order = data.draw(st.permutations(range(len(query))))
    by_name: dict[str, list[str]] = {}
    for n, v in query:
        by_name.setdefault(n, []).append(v)
    seen: dict[str, int] = {}
    moved = []
    for i in order:
        n = query[i][0]
        moved.append((n, by_name[n][seen.get(n, 0)]))
        seen[n] = seen.get(n, 0) + 1
    assert fingerprint("POST", "/p", urlencode(query), b"", None) == fingerprint(
        "POST", "/p", urlencode(moved), b"", None
    )


@given(
    media=media_types.filter(bool),
    params=st.sampled_from(["", "; charset=utf-8", ";charset=ISO-8859-1", "; boundary=x"]),
    body=st.binary(max_size=16),
)
def test_media_type_parameters_and_case_do_not_count(media: str, params: str, body: bytes) -> None:
    """``Content-Type`` counts only by its type/subtype, case-insensitively."""
    assert fingerprint("POST", "/p", "", body, media) == fingerprint(
        "POST", "/p", "", body, media.upper() + params
    )


# ------------------------------------------------------------------------- changes
@given(a=methods, b=methods, path=paths, body=st.binary(max_size=8), media=media_types)
def test_another_method_is_another_request(
    a: str, b: str, path: str, body: bytes, media: str
) -> None:
    """Methods that differ other than in letter case hash different."""
    assume(a.upper() != b.upper())
    assert fingerprint(a, path, "", body, media) != fingerprint(b, path, "", body, media)


@given(a=paths, b=paths, query=pairs, body=st.binary(max_size=8), media=media_types)
def test_another_path_is_another_request(
    a: str, b: str, query: list[tuple[str, str]], body: bytes, media: str
) -> None:
    """Different route paths hash different."""
    assume(a != b)
    q = urlencode(query)
    assert fingerprint("POST", a, q, body, media) != fingerprint("POST", b, q, body, media)


@given(a=pairs, b=pairs, path=paths, body=st.binary(max_size=8), media=media_types)
def test_another_query_is_another_request(
    a: list[tuple[str, str]], b: list[tuple[str, str]], path: str, body: bytes, media: str
) -> None:
    """Queries whose parameters differ after the stable sort by name hash different."""
    assume(stable_sorted(a) != stable_sorted(b))
    fa = fingerprint("POST", path, urlencode(a), body, media)
    assert fa != fingerprint("POST", path, urlencode(b), body, media)


@given(a=st.binary(max_size=24), b=st.binary(max_size=24), media=media_types)
def test_another_body_is_another_request(a: bytes, b: bytes, media: str) -> None:
    """Bodies hash different unless their canonical forms are equal (byte for byte outside
    JSON)."""
    assume(canonical_body(a, media) != canonical_body(b, media))
    assert fingerprint("POST", "/p", "", a, media) != fingerprint("POST", "/p", "", b, media)


@given(a=json_values, b=json_values, media=st.sampled_from(JSON_TYPES))
def test_another_json_value_is_another_request(a: Any, b: Any, media: str) -> None:
    """Two JSON values that encode differently (sorted, compact) hash different."""
    ka, kb = (json.dumps(v, sort_keys=True, separators=(",", ":")) for v in (a, b))
    assume(ka != kb)
    assert fingerprint("POST", "/p", "", json.dumps(a).encode(), media) != fingerprint(
        "POST", "/p", "", json.dumps(b).encode(), media
    )


@given(a=media_types, b=media_types, body=st.binary(max_size=16), path=paths)
def test_another_media_type_is_another_request(a: str, b: str, body: bytes, path: str) -> None:
    """The same bytes under two media types are two requests (absent is its own type)."""
    assume(a != b)
    assert fingerprint("POST", path, "", body, a or None) != fingerprint(
        "POST", path, "", body, b or None
    )


def test_a_nul_in_the_path_cannot_pass_for_a_query() -> None:
    """``POST /a%00b=1`` with body ``X`` and ``POST /a?b=1`` with body ``\\0X`` (ASGI servers
    percent-decode the path, so a path can hold NUL) are different requests."""
    assert fingerprint("POST", "/a\x00b=1", "", b"X") != fingerprint("POST", "/a", "b=1", b"\x00X")
