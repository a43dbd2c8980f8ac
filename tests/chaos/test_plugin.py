"""The pytest plugin: registered through the pytest11 entry point, light to import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from retrysafe.chaos import ChaosProxy, EffectLedger, Fault
from retrysafe.pytest_plugin import ChaosProxyFactory

from .conftest import Upstream


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    """pytest loaded retrysafe.pytest_plugin under the entry point's name ``retrysafe``."""
    plugin = pytestconfig.pluginmanager.get_plugin("retrysafe")
    assert plugin is not None
    assert plugin.__name__ == "retrysafe.pytest_plugin"


def test_plugin_import_is_light() -> None:
    """Importing the plugin imports neither uvicorn, starlette nor the chaos proxy."""
    code = (
        "import sys, retrysafe.pytest_plugin; "
        "print(sorted(m for m in ('uvicorn', 'starlette', 'h11', 'retrysafe.chaos') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_chaos_proxy_fixture_starts_a_proxy_with_the_given_rates(
    chaos_proxy: ChaosProxyFactory, upstream: Upstream
) -> None:
    """chaos_proxy(upstream, **rates) returns a running proxy applying those rates."""
    proxy = chaos_proxy(upstream.url, error_after_commit=1.0, seed=3)
    assert isinstance(proxy, ChaosProxy)
    response = httpx.post(f"{proxy.url}/effects/op-1", timeout=2)
    assert response.status_code == 503
    assert upstream.ledger.counts() == {"op-1": 1}
    assert proxy.stats().by_fault[Fault.ERROR_AFTER_COMMIT] == 1


def test_effect_ledger_fixture_is_empty_and_in_memory(effect_ledger: EffectLedger) -> None:
    """effect_ledger is a fresh in-memory ledger."""
    assert effect_ledger.total() == 0
    assert effect_ledger.path is None
    effect_ledger.record("a")
    assert effect_ledger.counts() == {"a": 1}


def test_plugin_fixtures_work_in_a_users_test_run(tmp_path: Path) -> None:
    """A user's test suite gets both fixtures without any configuration, and proxies stop."""
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import threading

            import httpx

            def test_uses_both(chaos_proxy, effect_ledger):
                proxy = chaos_proxy("http://127.0.0.1:9", error_before_forward=1.0)
                assert httpx.get(proxy.url + "/x", timeout=2).status_code == 503
                effect_ledger.record("op")
                assert effect_ledger.count("op") == 1

            def test_no_proxy_thread_survives_teardown():
                names = [t.name for t in threading.enumerate()]
                assert not [n for n in names if n.startswith("chaos-proxy")]
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
