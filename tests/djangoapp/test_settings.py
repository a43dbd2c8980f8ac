"""Bad settings are an ImproperlyConfigured at startup, naming the option; unsupported
Django versions are refused at import, naming the range."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("django_project")


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ("django", "must be a dict"),
        ({"LEASES": 5}, "unknown option 'LEASES' (did you mean 'LEASE'?)"),
        ({"lease": 5}, "unknown option 'lease' (did you mean 'LEASE'?)"),
        ({"STORE": ""}, "['STORE']"),
        ({"STORE": 42}, "['STORE']"),
        ({"STORE": "keys.db"}, "neither 'django'"),
        ({"STORE": "django:"}, "needs a database alias"),
        ({"LEASE": "10"}, "['LEASE']: must be seconds"),
        ({"LEASE": True}, "['LEASE']: must be seconds"),
        ({"LEASE": -1}, "['LEASE']"),
        ({"LEASE": float("nan")}, "['LEASE']"),
        ({"RETENTION": 0}, "['RETENTION']"),
        ({"FAIL_OPEN": "yes"}, "['FAIL_OPEN']: must be True or False"),
        ({"TRANSACTIONAL": 1}, "['TRANSACTIONAL']: must be True or False"),
        ({"METHODS": "POST"}, "['METHODS']: must be a list"),
        ({"METHODS": []}, "['METHODS']"),
        ({"METHODS": ["PO ST"]}, "['METHODS']"),
        ({"MAX_BODY_SIZE": 1.5}, "['MAX_BODY_SIZE']: must be an integer"),
        ({"KEY_REUSED_STATUS": 200}, "['KEY_REUSED_STATUS']"),
        ({"KEY_REQUIRED": ["("]}, "['KEY_REQUIRED']: '(' is not a regular expression"),
        ({"KEY_REQUIRED": [1]}, "['KEY_REQUIRED']: patterns must be strings"),
        ({"KEY_REQUIRED": "no.such.module.fn"}, "['KEY_REQUIRED']: cannot import"),
        ({"SCOPE": "djangoapp.scopes.nothing_here"}, "['SCOPE']: cannot import"),
        ({"SCOPE": 3}, "['SCOPE']: must be a dotted path or a callable"),
        ({"HEARTBEAT": 20, "LEASE": 10}, "['HEARTBEAT']"),
        ({"STORE": "memory://"}, "['STORE']: memory:// forgets every key"),
        ({"STORE": "mysql://x/y"}, "['STORE']: 'mysql://x/y' is not a store URL"),
        ({"STORE": "django:nope"}, "['STORE']: DATABASES has no database 'nope'"),
        ({"STORE": "sqlite:///no/such/dir/k.db"}, "['STORE']: directory"),
        ({"STORE": "postgresql://u:pw@db:5432/"}, "['STORE']"),
        ({"STORE": "redis://localhost/x"}, "['STORE']"),
        ({"STORE": "sqlite:///k.db", "TRANSACTIONAL": True}, "['TRANSACTIONAL']: needs STORE"),
    ],
)
def test_bad_setting_is_improperly_configured_naming_it(raw: Any, names: str) -> None:
    """Each bad value is refused with the option's name in the message."""
    from django.core.exceptions import ImproperlyConfigured

    from retrysafe.django import load_settings

    with pytest.raises(ImproperlyConfigured) as info:
        load_settings(raw)
    assert names in str(info.value)


def test_good_settings_reach_the_engine() -> None:
    """Durations as timedelta, methods upper-cased, patterns compiled."""
    from retrysafe.django import load_settings

    got = load_settings(
        {"LEASE": timedelta(seconds=4), "METHODS": ["post"], "KEY_REQUIRED": [r"/pay/.*"]}
    )
    assert got.config.lease == 4.0
    assert got.config.protected_methods == frozenset({"POST"})
    required: Any = got.config.key_required
    assert required("POST", "/pay/1") and not required("POST", "/other")
    assert got.store == ("django", "default")


@pytest.mark.parametrize(
    ("retrysafe", "names"),
    [
        ({"STORE": "django:nope"}, "DATABASES has no database 'nope'"),
        ({"STORE": "mysql://x/y"}, "['STORE']"),
        ({"STORE": "sqlite:///no/such/dir/keys.db"}, "does not exist"),
        ({"STORE": "memory://", "TRANSACTIONAL": True}, "['TRANSACTIONAL']: needs STORE"),
    ],
)
def test_middleware_refuses_a_store_it_cannot_open_at_construction(
    retrysafe: dict[str, Any], names: str
) -> None:
    """The middleware is built when Django loads the chain (startup), and refuses then."""
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from retrysafe.django import IdempotencyMiddleware

    with override_settings(RETRYSAFE=retrysafe), pytest.raises(ImproperlyConfigured) as info:
        IdempotencyMiddleware(lambda request: None)
    assert names in str(info.value)


def test_django_store_without_the_app_installed_is_refused() -> None:
    """STORE 'django' needs the retrysafe.django app (its migration makes the tables)."""
    from django.core.exceptions import ImproperlyConfigured
    from django.test import modify_settings

    from retrysafe.django import IdempotencyMiddleware

    removed = modify_settings(INSTALLED_APPS={"remove": ["retrysafe.django"]})
    with removed, pytest.raises(ImproperlyConfigured) as info:
        IdempotencyMiddleware(lambda request: None)
    assert "add 'retrysafe.django' to INSTALLED_APPS" in str(info.value)


def test_app_ready_refuses_bad_settings_at_startup(tmp_path: Any) -> None:
    """django.setup() itself fails on a bad RETRYSAFE (before any request)."""
    from .conftest import TESTS, _env

    env = _env({"RS_SQLITE": str(tmp_path / "db.sqlite3")}, {"LEASE": "ten"})
    out = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS,
    )
    assert out.returncode != 0
    assert "ImproperlyConfigured: RETRYSAFE['LEASE']: must be seconds" in out.stderr


@pytest.mark.parametrize("found", ["4.1.13", "7.0", "3.2"])
def test_unsupported_django_version_is_refused_naming_the_range(
    found: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """retrysafe.django checks Django's version at import."""
    import importlib.metadata

    from retrysafe import ConfigurationError
    from retrysafe.django import _version

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: found if name == "django" else real(name)
    )
    with pytest.raises(ConfigurationError) as info:
        _version.check_django()
    assert f"found Django {found}" in str(info.value)
    assert ">=4.2,<7" in str(info.value)


def test_supported_django_version_passes() -> None:
    """The installed Django is in the range (the import above worked)."""
    from retrysafe.django import _version

    _version.check_django()


def test_import_retrysafe_does_not_import_django() -> None:
    """`import retrysafe` stays free of Django (STYLE: optional extras)."""
    code = "import sys, retrysafe, retrysafe.server; print('django' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_body_limit_above_djangos_upload_limit_warns() -> None:
    """MAX_BODY_SIZE above DATA_UPLOAD_MAX_MEMORY_SIZE cannot be reached: a warning says to
    raise Django's limit too."""
    from django.test import override_settings

    from retrysafe import RetrysafeWarning
    from retrysafe.django import IdempotencyMiddleware

    big = {"STORE": "django", "MAX_BODY_SIZE": 4 * 1024 * 1024}
    with override_settings(RETRYSAFE=big), pytest.warns(RetrysafeWarning, match="DATA_UPLOAD"):
        IdempotencyMiddleware(lambda request: None)
