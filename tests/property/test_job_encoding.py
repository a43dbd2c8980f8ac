"""A job's JSON body and its minted id and key (SPEC §2), held to their rules.

``_encode_json`` encodes first and walks the payload only when something may be wrong; these
tests hold it to the walk-first rule it replaced: the same bytes for every payload accepted,
the same error (message and path) for every payload refused.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from retrysafe import ConfigurationError, PayloadError
from retrysafe.client._jobs import (
    MAX_PAYLOAD_DEPTH,
    _encode_json,
    _find_unserialisable,
    build_job,
    job_id_prefix,
    new_job_id,
    new_key,
)


def walk_first(value: Any) -> bytes:
    """The rule as it was: walk every value, then encode."""
    found = _find_unserialisable(value, "$")
    if found is not None:
        path, why = found
        raise PayloadError(f"payload cannot be serialised to JSON at {path}: {why}", path=path)
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadError(f"payload cannot be serialised to JSON: {exc}") from exc


def outcome(encode: Any, value: Any) -> tuple[str, Any]:
    try:
        return "bytes", encode(value)
    except PayloadError as exc:
        return "error", (str(exc), exc.path)


_TEXT = st.text(st.characters(blacklist_categories=()), max_size=8)  # surrogates included
_KEYS = st.one_of(_TEXT, st.integers(), st.floats(), st.booleans(), st.none())
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and infinities included
    _TEXT,
    st.sampled_from(["😀", "\\ud800", "\ud800", "\udc00x", "a\\", "\\u"]),
)
_PAYLOADS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
    ),
    max_leaves=20,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@given(_PAYLOADS)
@example({1: "a"})
@example({"a": {None: 1}})
@example([{"ok": 1}, {2.5: 1}])
@example({"t": "\ud83d\ude00"})  # a surrogate pair as two code points: still lone ones
@example({"t": "😀"})
@example({"\ud800": 1})
@example(nested(MAX_PAYLOAD_DEPTH))
@example(nested(MAX_PAYLOAD_DEPTH + 1))
@example(nested(MAX_PAYLOAD_DEPTH + 1, {1: 2}))
@example([math.nan])
@example({"set": {1}})
def test_the_body_and_the_error_are_those_of_the_walk_first_rule(value: Any) -> None:
    assert outcome(_encode_json, value) == outcome(walk_first, value)


def test_circular_and_very_deep_payloads_are_refused_like_before() -> None:
    circular: list[Any] = []
    circular.append(circular)
    deep = nested(5000)
    for value in (circular, deep):
        assert outcome(_encode_json, value) == outcome(walk_first, value)
        assert outcome(_encode_json, value)[0] == "error"


def test_minted_keys_are_uuid4_text_and_never_repeat() -> None:
    keys = [new_key() for _ in range(20_000)]
    assert len(set(keys)) == len(keys)
    for key in keys[:2000]:
        parsed = uuid.UUID(key)
        assert str(parsed) == key  # the canonical 36-character, lower-case form
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
    # 122 random bits: every hex digit outside the version and variant varies.
    for position in [i for i in range(36) if i not in (8, 13, 14, 18, 19, 23)]:
        assert len({key[position] for key in keys[:2000]}) == 16, position
    assert {key[19] for key in keys} == set("89ab")


def test_minted_job_ids_are_32_hex_digits_that_prefix_lookups_accept() -> None:
    ids = [new_job_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    assert all(job_id_prefix(i[:8]) == i[:8] for i in ids[:100])


def test_a_url_checked_once_is_checked_again_for_each_job() -> None:
    """The URL checks are cached per URL: a good URL gives the same job target each time, a
    bad one is refused each time, and something that is not a string (unhashable too) gets
    the same clear error, not the cache's TypeError."""
    first = build_job("http://Example.com:8080/a", json={}, now=0.0)
    again = build_job("http://Example.com:8080/a", json={}, now=0.0)
    assert (first.url, first.destination) == (again.url, again.destination)
    assert first.destination == "http://example.com:8080"
    assert first.id != again.id and first.key != again.key
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="credentials"):
            build_job("http://user:pw@example.com/", json={}, now=0.0)
    long_url = "http://example.com/" + "a" * 5000  # past the cached length: checked each time
    assert build_job(long_url, json={}, now=0.0).url == long_url
    with pytest.raises(ConfigurationError, match="port 0"):
        build_job("http://example.com:0/" + "a" * 5000, json={}, now=0.0)
    for bad in (["http://example.com/"], {"u": 1}, None, b"http://example.com/"):
        with pytest.raises(ConfigurationError, match="url must be a string"):
            build_job(bad, json={}, now=0.0)  # type: ignore[arg-type]
