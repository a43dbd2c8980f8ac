"""SPEC §1: a fingerprint identifies "the same request"."""

from __future__ import annotations

import hashlib
import random

from retrysafe.core import canonical_body, fingerprint, is_json_content_type

JSON = "application/json"


def test_json_key_order_and_whitespace_do_not_matter() -> None:
    """JSON bodies that differ only in key order or whitespace are the same request."""
    a = fingerprint("POST", "/posts", "", b'{"a": 1, "b": [1, 2]}', JSON)
    b = fingerprint("post", "/posts", "", b'{ "b":[1,2],\n "a":1 }', JSON)
    assert a == b


def test_different_json_values_differ() -> None:
    """A changed value is a different request."""
    assert fingerprint("POST", "/p", "", b'{"a":1}', JSON) != fingerprint(
        "POST", "/p", "", b'{"a":2}', JSON
    )


def test_method_path_and_query_are_part_of_the_fingerprint() -> None:
    """Method, route path and query each change the fingerprint."""
    base = fingerprint("POST", "/p", "x=1", b"{}", JSON)
    assert base != fingerprint("PATCH", "/p", "x=1", b"{}", JSON)
    assert base != fingerprint("POST", "/q", "x=1", b"{}", JSON)
    assert base != fingerprint("POST", "/p", "x=2", b"{}", JSON)


def test_query_parameter_order_does_not_matter() -> None:
    """Query parameters are sorted before hashing."""
    assert fingerprint("POST", "/p", "a=1&b=2", b"", None) == fingerprint(
        "POST", "/p", "b=2&a=1", b"", None
    )


def test_malformed_json_is_compared_as_bytes() -> None:
    """A body that claims JSON but does not parse is compared byte for byte, not an error."""
    assert canonical_body(b"{not json", JSON) == b"{not json"
    assert fingerprint("POST", "/p", "", b"{not json", JSON) != fingerprint(
        "POST", "/p", "", b"{not  json", JSON
    )


def test_binary_bodies_are_compared_as_bytes() -> None:
    """Non-JSON bodies are never canonicalised."""
    blob = bytes(range(256))
    assert canonical_body(blob, "application/octet-stream") == blob
    assert canonical_body(b'{"b":1, "a":2}', "text/plain") == b'{"b":1, "a":2}'


def test_json_media_types() -> None:
    """application/json and +json types count as JSON, parameters ignored."""
    assert is_json_content_type("application/json; charset=utf-8")
    assert is_json_content_type("application/merge-patch+json")
    assert not is_json_content_type("text/json-ish")
    assert not is_json_content_type(None)


def test_deeply_nested_json_does_not_crash() -> None:
    """Pathological nesting falls back to raw bytes instead of raising RecursionError."""
    body = b"[" * 100_000 + b"]" * 100_000
    assert canonical_body(body, JSON) == body


# ----------------------------------------------------------------------------- query
def test_repeated_query_parameters_keep_their_order() -> None:
    """``a=1&a=100`` and ``a=100&a=1`` are different requests."""
    assert fingerprint("POST", "/p", "a=1&a=100", b"", None) != fingerprint(
        "POST", "/p", "a=100&a=1", b"", None
    )


def test_query_sort_is_stable_by_name() -> None:
    """Distinct names move freely around repeated ones, which keep their relative order."""
    base = fingerprint("POST", "/p", "a=1&b=2&a=3", b"", None)
    assert base == fingerprint("POST", "/p", "b=2&a=1&a=3", b"", None)
    assert base != fingerprint("POST", "/p", "a=3&b=2&a=1", b"", None)


def test_blank_query_values_are_kept() -> None:
    """A parameter with a blank value is part of the query (``a=`` is not no parameter)."""
    assert fingerprint("POST", "/p", "a=&b=1", b"", None) != fingerprint(
        "POST", "/p", "b=1", b"", None
    )


def test_non_utf8_percent_escapes_stay_distinct() -> None:
    """``%FF`` and ``%FE`` are two queries, not both U+FFFD."""
    assert fingerprint("POST", "/p", "a=%FF", b"", None) != fingerprint(
        "POST", "/p", "a=%FE", b"", None
    )


def test_raw_latin1_query_characters_do_not_raise() -> None:
    """Any query string the server decodes (Latin-1 bytes) hashes without an error."""
    query = bytes(range(1, 256)).decode("latin-1")
    assert len(fingerprint("POST", "/p", query, b"", None)) == 64


def test_seeded_query_shuffles_follow_the_stable_sort() -> None:
    """Random queries: interleaving names keeps the fingerprint, swapping repeats changes it."""
    rng = random.Random(20261210)
    for _ in range(200):
        pairs = [(rng.choice("abc"), str(rng.randrange(5))) for _ in range(rng.randrange(2, 8))]
        query = "&".join(f"{n}={v}" for n, v in pairs)
        by_name = {n: [v for m, v in pairs if m == n] for n in "abc"}
        names = [n for n, _ in pairs]
        rng.shuffle(names)  # a new interleaving of names, each name's values in order
        taken = dict.fromkeys("abc", 0)
        interleaved = []
        for n in names:
            interleaved.append(f"{n}={by_name[n][taken[n]]}")
            taken[n] += 1
        assert fingerprint("POST", "/p", query, b"", None) == fingerprint(
            "POST", "/p", "&".join(interleaved), b"", None
        )
        reorderable = [n for n, vs in by_name.items() if vs != vs[::-1]]
        if reorderable:  # reverse one name's values in place: a different request
            n = reorderable[0]
            it = iter(by_name[n][::-1])
            other = "&".join(f"{m}={next(it) if m == n else v}" for m, v in pairs)
            assert fingerprint("POST", "/p", query, b"", None) != fingerprint(
                "POST", "/p", other, b"", None
            )


# ----------------------------------------------------------------------------- media type
def test_media_type_is_part_of_the_fingerprint() -> None:
    """The same bytes sent as application/json and as text/plain are different requests."""
    body = b'{"a":1}'
    assert fingerprint("POST", "/p", "", body, JSON) != fingerprint(
        "POST", "/p", "", body, "text/plain"
    )


def test_absent_content_type_differs_from_json() -> None:
    """No Content-Type is the empty media type, not application/json."""
    body = b'{"a":1}'
    assert fingerprint("POST", "/p", "", body, None) != fingerprint("POST", "/p", "", body, JSON)
    assert fingerprint("POST", "/p", "", body, None) == fingerprint("POST", "/p", "", body, "")


def test_json_suffix_types_are_their_own_media_type() -> None:
    """``application/merge-patch+json`` is canonicalised like JSON but is not application/json."""
    merge = "application/merge-patch+json"
    assert fingerprint("PATCH", "/p", "", b'{"a":1,"b":2}', merge) == fingerprint(
        "PATCH", "/p", "", b'{"b": 2, "a": 1}', merge
    )
    assert fingerprint("PATCH", "/p", "", b'{"a":1}', merge) != fingerprint(
        "PATCH", "/p", "", b'{"a":1}', JSON
    )


def test_media_type_parameters_and_case_are_ignored() -> None:
    """Only type/subtype counts: ``charset`` and letter case do not change the fingerprint."""
    body = b'{"a":1}'
    assert fingerprint("POST", "/p", "", body, JSON) == fingerprint(
        "POST", "/p", "", body, "Application/JSON ; charset=utf-8"
    )
    assert fingerprint("POST", "/p", "", b"hi", "text/plain") == fingerprint(
        "POST", "/p", "", b"hi", "text/plain; charset=iso-8859-1"
    )


def test_application_json_layout_has_no_prefix() -> None:
    """application/json hashes method NUL path NUL sorted query NUL canonical body, as before."""
    got = fingerprint("post", "/posts", "b=2&a=1", b'{"b": 1, "a": [1, 2]}', JSON)
    want = hashlib.sha256(b'POST\x00/posts\x00a=1&b=2\x00{"a":[1,2],"b":1}').hexdigest()
    assert got == want


def test_other_media_types_are_hashed_in_a_length_prefix() -> None:
    """Any other media type (and none) prefixes ``media-type NUL <length> NUL <type>``."""
    got = fingerprint("POST", "/p", "", b"hi", "Text/Plain; charset=utf-8")
    want = hashlib.sha256(b"media-type\x0010\x00text/plainPOST\x00/p\x00\x00hi").hexdigest()
    assert got == want
    none = hashlib.sha256(b"media-type\x000\x00POST\x00/p\x00\x00hi").hexdigest()
    assert fingerprint("POST", "/p", "", b"hi", None) == none


# ----------------------------------------------------------------------------- JSON body
def test_duplicate_json_members_are_compared_as_bytes() -> None:
    """A body naming a member twice is hashed raw: ``{"a":1,"a":2}`` is not ``{"a":2,"a":1}``."""
    assert canonical_body(b'{"a":1,"a":2}', JSON) == b'{"a":1,"a":2}'
    assert fingerprint("POST", "/p", "", b'{"a":1,"a":2}', JSON) != fingerprint(
        "POST", "/p", "", b'{"a":2,"a":1}', JSON
    )


def test_duplicate_members_differ_from_the_last_member_alone() -> None:
    """``{"a":1,"a":2}`` is not ``{"a":2}``: a first-wins parser would read a=1."""
    assert fingerprint("POST", "/p", "", b'{"a":1,"a":2}', JSON) != fingerprint(
        "POST", "/p", "", b'{"a":2}', JSON
    )


def test_nested_duplicate_members_are_detected() -> None:
    """A duplicate member deep inside arrays and objects also keeps the raw bytes."""
    body = b'{"x": [1, {"y": {"a": 1, "a": 1}}]}'
    assert canonical_body(body, JSON) == body


def test_equal_names_in_different_objects_are_not_duplicates() -> None:
    """The same member name in sibling or nested objects is ordinary JSON and canonicalised."""
    assert canonical_body(b'{"b": {"a": 1}, "a": {"a": 2}}', JSON) == b'{"a":{"a":2},"b":{"a":1}}'


def test_lone_surrogate_escape_does_not_raise() -> None:
    """``"\\ud800"`` parses but cannot be strict UTF-8; it is hashed and stays distinct."""
    a = fingerprint("POST", "/p", "", b'{"a": "\\ud800"}', JSON)
    b = fingerprint("POST", "/p", "", b'{"a": "\\ud801"}', JSON)
    assert a != b


def test_utf16_and_bom_json_are_canonicalised() -> None:
    """JSON in UTF-16 or with a UTF-8 BOM is detected as json.loads does and canonicalised."""
    want = b'{"a":1,"b":2}'
    assert canonical_body('{"b": 2, "a": 1}'.encode("utf-16"), JSON) == want
    assert canonical_body('{"b": 2, "a": 1}'.encode("utf-16-le"), JSON) == want
    assert canonical_body(b'\xef\xbb\xbf{"b": 2, "a": 1}', JSON) == want


def test_deeply_nested_objects_do_not_crash() -> None:
    """Objects nested past the recursion limit fall back to raw bytes too."""
    body = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    assert canonical_body(body, JSON) == body


def test_seeded_hostile_json_bodies_never_raise() -> None:
    """Random byte mutations of a JSON body always give a fingerprint, never an exception."""
    rng = random.Random(7)
    seed = bytearray(b'{"a": [1, 2.5e3, "\\u00e9\\ud83d"], "b": {"c": null, "d": true}}')
    for _ in range(2000):
        body = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        assert len(fingerprint("POST", "/p", "", bytes(body), JSON)) == 64


def test_numbers_a_float_cannot_hold_are_compared_as_bytes() -> None:
    """1e400 and 2e400 (both Infinity as floats), or two literals rounding to one double,
    are different requests; numbers a float holds exactly are still canonicalised."""
    def fp(body: bytes) -> str:
        return fingerprint("POST", "/p", "", body, JSON)

    assert fp(b'{"a": 1e400}') != fp(b'{"a": 2e400}')
    assert fp(b'{"a": 0.30000000000000004}') != fp(b'{"a": 0.3000000000000000444}')
    assert fp(b'{"a": 1.50, "b": 2}') == fp(b'{"b": 2, "a": 1.5}')
    assert canonical_body(b'{"a": 1e400}', JSON) == b'{"a": 1e400}'
