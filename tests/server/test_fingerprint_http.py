"""SPEC §1 and §2 over real HTTP: what makes a request "the same", and which keys are refused."""

from __future__ import annotations

import socket

import pytest

from .harness import Serve, assert_problem, is_replay

JSON = {"Content-Type": "application/json"}


def test_repeated_query_parameters_in_another_order_are_key_reused(serve: Serve) -> None:
    """Same key, ``?a=1&a=100`` then ``?a=100&a=1``: 422 key-reused, the handler ran once."""
    h = serve()
    assert h.post("/posts?a=1&a=100", key="k1", json={}).status_code == 201
    assert_problem(h.post("/posts?a=100&a=1", key="k1", json={}), 422, "key-reused")
    assert h.effects.counts["posts"] == 1


def test_distinct_query_names_in_another_order_replay(serve: Serve) -> None:
    """Same key, ``?a=1&b=2`` then ``?b=2&a=1``: the same request, replayed."""
    h = serve()
    h.post("/posts?a=1&b=2", key="k1", json={})
    assert is_replay(h.post("/posts?b=2&a=1", key="k1", json={}))
    assert h.effects.counts["posts"] == 1


def test_duplicate_json_members_in_another_order_are_key_reused(serve: Serve) -> None:
    """Same key, ``{"a":1,"a":2}`` then ``{"a":2,"a":1}`` (both JSON): 422 key-reused."""
    h = serve()
    assert h.post("/posts", key="k1", content=b'{"a":1,"a":2}', headers=JSON).status_code == 201
    second = h.post("/posts", key="k1", content=b'{"a":2,"a":1}', headers=JSON)
    assert_problem(second, 422, "key-reused")
    assert h.effects.counts["posts"] == 1


def test_duplicate_members_are_not_the_member_that_wins_here(serve: Serve) -> None:
    """Same key, ``{"a":1,"a":2}`` then ``{"a":2}``: 422, although Python's parser keeps a=2."""
    h = serve()
    h.post("/posts", key="k1", content=b'{"a":1,"a":2}', headers=JSON)
    second = h.post("/posts", key="k1", content=b'{"a":2}', headers=JSON)
    assert_problem(second, 422, "key-reused")
    assert h.effects.counts["posts"] == 1


def test_same_bytes_as_another_media_type_are_key_reused(serve: Serve) -> None:
    """Same key and bytes, sent as application/json then as text/plain: 422 key-reused."""
    h = serve()
    body = b'{"a":1}'
    assert h.post("/posts", key="k1", content=body, headers=JSON).status_code == 201
    text = {"Content-Type": "text/plain"}
    assert_problem(h.post("/posts", key="k1", content=body, headers=text), 422, "key-reused")
    assert h.effects.counts["posts"] == 1


def test_charset_parameter_does_not_change_the_request(serve: Serve) -> None:
    """``application/json`` then ``application/json; charset=utf-8``: replayed."""
    h = serve()
    h.post("/posts", key="k1", content=b'{"a":1}', headers=JSON)
    with_charset = {"Content-Type": "application/json; charset=utf-8"}
    assert is_replay(h.post("/posts", key="k1", content=b'{"a": 1}', headers=with_charset))
    assert h.effects.counts["posts"] == 1


@pytest.mark.parametrize(
    ("key", "reason"),
    [('"   "', "only spaces"), ('ab"c', "bare key"), ('abc"', "bare key")],
    ids=["quoted-spaces", "bare-inner-quote", "bare-trailing-quote"],
)
def test_spaces_only_or_bare_quote_key_is_400(serve: Serve, key: str, reason: str) -> None:
    """A quoted key of spaces only, or a bare key holding ``"``: 400 invalid-key, no handler."""
    h = serve()
    doc = assert_problem(h.post("/posts", key=key, json={}), 400, "invalid-key")
    assert reason in doc["detail"]
    assert h.effects.counts["posts"] == 0


def test_deeply_nested_json_body_is_answered_and_replayed(serve: Serve) -> None:
    """A body nested past the recursion limit is fingerprinted as bytes: 201, then a replay."""
    h = serve()
    body = b"[" * 50_000 + b"]" * 50_000
    assert h.post("/posts", key="k1", content=body, headers=JSON).status_code == 201
    assert is_replay(h.post("/posts", key="k1", content=body, headers=JSON))
    assert h.effects.counts["posts"] == 1


def test_lone_surrogate_in_json_body_is_answered(serve: Serve) -> None:
    """``{"a":"\\ud800"}`` (valid JSON, not encodable as strict UTF-8) runs and replays."""
    h = serve()
    body = b'{"a": "\\ud800"}'
    assert h.post("/posts", key="k1", content=body, headers=JSON).status_code == 201
    assert is_replay(h.post("/posts", key="k1", content=body, headers=JSON))


def test_non_utf8_percent_escapes_are_distinct_queries(serve: Serve) -> None:
    """Same key, ``?a=%FF`` then ``?a=%FE``: two requests (422), not both U+FFFD (a replay)."""
    h = serve()
    assert h.post("/posts?a=%FF", key="k1", json={}).status_code == 201
    assert is_replay(h.post("/posts?a=%FF", key="k1", json={}))
    assert_problem(h.post("/posts?a=%FE", key="k1", json={}), 422, "key-reused")


def _raw_post(url: str, target: bytes, key: bytes) -> int:
    """Send a POST whose request target is raw bytes (httpx would percent-encode them)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = b"POST %b HTTP/1.1\r\nHost: test\r\nIdempotency-Key: %b\r\n" % (target, key)
        sock.sendall(head + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_raw_non_utf8_query_bytes_never_fail(serve: Serve) -> None:
    """Raw ``\\xff`` in the query: uvicorn refuses it (400); werkzeug passes it, fingerprinted."""
    h = serve()
    statuses = [
        _raw_post(h.url, b"/posts?a=\xff", b"k1"),
        _raw_post(h.url, b"/posts?a=\xff", b"k1"),
        _raw_post(h.url, b"/posts?a=\xfe", b"k1"),
    ]
    if h.framework == "flask":
        assert statuses == [201, 201, 422]
        assert h.effects.counts["posts"] == 1
    else:
        assert statuses == [400, 400, 400]
        assert h.effects.counts["posts"] == 0
