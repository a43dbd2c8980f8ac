"""retrysafe.chaos's public door loads lazily from ``retrysafe`` (its ``__all__`` against the
docs: tests/api/test_public_api.py)."""

from __future__ import annotations

import subprocess
import sys

import retrysafe
import retrysafe.chaos


def test_top_level_exports_chaos_proxy_and_effect_ledger_lazily() -> None:
    """retrysafe.ChaosProxy and retrysafe.EffectLedger exist, but import retrysafe loads no h11."""
    assert retrysafe.ChaosProxy is retrysafe.chaos.ChaosProxy
    assert retrysafe.EffectLedger is retrysafe.chaos.EffectLedger
    code = "import sys, retrysafe; print('h11' in sys.modules, 'retrysafe.chaos' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
