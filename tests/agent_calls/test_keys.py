"""Call keys: derived from run, tool, step and canonical arguments (or an explicit call id)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from retrysafe import PayloadError
from retrysafe.agents import arguments_hash, bind_arguments, call_key, signature_hash
from retrysafe.core import parse_key


def create(title: str, priority: int = 2, *tags: str, **extra: Any) -> None:
    """A tool-shaped function."""


SIG = inspect.signature(create)


def _digest(*args: Any, **kwargs: Any) -> str:
    return arguments_hash(bind_arguments(SIG, "create", args, kwargs))


def test_positional_and_keyword_arguments_give_the_same_hash() -> None:
    """``f("a", 2)``, ``f(title="a", priority=2)`` and ``f("a")`` (default) are one call."""
    assert _digest("a", 2) == _digest(title="a", priority=2) == _digest("a")


def test_other_arguments_give_another_hash() -> None:
    """A different argument value is a different logical call."""
    assert _digest("a") != _digest("b")
    assert _digest("a", 2, "x") != _digest("a", 2, "y")


def test_key_is_a_valid_idempotency_key_and_depends_on_every_part() -> None:
    """Keys are visible ASCII ≤ 255 (SPEC §2) and change with run, tool, step and arguments."""
    d = _digest("a")
    key = call_key("run-1", "create", step=1, arguments_digest=d)
    assert parse_key(key) == key and key.startswith("agent-")
    others = {
        call_key("run-2", "create", step=1, arguments_digest=d),
        call_key("run-1", "other", step=1, arguments_digest=d),
        call_key("run-1", "create", step=2, arguments_digest=d),
        call_key("run-1", "create", step=1, arguments_digest=_digest("b")),
        call_key("run-1", "create", step=None, arguments_digest=d),
    }
    assert key not in others and len(others) == 5
    assert key == call_key("run-1", "create", step=1, arguments_digest=d)


def test_explicit_call_id_replaces_step_and_arguments() -> None:
    """With a call id, the key ignores the step and the arguments."""
    a = call_key("r", "create", step=1, arguments_digest=_digest("a"), call_id="tc_1")
    b = call_key("r", "create", step=7, arguments_digest=_digest("b"), call_id="tc_1")
    assert a == b != call_key("r", "create", step=1, call_id="tc_2")


def test_call_id_names_one_call_whatever_the_tool() -> None:
    """A call id's key leaves out the tool, so its reuse by another tool finds the record."""
    a = call_key("r", "create", step=1, call_id="tc_1")
    assert a == call_key("r", "delete", step=1, call_id="tc_1")
    assert a != call_key("r2", "create", step=1, call_id="tc_1")


@pytest.mark.parametrize(
    ("args", "path"),
    [
        ((object(),), "$.title"),
        (("a", 1, "ok", {1, 2}), "$.tags[1]"),
        (("a", float("nan")), "$.priority"),
    ],
)
def test_non_serialisable_argument_is_named(args: tuple[Any, ...], path: str) -> None:
    """A non-JSON argument raises PayloadError naming the argument and where inside it."""
    with pytest.raises(PayloadError) as err:
        bind_arguments(SIG, "create", args, {})
    assert err.value.path == path
    assert repr(path.split(".")[1].split("[")[0]) in str(err.value)


def test_signature_hash_changes_with_parameters_not_annotations() -> None:
    """Renaming a parameter or changing a default changes the signature hash."""

    def v1(title: str, priority: int = 2) -> None: ...
    def v1_untyped(title, priority=2):  # type: ignore[no-untyped-def]
        ...
    def v2(name: str, priority: int = 2) -> None: ...
    def v3(title: str, priority: int = 3) -> None: ...

    h = signature_hash(inspect.signature(v1))
    assert h == signature_hash(inspect.signature(v1_untyped))
    assert h != signature_hash(inspect.signature(v2))
    assert h != signature_hash(inspect.signature(v3))


def _nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> list[object]:
    value: list[object] = []
    value.append(value)
    return value


@pytest.mark.parametrize(
    ("value", "path", "says"),
    [
        (_nested(5000), "$.d", "nested too deeply"),
        (_cycle(), "$.d", "contains itself"),
        (10**5000, "$.d", "integer of about 5000 digits"),
        ("\ud800", "$.d", "lone surrogate"),
        ({"a": ["ok", "\udfff"]}, "$.d.a[1]", "lone surrogate"),
        ({"a": {"\ud800x": 1}}, r"$.d.a key '\ud800x'", "lone surrogate"),
    ],
    ids=["deep", "cycle", "huge-int", "surrogate", "nested-surrogate", "surrogate-key"],
)
def test_arguments_json_cannot_carry_are_a_payload_error_naming_them(
    value: object, path: str, says: str
) -> None:
    """Cycles, nesting beyond the encoder, integers beyond Python's str limit and lone
    surrogates are refused as PayloadError with the argument's path (never RecursionError,
    ValueError or UnicodeEncodeError from deep inside)."""

    def w(d: object) -> None: ...

    with pytest.raises(PayloadError) as info:
        bind_arguments(inspect.signature(w), "w", (value,), {})
    assert info.value.path == path
    assert says in str(info.value) and "argument 'd' of tool 'w'" in str(info.value)
