"""Endpoint values and their validation (bad input fails here, before anything is written).

Pure: ids, URL/secret/event-type checks, which endpoints an event goes to, which secrets
sign now.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from urllib.parse import urlsplit

from retrysafe._exceptions import ConfigurationError
from retrysafe.client._jobs import _check_url
from retrysafe.webhooks._models import WebhookEndpoint
from retrysafe.webhooks._signing import parse_secret

__all__ = [
    "ROTATION_OVERLAP",
    "active_secrets",
    "check_event_id",
    "check_event_type",
    "check_event_types",
    "check_secret",
    "check_url",
    "matches",
    "new_endpoint_id",
    "new_event_id",
    "rotated",
]

#: Seconds a replaced secret keeps signing after a rotation (default 24 h), so receivers
#: can switch to the new secret without rejecting anything.
ROTATION_OVERLAP = 24 * 3600.0

_EVENT_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_PATTERN = re.compile(r"\*|[A-Za-z0-9_.\-]{1,126}(\.\*)?")


def new_endpoint_id() -> str:
    """``ep_`` + 32 random hex digits."""
    return "ep_" + uuid.uuid4().hex


def new_event_id() -> str:
    """``msg_`` + 32 random hex digits (122 random bits, like the outbox's keys)."""
    return "msg_" + uuid.uuid4().hex


def check_url(url: object) -> str:
    """An http(s) URL with a host, no whitespace and no credentials.

    A ``user:password@`` part is refused: a receiver authenticates deliveries by their
    signature (the webhook secret), and endpoint URLs are printed by ``list`` and ``show``.

    Raises:
        ConfigurationError: anything else (``option="url"``).
    """
    checked = _check_url(url)
    parts = urlsplit(checked)
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(
            f"the endpoint URL for host {parts.hostname or ''!r} must not carry credentials "
            "(user:password@); deliveries are authenticated by their signature (the webhook "
            "secret)",
            option="url",
        )
    return checked


def check_secret(secret: object) -> str:
    """A ``whsec_`` secret of at least 24 bytes (see :func:`parse_secret`)."""
    parse_secret(secret)
    assert isinstance(secret, str)
    return secret


def check_event_id(event_id: object) -> str:
    """1–128 characters of ``A-Z a-z 0-9 _ . -`` (it travels as the ``webhook-id`` header).

    Raises:
        ConfigurationError: anything else (``option="event_id"``).
    """
    if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
        raise ConfigurationError(
            f"event id {event_id!r} must be 1–128 characters of A-Z a-z 0-9 _ . -",
            option="event_id",
        )
    return event_id


def check_event_type(event_type: object) -> str:
    """1–128 characters of ``A-Z a-z 0-9 _ . -`` (``invoice.paid``).

    Raises:
        ConfigurationError: anything else (``option="event_type"``).
    """
    if not isinstance(event_type, str) or not _EVENT_TYPE.fullmatch(event_type):
        raise ConfigurationError(
            f"event type {event_type!r} must be 1–128 characters of A-Z a-z 0-9 _ . -",
            option="event_type",
        )
    return event_type


def check_event_types(types: Iterable[str] | None) -> tuple[str, ...]:
    """Subscription patterns: exact types, ``prefix.*`` or ``*``; empty means every type.

    Raises:
        ConfigurationError: a lone string instead of a list, or a malformed pattern.
    """
    if types is None:
        return ()
    if isinstance(types, str):
        raise ConfigurationError(
            "event_types must be a list of event types, not a string", option="event_types"
        )
    out: list[str] = []
    for t in types:
        if not isinstance(t, str) or not _PATTERN.fullmatch(t):
            raise ConfigurationError(
                f"event type pattern {t!r} must be a type, prefix.* or *", option="event_types"
            )
        if t not in out:
            out.append(t)
    return tuple(out)


def matches(endpoint: WebhookEndpoint, event_type: str) -> bool:
    """Whether ``endpoint`` subscribes to ``event_type`` (enabled or not)."""
    if not endpoint.event_types:
        return True
    for pattern in endpoint.event_types:
        if pattern in ("*", event_type):
            return True
        if pattern.endswith(".*") and event_type.startswith(pattern[:-1]):
            return True
    return False


def active_secrets(endpoint: WebhookEndpoint, now: float) -> list[str]:
    """The secrets that sign at ``now``: the current one and rotated ones not yet expired."""
    return [s for s, expires in endpoint.secrets if expires is None or expires > now]


def rotated(
    endpoint: WebhookEndpoint, secret: str, *, now: float, overlap: float
) -> tuple[tuple[str, float | None], ...]:
    """The endpoint's secrets after rotating to ``secret``: the new one first, the previous
    ones signing until ``now + overlap`` (or their own earlier expiry), expired ones gone."""
    kept: list[tuple[str, float | None]] = [(secret, None)]
    for old, expires in endpoint.secrets:
        if old == secret:
            continue
        until = now + overlap if expires is None else min(expires, now + overlap)
        if until > now:
            kept.append((old, until))
    return tuple(kept)
