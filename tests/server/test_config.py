"""IdempotencyConfig validation and the public door of ``retrysafe.server``."""

from __future__ import annotations

import math
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest

import retrysafe
import retrysafe.server
from retrysafe import ConfigurationError, RetrysafeWarning
from retrysafe.server import IdempotencyConfig, IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import MemoryStore


def test_defaults_follow_the_spec() -> None:
    """POST/PATCH protected, 10 s lease renewed every lease/3, 600 s max run time, 24 h
    retention, 1 MiB limits, fail closed."""
    config = IdempotencyConfig()
    assert config.protected_methods == frozenset({"POST", "PATCH"})
    assert (config.lease, config.retention) == (10.0, 86400.0)
    assert config.heartbeat == pytest.approx(10.0 / 3)
    assert config.max_run_time == 600.0
    assert config.max_body_size == config.max_replay_size == 1024 * 1024
    assert config.key_required is False
    assert config.fail_open is False
    assert config.key_reused_status == 422


def test_timedeltas_become_seconds() -> None:
    """Durations accept ``timedelta`` and are stored as float seconds."""
    config = IdempotencyConfig(lease=timedelta(seconds=90), retention=timedelta(hours=1))
    assert (config.lease_seconds, config.retention_seconds) == (90.0, 3600.0)
    assert config.lease == 90.0


@pytest.mark.parametrize(
    "options",
    [
        {"lease": 0},
        {"lease": -1.0},
        {"retention": timedelta(0)},
        {"in_progress_wait": -0.5},
        {"max_body_size": 0},
        {"max_replay_size": -5},
        {"key_reused_status": 200},
        {"protected_methods": ()},
        {"protected_methods": "POST"},
        {"protected_methods": {"FOO BAR"}},
        {"protected_methods": {"POST", ""}},
        {"lease": float("nan")},
    ],
)
def test_invalid_values_raise_configuration_error(options: dict[str, Any]) -> None:
    """Non-positive durations and sizes, odd statuses and empty method sets are refused."""
    with pytest.raises(ConfigurationError) as info:
        IdempotencyConfig(**options)
    assert info.value.option == next(iter(options))


def test_retention_shorter_than_lease_warns() -> None:
    """A retention shorter than the lease works but warns."""
    with pytest.warns(RetrysafeWarning, match="retention"):
        IdempotencyConfig(lease=120, retention=60)


def test_config_is_frozen() -> None:
    """The configuration cannot change after construction."""
    config = IdempotencyConfig()
    with pytest.raises(AttributeError):
        config.lease = 5  # type: ignore[misc]


def test_middleware_refuses_config_and_options_together() -> None:
    """Pass either ``config=`` or keyword options, not both."""
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(_asgi_app, MemoryStore(), config=IdempotencyConfig(), lease=5)


def test_middleware_refuses_unknown_options() -> None:
    """A misspelt option is a ConfigurationError, not a silent default."""
    with pytest.raises(ConfigurationError):
        WSGIIdempotencyMiddleware(_wsgi_app, MemoryStore(), leese=5)


def test_wsgi_middleware_needs_a_sync_store() -> None:
    """WSGI drives the store synchronously; an async-only store is refused."""
    with pytest.raises(ConfigurationError):
        WSGIIdempotencyMiddleware(_wsgi_app, MemoryStore().asyncio_key_store())  # type: ignore[arg-type]


def test_all_is_sorted_and_exported() -> None:
    """``__all__`` is sorted and every name exists, in retrysafe and retrysafe.server."""
    for module in (retrysafe, retrysafe.server):
        assert list(module.__all__) == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), name
    for name in ("IdempotencyConfig", "IdempotencyMiddleware", "WSGIIdempotencyMiddleware"):
        assert getattr(retrysafe, name) is getattr(retrysafe.server, name)


def test_import_retrysafe_imports_no_web_framework() -> None:
    """``import retrysafe`` never imports starlette, fastapi, flask, werkzeug, psycopg, redis."""
    code = (
        "import sys, retrysafe, retrysafe.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'starlette', 'fastapi', 'flask', 'werkzeug', 'psycopg', 'redis'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def _asgi_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    pass


def _wsgi_app(environ: Any, start_response: Any) -> list[bytes]:  # pragma: no cover
    return []


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, 1e30, True, 2.5, 1e-9, "1", None, -1, 3601, timedelta(seconds=1.5)],
)
def test_store_retry_after_must_be_whole_seconds_in_range(value: object) -> None:
    """Retry-After is sent as whole seconds: NaN, infinity, fractions, bools, strings and
    values outside 0-3600 are refused, never sent as a broken header."""
    with pytest.raises(ConfigurationError) as info:
        IdempotencyConfig(store_retry_after=value)  # type: ignore[arg-type]
    assert info.value.option == "store_retry_after"


def test_store_retry_after_takes_a_whole_second_timedelta() -> None:
    """A whole-second timedelta becomes its seconds."""
    assert IdempotencyConfig(store_retry_after=timedelta(seconds=3)).store_retry_after == 3


@pytest.mark.parametrize("value", [1e30, 366 * 86400.0])
def test_retention_longer_than_a_year_is_refused(value: float) -> None:
    """An absurd retention (Redis cannot even express 1e30 s) is a ConfigurationError."""
    with pytest.raises(ConfigurationError) as info:
        IdempotencyConfig(retention=value)
    assert info.value.option == "retention"


@pytest.mark.parametrize(
    "name", ["Content-Length", "transfer-encoding", " Connection ", "Idempotent-Replayed", "TE"]
)
def test_replay_headers_refuse_what_a_replay_writes_itself(name: str) -> None:
    """Content-Length (a replay frames its own body: a stored one came out twice),
    Idempotent-Replayed and hop-by-hop fields are never replayed from the first answer."""
    with pytest.raises(ConfigurationError) as err:
        IdempotencyConfig(replay_headers=[name])
    assert err.value.option == "replay_headers"
    assert name.strip().lower() in str(err.value)
    assert IdempotencyConfig(replay_headers=["X-Request-Cost"]).replay_headers == {
        "x-request-cost"
    }
