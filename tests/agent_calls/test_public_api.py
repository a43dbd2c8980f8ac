"""The public door of retrysafe.agents, and lazy loading from ``retrysafe``."""

from __future__ import annotations

import subprocess
import sys

import retrysafe
import retrysafe.agents


def test_top_level_agent_names_are_the_agents_objects() -> None:
    """The agent names ``retrysafe`` exports lazily are retrysafe.agents' own objects (its
    ``__all__`` against the docs: tests/api/test_public_api.py)."""
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
