"""retrysafe.chaos has one public door with an honest, sorted ``__all__``."""

from __future__ import annotations

import subprocess
import sys

import retrysafe
import retrysafe.chaos


def test_chaos_all_is_sorted_and_every_name_exists() -> None:
    """Every name in retrysafe.chaos.__all__ resolves; sorted as ruff does (CONSTANTS first)."""
    names = retrysafe.chaos.__all__
    assert names == sorted(names, key=lambda name: (not name.isupper(), name))
    for name in names:
        assert getattr(retrysafe.chaos, name) is not None


def test_top_level_exports_chaos_proxy_and_effect_ledger_lazily() -> None:
    """retrysafe.ChaosProxy and retrysafe.EffectLedger exist, but import retrysafe loads no h11."""
    assert retrysafe.ChaosProxy is retrysafe.chaos.ChaosProxy
    assert retrysafe.EffectLedger is retrysafe.chaos.EffectLedger
    code = "import sys, retrysafe; print('h11' in sys.modules, 'retrysafe.chaos' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
