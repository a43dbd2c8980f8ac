"""The public door of retrysafe.agents, and lazy loading from ``retrysafe``."""

from __future__ import annotations

import subprocess
import sys

import retrysafe
import retrysafe.agents


def test_all_is_sorted_and_honest() -> None:
    """``__all__`` is sorted and every name exists; top-level agent names are the same objects."""
    names = retrysafe.agents.__all__
    assert list(names) == sorted(names)
    for name in names:
        assert hasattr(retrysafe.agents, name), name
    for name in ("AgentRun", "BudgetExceededError", "OutcomeUnknownError", "start_run"):
        assert getattr(retrysafe, name) is getattr(retrysafe.agents, name)


def test_import_retrysafe_does_not_load_agents() -> None:
    """``import retrysafe`` loads the agents package only when one of its names is used."""
    code = (
        "import sys, retrysafe; a = 'retrysafe.agents' in sys.modules; "
        "retrysafe.start_run; print(a, 'retrysafe.agents' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
