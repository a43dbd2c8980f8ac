"""``retrysafe proof``: the chaos matrix, naive beside protected, published (SPEC §8).

:func:`run_proof` runs the scenarios of :data:`SCENARIOS` on SQLite or PostgreSQL and returns a
:class:`ProofResult`; :func:`write_outputs` writes ``proof.json``, ``proof.md`` and the chart.
"""

from retrysafe.proof._backend import ProofError
from retrysafe.proof._output import (
    CHART_HINT,
    MissingExtraError,
    Written,
    render_chart,
    render_markdown,
    write_outputs,
)
from retrysafe.proof._run import (
    CLIENTS,
    MAX_JOBS,
    ProofOptions,
    ProofProgress,
    ProofResult,
    ProofStoppedError,
    run_proof,
)
from retrysafe.proof._scenarios import SCENARIOS, Event, Scenario, scenario_names, select_scenarios

__all__ = [
    "CHART_HINT",
    "CLIENTS",
    "MAX_JOBS",
    "SCENARIOS",
    "Event",
    "MissingExtraError",
    "ProofError",
    "ProofOptions",
    "ProofProgress",
    "ProofResult",
    "ProofStoppedError",
    "Scenario",
    "Written",
    "render_chart",
    "render_markdown",
    "run_proof",
    "scenario_names",
    "select_scenarios",
    "write_outputs",
]
