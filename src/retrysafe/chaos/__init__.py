"""Proof that retries are safe (SPEC §8): a fault-injecting HTTP proxy, an effect ledger and a
report comparing what clients believe with what really happened.

Put :class:`ChaosProxy` in front of any HTTP API (``retrysafe chaos proxy`` on the command line),
count effects on the server side with :class:`EffectLedger`, and compare with
:func:`build_report`. See ``docs/chaos.md``.
"""

from retrysafe.chaos._faults import (
    EXCLUSIVE_FAULTS,
    Fault,
    FaultChoice,
    FaultRates,
    choose_fault,
)
from retrysafe.chaos._ledger import Effect, EffectLedger
from retrysafe.chaos._proxy import ChaosProxy, Outcome, ProxyStats
from retrysafe.chaos._report import (
    BeliefState,
    ClientBelief,
    Report,
    build_report,
    percentile,
    print_reports,
    render_reports,
)

__all__ = [
    "EXCLUSIVE_FAULTS",
    "BeliefState",
    "ChaosProxy",
    "ClientBelief",
    "Effect",
    "EffectLedger",
    "Fault",
    "FaultChoice",
    "FaultRates",
    "Outcome",
    "ProxyStats",
    "Report",
    "build_report",
    "choose_fault",
    "percentile",
    "print_reports",
    "render_reports",
]
