"""Call keys for agent tool calls (SPEC §2, §7). Pure functions: no I/O, no clock.

A logical call is identified by its run, its tool, and either its step plus the canonical JSON
of its bound arguments, or an explicit call id. Binding with :func:`inspect.signature` makes
``f(1, b=2)`` and ``f(a=1, b=2)`` the same call.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Mapping
from typing import Any

from retrysafe._exceptions import ConfigurationError, InvalidKeyError, PayloadError
from retrysafe.core import parse_key

__all__ = [
    "KEY_PREFIX",
    "arguments_hash",
    "bind_arguments",
    "call_key",
    "canonical_json",
    "check_id",
    "signature_hash",
]

#: Every agent call key starts with it; the rest is 64 hex digits (SPEC §2: ≤ 255 VCHAR).
KEY_PREFIX = "agent-"


def _plain(value: Any, path: str) -> Any:
    """``value`` as plain JSON types, or :class:`PayloadError` naming ``path``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PayloadError(
                f"{path} holds a lone surrogate ({exc.object[exc.start:exc.end]!r} at "
                f"{exc.start}), which UTF-8 JSON cannot carry",
                path=path,
            ) from None
        return value
    if isinstance(value, int):
        try:
            str(value)  # beyond sys.get_int_max_str_digits() JSON cannot write it either
        except ValueError:
            raise PayloadError(
                f"{path} is an integer of about {int(value.bit_length() * 0.30103)} digits, "
                "more than JSON text may carry here",
                path=path,
            ) from None
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PayloadError(f"{path} is {value!r}, which JSON cannot represent", path=path)
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise PayloadError(
                    f"{path} has a non-string key {k!r}; JSON object keys are strings",
                    path=path,
                )
            _plain(k, f"{path} key {k!r}")  # a key is text too (a lone surrogate fails)
            out[k] = _plain(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise PayloadError(
        f"{path} is a {type(value).__name__}, which is not JSON-serialisable", path=path
    )


def check_id(value: object, option: str) -> str:
    """Check a run id or call id: the idempotency-key rule, 1–255 visible ASCII (SPEC §2).

    Returns:
        ``value`` unchanged.

    Raises:
        ConfigurationError: ``value`` is not such a string (``option`` names which id); the
            message quotes the value with ``repr`` so a newline or space shows.
    """
    if not isinstance(value, str):
        raise ConfigurationError(
            f"{option} must be a string, not {type(value).__name__}", option=option
        )
    try:
        parsed = parse_key(value)
    except InvalidKeyError as exc:
        raise ConfigurationError(
            f"{option} {value[:300]!r} is not valid: {exc.reason}; ids are 1-255 visible "
            "ASCII characters (no spaces or control characters)",
            option=option,
        ) from exc
    if parsed != value:  # the quoted structured-field form, or surrounding blanks
        raise ConfigurationError(
            f"{option} {value[:300]!r} is not valid: ids are 1-255 visible ASCII characters "
            "(no spaces, control characters or surrounding quotes)",
            option=option,
        )
    return value


def canonical_json(value: Any, *, path: str = "$") -> str:
    """Canonical JSON text: sorted keys, no whitespace, UTF-8 kept, tuples as lists.

    Raises:
        PayloadError: a value is not JSON-serialisable; ``path`` says where (``$.items[2]``).
    """
    return json.dumps(
        _plain(value, path), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def bind_arguments(
    signature: inspect.Signature, tool: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call's arguments to ``signature`` by name, defaults applied.

    Returns:
        ``{parameter: value}`` with ``*args`` as a list and ``**kwargs`` as a dict, checked to be
        JSON-serialisable.

    Raises:
        TypeError: the arguments do not fit the signature (as calling the function would).
        PayloadError: an argument is not JSON-serialisable; the message names the argument
            and ``path`` is ``$.<argument>…``.
    """
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        try:
            out[name] = _plain(value, f"$.{name}")
            json.dumps(out[name])  # nesting too deep for the encoder fails here, not later
        except PayloadError as exc:
            raise PayloadError(
                f"argument {name!r} of tool {tool!r} cannot be recorded: {exc}", path=exc.path
            ) from None
        except RecursionError:
            raise PayloadError(
                f"argument {name!r} of tool {tool!r} cannot be recorded: it contains itself "
                "or is nested too deeply for JSON",
                path=f"$.{name}",
            ) from None
    return out


def arguments_hash(arguments: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of bound arguments."""
    return hashlib.sha256(canonical_json(arguments).encode("utf-8")).hexdigest()


def signature_hash(signature: inspect.Signature) -> str:
    """A short hash of a tool's parameters: names, kinds and defaults (annotations ignored).

    Two runs of the same tool must bind the same call to the same arguments; a change here
    means they might not (:class:`~retrysafe.ToolSignatureError`).
    """
    parts = []
    for p in signature.parameters.values():
        if p.default is inspect.Parameter.empty:
            default = "-"
        else:
            try:
                default = canonical_json(p.default)
            except PayloadError:
                default = type(p.default).__qualname__
        parts.append([p.name, p.kind.name, default])
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()[:16]


def call_key(
    run_id: str,
    tool: str,
    *,
    step: int | None,
    arguments_digest: str | None = None,
    call_id: str | None = None,
) -> str:
    """The idempotency key of one logical call: ``agent-`` + 64 hex digits.

    Args:
        run_id: the agent run.
        tool: the tool's name.
        step: the step the call belongs to (None: the call is the same in every step).
        arguments_digest: :func:`arguments_hash` of the bound arguments.
        call_id: an explicit call id that the application keeps stable across retries and
            resumes, e.g. derived from its own domain object (an order id, a ticket's external
            reference); never an id the model mints per turn, since some models issue a new
            tool-call id every turn, which would make one logical call two (SPEC §7). When
            given it replaces ``tool``, ``step`` and the arguments: one id names one call in the
            run, so reusing it for another tool or other arguments finds the recorded call (and
            is refused by :class:`~retrysafe.agents.CallIdReusedError`) instead of silently
            making a new one.
    """
    h = hashlib.sha256()
    if call_id is not None:
        parts = ["id", run_id, call_id]
    else:
        parts = ["args", run_id, tool, "*" if step is None else str(step), arguments_digest or ""]
    for part in parts:
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return KEY_PREFIX + h.hexdigest()
