"""The adaptive per-destination limit of attempts in flight (client/_limits.py), pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from retrysafe.client._limits import TIMED_OUT, DestinationLimits

A, B = "http://a:80", "http://b:80"


def test_a_destination_starts_at_the_cap_and_is_full_there() -> None:
    limits = DestinationLimits(3)
    assert [limits.start(A) for _ in range(4)] == [True, True, True, False]
    assert limits.in_flight(A) == 3
    assert limits.full() == [A]
    limits.end(A)
    assert limits.full() == []
    assert limits.start(A)


def test_each_timeout_halves_the_limit_down_to_one() -> None:
    limits = DestinationLimits(32)
    seen = []
    for _ in range(7):
        limits.answered(A, timed_out=True)
        seen.append(limits.limit(A))
    assert seen == [16, 8, 4, 2, 1, 1, 1]
    assert limits.limit(B) == 32  # another destination keeps its limit


def test_answers_in_time_raise_the_limit_by_one_up_to_the_cap() -> None:
    limits = DestinationLimits(4)
    for _ in range(3):
        limits.answered(A, timed_out=True)
    assert limits.limit(A) == 1
    for expected in (2, 3, 4, 4):
        limits.answered(A, timed_out=False)
        assert limits.limit(A) == expected


def test_a_lowered_limit_makes_the_destination_full_with_the_attempts_already_running() -> None:
    """Eight attempts run when the limit falls to 1: no new one starts until seven end."""
    limits = DestinationLimits(8)
    for _ in range(8):
        assert limits.start(A)
    assert limits.full() == [A]
    for _ in range(3):
        limits.answered(A, timed_out=True)
    assert limits.limit(A) == 1
    for _ in range(7):
        limits.end(A)
        assert limits.full() == [A]
        assert not limits.start(A)
    limits.end(A)
    assert limits.full() == []
    assert limits.start(A)
    assert not limits.start(A)


def test_the_transitions_a_worker_logs() -> None:
    limits = DestinationLimits(4)
    assert limits.answered(A, timed_out=True) is None  # 4 -> 2
    assert limits.answered(A, timed_out=True) == "down"  # 2 -> 1
    assert limits.answered(A, timed_out=True) is None  # stays 1
    assert [limits.answered(A, timed_out=False) for _ in range(3)] == [None, None, "up"]
    assert limits.answered(A, timed_out=False) is None  # at the cap already
    assert limits.answered(A, timed_out=True) is None  # 4 -> 2: not down yet


def test_with_a_cap_of_one_nothing_changes_and_nothing_is_logged() -> None:
    limits = DestinationLimits(1)
    assert limits.answered(A, timed_out=True) is None
    assert limits.limit(A) == 1
    assert limits.answered(A, timed_out=False) is None


def test_only_timeouts_count_as_timeouts() -> None:
    """Refused, reset and truncated answers end fast: they hold no slot for long."""
    assert {"ConnectTimeout", "ReadTimeout", "WriteTimeout", "AttemptTimeout"} == TIMED_OUT
    assert not {"ConnectError", "ReadError", "RemoteProtocolError", "PoolTimeout"} & TIMED_OUT


def test_memory_stays_bounded_over_many_destinations() -> None:
    limits = DestinationLimits(8)
    for i in range(20_000):
        limits.answered(f"http://h{i}:80", timed_out=True)
    assert len(limits._limit) <= 4096
    # The latest lowered limits are the ones kept.
    assert limits.limit("http://h19999:80") == 4


def test_a_destination_with_attempts_in_flight_is_never_forgotten() -> None:
    limits = DestinationLimits(8)
    limits.start(A)
    for _ in range(3):
        limits.answered(A, timed_out=True)
    for i in range(10_000):
        limits.answered(f"http://h{i}:80", timed_out=True)
    assert limits.limit(A) == 1
    assert limits.full() == [A]


@given(
    st.integers(1, 16),
    st.lists(
        st.tuples(st.sampled_from([A, B]), st.sampled_from(["start", "end", "ok", "timeout"])),
        max_size=200,
    ),
)
def test_invariants_under_any_sequence(
    cap: int, steps: list[tuple[str, str]]
) -> None:
    """Whatever happens: 1 <= limit <= cap; a start never takes a destination over its limit
    as it stood; full() is exactly the destinations at or over their limit."""
    limits = DestinationLimits(cap)
    running = {A: 0, B: 0}
    for destination, step in steps:
        if step == "start":
            before = limits.in_flight(destination)
            if limits.start(destination):
                assert before < limits.limit(destination)
                running[destination] += 1
            else:
                assert before >= limits.limit(destination)
        elif step == "end":
            if running[destination]:
                limits.end(destination)
                running[destination] -= 1
        else:
            limits.answered(destination, timed_out=step == "timeout")
        for d in (A, B):
            assert 1 <= limits.limit(d) <= cap
            assert limits.in_flight(d) == running[d]
        assert limits.full() == sorted(d for d in (A, B) if running[d] >= limits.limit(d))
