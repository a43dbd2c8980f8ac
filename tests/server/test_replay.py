"""SPEC §3 replay rows and §4 (what is stored, which headers come back)."""

from __future__ import annotations

import time

import pytest

from retrysafe.core import KeyState

from .harness import BIG, Serve, assert_problem, is_replay, records


def test_first_attempt_runs_and_completes_the_key(serve: Serve) -> None:
    """A new key is claimed, the handler runs once and the key is completed."""
    h = serve()
    r = h.post("/posts", key="k1", json={"title": "hello"})
    assert r.status_code == 201
    assert not is_replay(r)
    assert h.effects.counts["posts"] == 1
    assert h.store.purge_keys(now=h.clock() - 1) == 0  # nothing expired
    # The store holds exactly what the client got.
    done = [rec for rec in records(h.store) if rec.state is KeyState.COMPLETED]
    assert len(done) == 1
    assert done[0].response is not None
    assert done[0].response.body == r.content


def test_repeat_replays_without_running_the_handler(serve: Serve) -> None:
    """Same key, same request: the stored response comes back marked as replayed."""
    h = serve()
    first = h.post("/posts", key="k1", json={"title": "hello"})
    second = h.post("/posts", key="k1", json={"title": "hello"})
    assert is_replay(second)
    assert second.status_code == first.status_code == 201
    assert second.content == first.content
    assert h.effects.counts["posts"] == 1


def test_replayed_201_keeps_location_etag_and_cache_control(serve: Serve) -> None:
    """Content-Type, Location, ETag and Cache-Control are replayed."""
    h = serve()
    first = h.post("/posts", key="k1", json={})
    second = h.post("/posts", key="k1", json={})
    for name in ("content-type", "location", "etag", "cache-control"):
        assert second.headers[name] == first.headers[name], name
    assert second.headers["location"] == "/posts/1"
    assert second.headers["content-length"] == str(len(first.content))


def test_headers_outside_the_allow_list_are_not_replayed(serve: Serve) -> None:
    """Set-Cookie (and any header not allow-listed) is never replayed."""
    h = serve()
    first = h.post("/posts", key="k1", json={})
    assert "set-cookie" in first.headers
    second = h.post("/posts", key="k1", json={})
    assert "set-cookie" not in second.headers
    assert "x-custom" not in second.headers


def test_replay_header_allow_list_is_extensible(serve: Serve) -> None:
    """``replay_headers`` adds headers (case-insensitive) to the replayed set."""
    h = serve(replay_headers=["X-CUSTOM"])
    h.post("/posts", key="k1", json={})
    second = h.post("/posts", key="k1", json={})
    assert second.headers["x-custom"] == "c1"
    assert "set-cookie" not in second.headers


def test_204_with_empty_body_is_replayed(serve: Serve) -> None:
    """An empty body is a valid stored response: 204 replays, the handler runs once."""
    h = serve()
    assert h.post("/empty", key="k1").status_code == 204
    second = h.post("/empty", key="k1")
    assert second.status_code == 204
    assert is_replay(second)
    assert second.content == b""
    assert h.effects.counts["empty"] == 1


def test_json_null_is_replayed(serve: Serve) -> None:
    """A handler answering JSON ``null`` is stored and replayed, not re-run."""
    h = serve()
    assert h.post("/null", key="k1").json() is None
    second = h.post("/null", key="k1")
    assert is_replay(second)
    assert second.status_code == 200
    assert second.content == b"null"
    assert h.effects.counts["null"] == 1


def test_json_bodies_differing_in_key_order_and_spacing_replay(serve: Serve) -> None:
    """JSON bodies equal after canonicalisation are the same request."""
    h = serve()
    h.post("/posts", key="k1", content=b'{"a": 1, "b": [1, 2]}', headers=_json())
    second = h.post("/posts", key="k1", content=b'{"b":[1,2],\n "a":1}', headers=_json())
    assert is_replay(second)
    assert h.effects.counts["posts"] == 1


def test_binary_body_is_fingerprinted_byte_for_byte(serve: Serve) -> None:
    """A binary body replays when identical and is key-reused when one byte differs."""
    h = serve()
    body = bytes(range(256)) * 4
    headers = {"Content-Type": "application/octet-stream"}
    first = h.post("/binary", key="k1", content=body, headers=headers)
    assert first.content == body[::-1]
    second = h.post("/binary", key="k1", content=body, headers=headers)
    assert is_replay(second)
    assert second.content == body[::-1]
    assert_problem(
        h.post("/binary", key="k1", content=body[:-1] + b"\x00", headers=headers),
        422,
        "key-reused",
    )
    assert h.effects.counts["binary"] == 1


def test_non_json_text_body_works(serve: Serve) -> None:
    """A text body that is not JSON (even with a JSON content type) is compared as bytes."""
    h = serve()
    headers = _json()
    h.post("/posts", key="k1", content=b"{not json", headers=headers)
    assert is_replay(h.post("/posts", key="k1", content=b"{not json", headers=headers))
    assert_problem(
        h.post("/posts", key="k1", content=b"{not  json", headers=headers), 422, "key-reused"
    )


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/other", {"a": 1}), ("PATCH", "/posts", {"a": 1}), ("POST", "/posts", {"a": 2})],
    ids=["other-path", "other-method", "other-body"],
)
def test_same_key_for_a_different_request_is_422(
    serve: Serve, method: str, path: str, body: dict[str, int]
) -> None:
    """Same key on another path, method or body: 422 key-reused with both fingerprints."""
    h = serve()
    h.post("/posts", key="k1", json={"a": 1})
    doc = assert_problem(h.request(method, path, key="k1", json=body), 422, "key-reused")
    assert len(doc["stored_fingerprint"]) == len(doc["fingerprint"]) == 64
    assert doc["stored_fingerprint"] != doc["fingerprint"]
    assert h.effects.counts["posts"] == 1


def test_key_reused_status_is_configurable(serve: Serve) -> None:
    """``key_reused_status`` changes the status of the key-reused problem."""
    h = serve(key_reused_status=409)
    h.post("/posts", key="k1", json={"a": 1})
    assert_problem(h.post("/posts", key="k1", json={"a": 2}), 409, "key-reused")


def test_stored_4xx_is_replayed(serve: Serve) -> None:
    """A 4xx other than 408/429 describes the operation: it is stored and replayed."""
    h = serve()
    assert h.post("/status/404", key="k1").status_code == 404
    second = h.post("/status/404", key="k1")
    assert second.status_code == 404
    assert is_replay(second)
    assert h.effects.counts["status404"] == 1


@pytest.mark.parametrize("status", [408, 429, 500, 503])
def test_attempt_statuses_release_the_key(serve: Serve, status: int) -> None:
    """408, 429 and 5xx are not stored: the key is released and the next attempt runs."""
    h = serve()
    assert h.post(f"/status/{status}", key="k1").status_code == status
    assert records(h.store) == []
    second = h.post(f"/status/{status}", key="k1")
    assert not is_replay(second)
    assert h.effects.counts[f"status{status}"] == 2


def test_store_server_errors_option_stores_5xx(serve: Serve) -> None:
    """With ``store_server_errors=True`` (Stripe) a 5xx is stored and replayed."""
    h = serve(store_server_errors=True)
    h.post("/status/503", key="k1")
    second = h.post("/status/503", key="k1")
    assert second.status_code == 503
    assert is_replay(second)
    assert h.effects.counts["status503"] == 1


def test_handler_exception_releases_the_key(serve: Serve) -> None:
    """An unhandled exception answers 500 (no traceback), releases the key, and a retry runs."""
    h = serve()
    close = {"Connection": "close"}  # uvicorn drops the connection after an app exception
    first = h.post("/boom", key="k1", headers=close)
    assert first.status_code == 500
    assert "Traceback" not in first.text
    assert records(h.store) == []
    assert h.post("/boom", key="k1", headers=close).status_code == 500
    assert h.effects.counts["boom"] == 2


def test_oversize_request_body_is_413_and_nothing_is_claimed(serve: Serve) -> None:
    """A body over ``max_body_size`` (declared by Content-Length) is refused before claiming."""
    h = serve(max_body_size=100)
    r = h.post("/posts", key="k1", content=b"x" * 101)
    doc = assert_problem(r, 413, "body-too-large")
    assert doc["max_body_size"] == 100
    assert records(h.store) == []
    assert h.effects.counts["posts"] == 0
    assert h.post("/posts", key="k1", content=b"x" * 100).status_code == 201


def test_oversize_streamed_body_is_413(serve: Serve) -> None:
    """A chunked body without Content-Length is counted as it streams and refused too."""
    h = serve(max_body_size=100)
    r = h.post("/posts", key="k1", content=iter([b"x" * 60, b"y" * 60]))
    assert_problem(r, 413, "body-too-large")
    assert records(h.store) == []
    assert h.effects.counts["posts"] == 0


def test_streamed_body_within_limit_is_fingerprinted(serve: Serve) -> None:
    """A chunked body within the limit reaches the handler whole and replays."""
    h = serve(max_body_size=1000)
    first = h.post("/posts", key="k1", content=iter([b"a" * 60, b"b" * 60]))
    assert first.json()["body_len"] == 120
    assert is_replay(h.post("/posts", key="k1", content=b"a" * 60 + b"b" * 60))


def test_oversize_response_completes_but_cannot_be_replayed(serve: Serve) -> None:
    """A response over ``max_replay_size`` streams whole, completes the key, and a repeat gets
    replay-unavailable with the original status, never a second run."""
    h = serve(max_replay_size=1000)
    first = h.post("/big", key="k1")
    assert first.content == BIG
    second = h.post("/big", key="k1")
    assert_problem(second, 200, "replay-unavailable")
    assert is_replay(second)
    assert h.effects.counts["big"] == 1


def test_problem_answers_are_logged_once(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    """Each decision is one structured line on ``retrysafe.server`` with stable fields."""
    h = serve()
    with caplog.at_level("INFO", logger="retrysafe.server"):
        h.post("/posts", key="k1", json={})
        started = time.perf_counter()
        h.post("/posts", key="k1", json={})
        window_ms = (time.perf_counter() - started) * 1000.0
    lines = [r for r in caplog.records if r.name == "retrysafe.server"]
    assert [r.getMessage() for r in lines] == ["decision=stored", "decision=replay"]
    replay = lines[1]
    assert replay.__dict__["decision"] == "replay"
    assert replay.__dict__["method"] == "POST"
    assert replay.__dict__["path"] == "/posts"
    assert replay.__dict__["status"] == 201
    assert len(replay.__dict__["key_hash"]) == 12
    # Measured inside the request the test timed (rounded to µs): not a made-up number.
    assert 0 < replay.__dict__["duration_ms"] <= window_ms + 0.001


def _json() -> dict[str, str]:
    return {"Content-Type": "application/json"}
