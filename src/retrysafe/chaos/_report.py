"""Compare what each client believes with what the effect ledger saw (SPEC §8).

:func:`build_report` is pure: it takes the clients' beliefs and the ledger's counts and returns
a :class:`Report`. :func:`render_reports` lays several reports side by side (``naive`` vs
``retrysafe``) for a terminal.

Definitions (also in ``docs/chaos.md``):

operations
    distinct operation ids, from the beliefs and the ledger together.
effects
    effects the ledger recorded for those operations.
duplicates
    effects beyond the first, per operation (``sum(max(0, n - 1))``);
    ``duplicated_operations`` counts operations with more than one effect.
lost
    operations the client believes SUCCEEDED that have no effect, plus operations with no
    terminal state (still PENDING, or unknown to the client altogether).
unknown
    operations the client ended with UNKNOWN (an honest "I don't know"; not lost).
reconciled
    operations whose terminal state came from reconciliation (re-sending with the same key).
p50 / p95
    nearest-rank percentiles of the seconds from creation to the terminal state, over the
    operations that reached one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "BeliefState",
    "ClientBelief",
    "Report",
    "build_report",
    "percentile",
    "print_reports",
    "render_reports",
]


class BeliefState(str, enum.Enum):
    """What the client believes happened to one operation (job states of SPEC §5)."""

    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    FAILED = "failed"
    PENDING = "pending"

    @property
    def terminal(self) -> bool:
        """Whether the client stopped working on the operation."""
        return self is not BeliefState.PENDING


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientBelief:
    """One client's final view of one logical operation.

    Attributes:
        operation_id: the logical operation, as the server's ledger records it.
        state: what the client believes (a :class:`BeliefState` or its value, e.g.
            ``"succeeded"``).
        reconciled: the terminal state came from reconciliation of an UNKNOWN operation.
        seconds_to_terminal: seconds from the operation's creation to its terminal state;
            None when it has none.
    """

    operation_id: str
    state: BeliefState
    reconciled: bool = False
    seconds_to_terminal: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", BeliefState(self.state))


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile: the ``ceil(p/100 · n)``-th smallest value; None if empty.

    ``percentile(range(1, 101), 95) == 95``.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The outcome of one run: beliefs against effects. See the module docstring."""

    operations: int
    effects: int
    duplicates: int
    duplicated_operations: int
    lost: int
    unknown: int
    reconciled: int
    succeeded: int
    rejected: int
    failed: int
    failed_with_effect: int
    p50_seconds: float | None
    p95_seconds: float | None

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-serialisable dict (for ``--json``)."""
        return asdict(self)


def build_report(beliefs: Iterable[ClientBelief], ledger_counts: Mapping[str, int]) -> Report:
    """Compare the clients' beliefs with the ledger's counts.

    Args:
        beliefs: one :class:`ClientBelief` per logical operation the client created.
        ledger_counts: ``{operation_id: effects}``, e.g. :meth:`EffectLedger.counts`.
            Operations the ledger has but no client knows count as operations without a
            terminal state, i.e. lost.

    Returns:
        The :class:`Report`.

    Raises:
        ValueError: the same operation id appears in two beliefs, or a count is negative.
    """
    by_id: dict[str, ClientBelief] = {}
    for given in beliefs:
        if given.operation_id in by_id:
            raise ValueError(f"operation {given.operation_id!r} has two beliefs")
        by_id[given.operation_id] = given
    for op, n in ledger_counts.items():
        if n < 0:
            raise ValueError(f"operation {op!r} has a negative effect count {n}")
    operations = set(by_id) | {op for op, n in ledger_counts.items() if n > 0}

    effects = duplicates = duplicated = lost = 0
    states = dict.fromkeys(BeliefState, 0)
    failed_with_effect = reconciled = 0
    times: list[float] = []
    for op in operations:
        n = ledger_counts.get(op, 0)
        effects += n
        duplicates += max(0, n - 1)
        duplicated += n > 1
        belief = by_id.get(op)
        if belief is None or not belief.state.terminal:
            lost += 1
            continue
        states[belief.state] += 1
        reconciled += belief.reconciled
        if belief.state is BeliefState.SUCCEEDED and n == 0:
            lost += 1
        if belief.state in (BeliefState.FAILED, BeliefState.REJECTED) and n > 0:
            failed_with_effect += 1
        if belief.seconds_to_terminal is not None:
            times.append(belief.seconds_to_terminal)

    return Report(
        operations=len(operations),
        effects=effects,
        duplicates=duplicates,
        duplicated_operations=duplicated,
        lost=lost,
        unknown=states[BeliefState.UNKNOWN],
        reconciled=reconciled,
        succeeded=states[BeliefState.SUCCEEDED],
        rejected=states[BeliefState.REJECTED],
        failed=states[BeliefState.FAILED],
        failed_with_effect=failed_with_effect,
        p50_seconds=percentile(times, 50),
        p95_seconds=percentile(times, 95),
    )


_ROWS: tuple[tuple[str, str], ...] = (
    ("operations", "operations"),
    ("effects", "effects"),
    ("duplicates", "duplicate effects"),
    ("duplicated_operations", "operations with >1 effect"),
    ("lost", "lost"),
    ("unknown", "unknown"),
    ("reconciled", "reconciled"),
    ("succeeded", "succeeded"),
    ("rejected", "rejected"),
    ("failed", "failed"),
    ("failed_with_effect", "failed, yet took effect"),
    ("p50_seconds", "p50 to terminal"),
    ("p95_seconds", "p95 to terminal"),
)
# Rows that must be zero for a correct run (SPEC §8); non-zero values show in red.
_MUST_BE_ZERO = frozenset({"duplicates", "duplicated_operations", "lost", "failed_with_effect"})


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f} s"
    if name in _MUST_BE_ZERO and value:
        return f"[bold red]{value}[/]"
    return str(value)


def render_reports(reports: Mapping[str, Report], *, title: str | None = None) -> Table:
    """A rich table with one column per report, in ``reports``' order.

    Args:
        reports: ``{column title: report}``, e.g. ``{"naive": r1, "retrysafe": r2}``.
        title: optional table title.
    """
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for name in reports:
        table.add_column(name, justify="right")
    for field_name, label in _ROWS:
        table.add_row(
            label,
            *(_cell(field_name, getattr(report, field_name)) for report in reports.values()),
        )
    return table


def print_reports(
    reports: Mapping[str, Report], *, title: str | None = None, console: Console | None = None
) -> None:
    """Print :func:`render_reports` to ``console`` (default: a new stdout console)."""
    if console is None:
        from rich.console import Console

        console = Console()
    console.print(render_reports(reports, title=title))
