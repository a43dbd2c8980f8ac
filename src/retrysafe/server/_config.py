"""Configuration of the idempotency middleware (SPEC §3, §4): one frozen, keyword-only value."""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from retrysafe._exceptions import ConfigurationError, RetrysafeWarning
from retrysafe._http import HOP_BY_HOP
from retrysafe.core import LeaseTiming, lease_timing, scope_from_authorization

__all__ = [
    "DEFAULT_REPLAY_HEADERS",
    "IdempotencyConfig",
    "KeyRequired",
    "ScopeFunction",
    "resolve_config",
]

# RFC 9110 §5.6.2 token: what a method name may consist of.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

#: Headers replayed with a stored response by default (SPEC §4). ``Content-Encoding`` is kept
#: too because the stored bytes cannot be read without it.
DEFAULT_REPLAY_HEADERS = frozenset(
    {"content-type", "content-encoding", "location", "etag", "cache-control"}
)

#: ``key_required(method, path) -> bool``: whether a route requires an ``Idempotency-Key``.
KeyRequired = Callable[[str, str], bool]
#: ``scope(headers) -> str``: who owns a key; ``headers`` has lower-case names.
ScopeFunction = Callable[[Mapping[str, str]], str]

#: Response fields a replay writes itself: never stored from the handler's answer.
_SET_BY_REPLAY = frozenset({"content-length", "idempotent-replayed"})

_MIB = 1024 * 1024
#: Longest accepted retention, in seconds (one year): stores turn it into absolute expiry times
#: and TTLs, and a key remembered longer than that is a typo (Stripe keeps keys 24 h).
MAX_RETENTION = 365 * 86_400.0
#: Largest accepted ``store_retry_after``, in whole seconds (one hour).
MAX_STORE_RETRY_AFTER = 3600


def _seconds(value: float | timedelta, option: str, *, allow_zero: bool = False) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigurationError(f"{option} must be seconds (float) or a timedelta", option=option)
    ok = seconds >= 0 if allow_zero else seconds > 0
    if not (math.isfinite(seconds) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"{option} must be {bound} seconds, got {value!r}", option=option)
    return float(seconds)


def _size(value: int, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{option} must be a positive number of bytes", option=option)
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class IdempotencyConfig:
    """How the idempotency middleware protects requests (SPEC §3, §4).

    Durations accept float seconds or :class:`datetime.timedelta` and are stored as float
    seconds. Sizes are bytes.

    Attributes:
        protected_methods: methods that need protection (default POST and PATCH; stored upper
            case). Other methods pass straight through.
        key_required: whether a protected request without ``Idempotency-Key`` is refused with
            400 ``missing-key``; a bool for every route or ``fn(method, path) -> bool``.
            Default False: such requests run unprotected (and are logged).
        scope: ``fn(headers) -> str`` naming who owns a key (``headers`` has lower-case names);
            default :func:`~retrysafe.core.scope_from_authorization`, so tenants never share
            keys (SPEC §2).
        lease: seconds a claim holds without renewal (default 10 s). While the handler runs
            the middleware renews the lease every ``heartbeat`` seconds, fenced by the
            request's token, so a live handler is never taken over however long it runs; the
            lease only bounds how long a claimant that stopped renewing (its process died, or
            it ran past ``max_run_time``) blocks its key before a retry may take over
            (SPEC §3 "Lease renewal"). Keep it short: it is your crash-recovery delay.
        heartbeat: seconds between lease renewals (default ``lease / 3``, so two renewals may
            fail before the lease ends); at least 0.05 s and shorter than ``lease``.
        max_run_time: seconds a handler may run before renewal stops (default 600 s): a wedged
            process then no longer holds its key forever; the lease runs out and a retry may
            take over. Measured on ``clock``. Raise it for handlers that legitimately run
            longer (long AI calls).
        retention: seconds a completed key is remembered (default 24 h, as Stripe; at most a
            year).
        max_body_size: largest request body read for fingerprinting (default 1 MiB); larger
            bodies get 413 ``body-too-large`` and nothing is claimed.
        max_replay_size: largest response body stored for replay (default 1 MiB); a larger
            response still completes the key, and a repeat gets ``replay-unavailable``.
        replay_headers: extra response header names replayed besides Content-Type, Location,
            ETag, Cache-Control (and Content-Encoding); case-insensitive. Not Content-Length,
            Idempotent-Replayed (the replay sets them) or a hop-by-hop field.
        store_server_errors: store 5xx answers too (Stripe's behaviour) instead of releasing
            the key; for handlers that cannot safely run again (default False).
        key_reused_status: status of the ``key-reused`` problem (default 422, IETF draft §2.7).
        in_progress_wait: seconds a repeat waits for a running original to finish and then
            replays it, instead of answering 409 at once (default 0: answer 409 at once).
            Measured on the monotonic clock (real time), not on ``clock``; the store is polled
            every 20 ms at first, backing off to 250 ms.
        fail_open: when the store fails, run the handler unprotected instead of answering 503
            ``store-unavailable`` (default False: fail closed, SPEC §3).
        store_retry_after: whole seconds advertised in ``Retry-After`` on 503 (default 1;
            0–3600, an ``int`` or a whole-second ``timedelta``).
        clock: returns Unix time in seconds (default :func:`time.time`); inject one in tests.
        telemetry: a :class:`~retrysafe.observability.Prometheus`, an
            :class:`~retrysafe.observability.OpenTelemetry`, or a list of both: every decision,
            lease renewal and store operation is reported to it (docs/observability.md).
            Default None: nothing is measured.

    Raises:
        ConfigurationError: a duration or size that is not positive or not finite, a lease
            over a day or a ``max_run_time`` over a week, a heartbeat not shorter than the
            lease (see :func:`~retrysafe.core.lease_timing`), an empty method set, a status
            outside 400–599.

    Warns:
        RetrysafeWarning: ``retention`` shorter than ``lease`` or ``max_run_time`` (a key could
            be forgotten while its first attempt still runs); a heartbeat longer than half the
            lease.
    """

    protected_methods: Collection[str] = frozenset({"POST", "PATCH"})
    key_required: bool | KeyRequired = False
    scope: ScopeFunction = scope_from_authorization
    lease: float | timedelta = 10.0
    heartbeat: float | timedelta | None = None
    max_run_time: float | timedelta = 600.0
    retention: float | timedelta = 24 * 3600.0
    max_body_size: int = _MIB
    max_replay_size: int = _MIB
    replay_headers: Collection[str] = ()
    store_server_errors: bool = False
    key_reused_status: int = 422
    in_progress_wait: float | timedelta = 0.0
    fail_open: bool = False
    store_retry_after: int | timedelta = 1
    clock: Callable[[], float] = time.time
    telemetry: Any = None

    def __post_init__(self) -> None:
        from retrysafe.observability._telemetry import telemetry_of

        object.__setattr__(self, "telemetry", telemetry_of(self.telemetry))
        if isinstance(self.protected_methods, str):
            raise ConfigurationError(
                "protected_methods must be a collection of method names, not a string",
                option="protected_methods",
            )
        methods = frozenset(str(m).upper() for m in self.protected_methods)
        bad = sorted(m for m in methods if not _TOKEN.fullmatch(m))
        if bad:
            raise ConfigurationError(
                f"protected_methods: {bad[0]!r} is not an HTTP method name (RFC 9110 token)",
                option="protected_methods",
            )
        if not methods:
            raise ConfigurationError(
                "protected_methods must name at least one method", option="protected_methods"
            )
        object.__setattr__(self, "protected_methods", methods)
        if isinstance(self.replay_headers, str):
            raise ConfigurationError(
                "replay_headers must be a collection of header names, not a string",
                option="replay_headers",
            )
        names = frozenset(h.strip().lower() for h in self.replay_headers)
        framing = sorted(
            n for n in names if n in _SET_BY_REPLAY or n.encode("latin-1", "replace") in HOP_BY_HOP
        )
        if framing:
            raise ConfigurationError(
                f"replay_headers: {', '.join(framing)} cannot be replayed: a replay frames its "
                "own body (Content-Length) and says Idempotent-Replayed itself, and hop-by-hop "
                "fields belong to one connection (RFC 9110 §7.6.1)",
                option="replay_headers",
            )
        object.__setattr__(self, "replay_headers", names)
        timing = lease_timing(
            self.lease, heartbeat=self.heartbeat, max_run_time=self.max_run_time
        )
        lease = timing.lease
        retention = _seconds(self.retention, "retention")
        if retention > MAX_RETENTION:
            raise ConfigurationError(
                f"retention must be at most {MAX_RETENTION:g} seconds (a year), got "
                f"{self.retention!r}",
                option="retention",
            )
        object.__setattr__(self, "lease", lease)
        object.__setattr__(self, "heartbeat", timing.heartbeat)
        object.__setattr__(self, "max_run_time", timing.max_run_time)
        object.__setattr__(self, "retention", retention)
        object.__setattr__(
            self,
            "in_progress_wait",
            _seconds(self.in_progress_wait, "in_progress_wait", allow_zero=True),
        )
        _size(self.max_body_size, "max_body_size")
        _size(self.max_replay_size, "max_replay_size")
        if not 400 <= self.key_reused_status <= 599:
            raise ConfigurationError(
                "key_reused_status must be a 4xx or 5xx status", option="key_reused_status"
            )
        retry_after: object = self.store_retry_after
        if isinstance(retry_after, timedelta):
            total = retry_after.total_seconds()
            retry_after = int(total) if total == int(total) else total
        if (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, int)
            or not 0 <= retry_after <= MAX_STORE_RETRY_AFTER
        ):
            raise ConfigurationError(
                "store_retry_after must be whole seconds from 0 to "
                f"{MAX_STORE_RETRY_AFTER} (it is sent as Retry-After), got "
                f"{self.store_retry_after!r}",
                option="store_retry_after",
            )
        object.__setattr__(self, "store_retry_after", retry_after)
        if not (callable(self.key_required) or isinstance(self.key_required, bool)):
            raise ConfigurationError(
                "key_required must be a bool or fn(method, path) -> bool", option="key_required"
            )
        longest = max(lease, timing.max_run_time)
        if retention < longest:
            warnings.warn(
                f"retention ({retention} s) is shorter than lease or max_run_time "
                f"({longest} s): a key can be forgotten while its first attempt still runs, "
                "and a retry would run again",
                RetrysafeWarning,
                stacklevel=3,
            )

    @property
    def lease_seconds(self) -> float:
        """``lease`` as float seconds."""
        return _seconds(self.lease, "lease")

    @property
    def store_retry_after_seconds(self) -> int:
        """``store_retry_after`` as whole seconds."""
        return int(self.store_retry_after)  # type: ignore[arg-type]

    @property
    def lease_timing(self) -> LeaseTiming:
        """``lease``, ``heartbeat`` and ``max_run_time`` as one validated value."""
        return LeaseTiming(
            float(self.lease),  # type: ignore[arg-type]
            float(self.heartbeat),  # type: ignore[arg-type]
            float(self.max_run_time),  # type: ignore[arg-type]
        )

    @property
    def retention_seconds(self) -> float:
        """``retention`` as float seconds."""
        return _seconds(self.retention, "retention")

    @property
    def in_progress_wait_seconds(self) -> float:
        """``in_progress_wait`` as float seconds."""
        return _seconds(self.in_progress_wait, "in_progress_wait", allow_zero=True)


def resolve_config(
    config: IdempotencyConfig | None, options: Mapping[str, object]
) -> IdempotencyConfig:
    """The middleware's configuration: ``config``, or one built from keyword ``options``.

    Raises:
        ConfigurationError: both given, or an unknown option name.
    """
    if config is not None:
        if options:
            raise ConfigurationError(
                f"pass either config= or options ({', '.join(sorted(options))}), not both",
                option="config",
            )
        return config
    try:
        return IdempotencyConfig(**options)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigurationError(f"unknown idempotency option: {exc}", option="config") from exc
