"""Step budgets (SPEC §7): logical calls per run and attempts per call. Pure functions.

The store only counts and records (:meth:`~retrysafe.agents.AgentStore.claim_agent_call`
counts a run's calls inside its claim and asks the run's step budget whether the next one may
run); whether a count exhausts a budget, and what the refusal says, is decided here, once.
"""

from __future__ import annotations

from retrysafe._exceptions import ConfigurationError
from retrysafe.agents._models import StepBudget

__all__ = ["attempts_refusal", "check_budget", "step_budget", "steps_refusal"]


def check_budget(name: str, value: int | None) -> None:
    """Raise ConfigurationError (naming ``name``) unless ``value`` is None or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"{name} must be a positive integer or None", option=name)


def steps_refusal(used: int, max_steps: int | None) -> str | None:
    """Why a run that recorded ``used`` logical calls may not record another, or None.

    Args:
        used: the run's logical calls so far (refusals are not calls).
        max_steps: the run's step budget (None: unlimited).
    """
    if max_steps is not None and used >= max_steps:
        return f"step budget exhausted: {used} of {max_steps} logical calls used"
    return None


def step_budget(max_steps: int | None) -> StepBudget | None:
    """The step budget a run's claims hand the store (None when unlimited: nothing is
    counted)."""
    if max_steps is None:
        return None
    limit = max_steps

    def refusal(used: int) -> str | None:
        return steps_refusal(used, limit)

    return refusal


def attempts_refusal(used: int, max_attempts: int | None) -> str | None:
    """Why a call that made ``used`` attempts (over every process) may not make another, or
    None (``max_attempts`` None: unlimited)."""
    if max_attempts is not None and used >= max_attempts:
        return f"attempt budget exhausted: {used} of {max_attempts}"
    return None
