"""SPEC §1: a fingerprint identifies "the same request"."""

from __future__ import annotations

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
