"""build_report compares what clients believe with what the ledger saw (SPEC §8)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from retrysafe.chaos import (
    BeliefState,
    ClientBelief,
    Report,
    build_report,
    percentile,
    print_reports,
)

S, R, U, F, P = (
    BeliefState.SUCCEEDED,
    BeliefState.REJECTED,
    BeliefState.UNKNOWN,
    BeliefState.FAILED,
    BeliefState.PENDING,
)


def belief(op: str, state: BeliefState, seconds: float | None = 1.0, **kw: bool) -> ClientBelief:
    return ClientBelief(operation_id=op, state=state, seconds_to_terminal=seconds, **kw)


def test_clean_run_has_no_duplicates_and_nothing_lost() -> None:
    """One effect per succeeded operation: zero duplicates, zero lost."""
    report = build_report([belief("a", S), belief("b", S)], {"a": 1, "b": 1})
    assert (report.operations, report.effects, report.succeeded) == (2, 2, 2)
    assert (report.duplicates, report.duplicated_operations, report.lost) == (0, 0, 0)


def test_duplicates_count_extra_effects_and_duplicated_operations() -> None:
    """Three effects for one operation are two duplicates on one duplicated operation."""
    report = build_report(
        [belief("a", S), belief("b", S), belief("c", S)], {"a": 3, "b": 2, "c": 1}
    )
    assert report.effects == 6
    assert report.duplicates == 3
    assert report.duplicated_operations == 2


def test_succeeded_without_effect_is_lost() -> None:
    """A client that believes SUCCEEDED while the ledger has no effect lost the operation."""
    report = build_report([belief("a", S), belief("b", S)], {"b": 1})
    assert report.lost == 1


def test_no_terminal_state_is_lost() -> None:
    """A PENDING operation, or one the client does not know at all, is lost."""
    report = build_report([belief("a", P, None), belief("b", S)], {"b": 1, "ghost": 1})
    assert report.operations == 3
    assert report.lost == 2
    assert report.effects == 2


def test_unknown_is_counted_apart_and_not_lost() -> None:
    """UNKNOWN is an honest 'I don't know': counted as unknown, not as lost."""
    report = build_report([belief("a", U), belief("b", U)], {"a": 1})
    assert (report.unknown, report.lost) == (2, 0)


def test_reconciled_counts_operations_resolved_by_reconciliation() -> None:
    """Operations whose terminal state came from reconciliation are counted as reconciled."""
    beliefs = [belief("a", S, reconciled=True), belief("b", R, reconciled=True), belief("c", S)]
    report = build_report(beliefs, {"a": 1, "c": 1})
    assert report.reconciled == 2
    assert report.rejected == 1


def test_failed_yet_took_effect_is_counted() -> None:
    """A naive client that gave up (FAILED) although the effect happened is counted."""
    report = build_report([belief("a", F), belief("b", F)], {"a": 1})
    assert (report.failed, report.failed_with_effect, report.lost) == (2, 1, 0)


def test_p50_and_p95_are_nearest_rank_percentiles_of_time_to_terminal() -> None:
    """With times 1..100 s, p50 is 50 s and p95 is 95 s; operations without a time are ignored."""
    beliefs = [belief(f"op-{i}", S, float(i)) for i in range(1, 101)]
    beliefs.append(belief("pending", P, None))
    report = build_report(beliefs, {f"op-{i}": 1 for i in range(1, 101)})
    assert (report.p50_seconds, report.p95_seconds) == (50.0, 95.0)


def test_percentile_of_nothing_is_none() -> None:
    """An empty run has no percentiles."""
    assert percentile([], 50) is None
    assert build_report([], {}).p95_seconds is None
    assert percentile([3.0], 95) == 3.0


def test_two_beliefs_for_one_operation_are_rejected() -> None:
    """Each operation has exactly one belief."""
    with pytest.raises(ValueError, match="two beliefs"):
        build_report([belief("a", S), belief("a", F)], {})


def test_belief_state_accepts_its_string_value() -> None:
    """ClientBelief(state="succeeded") is the same as BeliefState.SUCCEEDED."""
    assert ClientBelief(operation_id="a", state="succeeded").state is S  # type: ignore[arg-type]


def test_to_dict_is_json_serialisable() -> None:
    """Report.to_dict() round-trips through JSON with every field."""
    report = build_report([belief("a", S, 0.5)], {"a": 2})
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["duplicates"] == 1
    assert doc["p50_seconds"] == 0.5
    assert Report(**doc) == report


def test_reports_print_side_by_side() -> None:
    """print_reports shows one column per report, named as given."""
    naive = build_report([belief("a", F)], {"a": 2})
    safe = build_report([belief("a", S)], {"a": 1})
    out = io.StringIO()
    print_reports({"naive": naive, "retrysafe": safe}, console=Console(file=out, width=100))
    text = out.getvalue()
    assert "naive" in text
    assert "retrysafe" in text
    duplicates_row = next(line for line in text.splitlines() if "duplicate effects" in line)
    assert [cell.strip() for cell in duplicates_row.split("│")[2:4]] == ["1", "0"]
