"""SPEC §2 and the first rows of §3: which requests are protected, and their keys."""

from __future__ import annotations

import pytest

from .harness import Serve, assert_problem, is_replay


def test_unkeyed_request_runs_unprotected(serve: Serve) -> None:
    """No key on a route where it is optional: the handler runs, nothing is stored."""
    h = serve()
    r = h.post("/posts", json={"a": 1})
    assert r.status_code == 201
    assert not is_replay(r)
    assert h.effects.counts["posts"] == 1


def test_two_unkeyed_requests_never_replay_each_other(serve: Serve) -> None:
    """Two different requests without a key both run; neither gets the other's answer."""
    h = serve()
    first = h.post("/posts", json={"a": 1})
    second = h.post("/posts", json={"a": 2})
    assert first.json()["n"] == 1
    assert second.json()["n"] == 2
    assert not is_replay(second)
    assert h.effects.counts["posts"] == 2


def test_missing_key_on_required_route_is_400(serve: Serve) -> None:
    """Key required and absent: 400 missing-key, the handler does not run."""
    h = serve(key_required=True)
    assert_problem(h.post("/posts", json={}), 400, "missing-key")
    assert h.effects.counts["posts"] == 0


def test_non_ascii_key_error_names_the_real_character(serve: Serve) -> None:
    """A UTF-8 key is refused, and the detail shows the character the client sent."""
    h = serve()
    doc = assert_problem(h.post("/posts", key="héllo".encode(), json={}), 400, "invalid-key")
    assert "'é'" in doc["detail"]


def test_key_required_per_route(serve: Serve) -> None:
    """A ``key_required(method, path)`` function decides per route."""
    h = serve(key_required=lambda method, path: path == "/posts")
    assert_problem(h.post("/posts", json={}), 400, "missing-key")
    assert h.post("/empty").status_code == 204
    assert h.effects.counts == {"empty": 1}


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("", "empty"),
        ("k" * 256, "256 characters"),
        ("clé".encode(), "outside visible ASCII"),
        ("a\tb", "outside visible ASCII"),
        ('"abc', "no closing quote"),
    ],
    ids=["empty", "256-chars", "non-ascii", "control-char", "unterminated-quote"],
)
def test_malformed_key_is_400(serve: Serve, key: str | bytes, reason: str) -> None:
    """A malformed key: 400 invalid-key whose detail says why; the handler does not run."""
    h = serve()
    doc = assert_problem(h.post("/posts", key=key, json={}), 400, "invalid-key")
    assert reason in doc["detail"]
    assert h.effects.counts["posts"] == 0


def test_longest_key_is_accepted(serve: Serve) -> None:
    """255 visible ASCII characters is a valid key, and it replays."""
    h = serve()
    key = "k" * 255
    assert h.post("/posts", key=key, json={}).status_code == 201
    assert is_replay(h.post("/posts", key=key, json={}))


def test_quoted_and_bare_key_are_the_same_key(serve: Serve) -> None:
    """The structured-field form ``"abc"`` and the bare token ``abc`` name one key."""
    h = serve()
    assert h.post("/posts", key='"abc-1"', json={}).status_code == 201
    assert is_replay(h.post("/posts", key="abc-1", json={}))


def test_unprotected_method_passes_through(serve: Serve) -> None:
    """GET is not protected: a key on it changes nothing, the handler runs every time."""
    h = serve()
    assert h.request("GET", "/posts", key="k1").json() == {"n": 1}
    r = h.request("GET", "/posts", key="k1")
    assert r.json() == {"n": 2}
    assert not is_replay(r)


def test_protected_methods_are_configurable(serve: Serve) -> None:
    """With only PATCH protected, a keyed POST runs every time."""
    h = serve(protected_methods={"patch"})
    h.post("/posts", key="k1", json={})
    assert not is_replay(h.post("/posts", key="k1", json={}))
    assert h.effects.counts["posts"] == 2
    h.request("PATCH", "/posts", key="k2", json={})
    assert is_replay(h.request("PATCH", "/posts", key="k2", json={}))


def test_different_authorization_never_shares_a_key(serve: Serve) -> None:
    """Default scope: another tenant's identical key and request runs on its own."""
    h = serve()
    alice = h.post("/posts", key="k1", json={}, headers={"Authorization": "Bearer alice"})
    bob = h.post("/posts", key="k1", json={}, headers={"Authorization": "Bearer bob"})
    assert not is_replay(bob)
    assert (alice.json()["n"], bob.json()["n"]) == (1, 2)
    again = h.post("/posts", key="k1", json={}, headers={"Authorization": "Bearer alice"})
    assert is_replay(again)
    assert again.json()["n"] == 1


def test_custom_scope_function(serve: Serve) -> None:
    """A custom scope function (here: the X-Tenant header) decides who owns a key."""
    h = serve(scope=lambda headers: headers.get("x-tenant", ""))
    h.post("/posts", key="k1", json={}, headers={"X-Tenant": "t1", "Authorization": "a"})
    other_tenant = h.post("/posts", key="k1", json={}, headers={"X-Tenant": "t2"})
    assert not is_replay(other_tenant)
    same_tenant = h.post("/posts", key="k1", json={}, headers={"X-Tenant": "t1"})
    assert is_replay(same_tenant)
    assert same_tenant.json()["n"] == 1
