"""FaultRates validation and the pure fault choice (SPEC §8), checked statistically."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from retrysafe import ConfigurationError
from retrysafe.chaos import EXCLUSIVE_FAULTS, Fault, FaultChoice, FaultRates, choose_fault

DRAWS = 20_000


def within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """Whether ``count`` successes out of ``n`` are within ``sigmas`` standard deviations."""
    sd = math.sqrt(n * p * (1 - p))
    return abs(count - n * p) <= sigmas * sd + 1


@pytest.mark.parametrize("fault", EXCLUSIVE_FAULTS)
def test_each_fault_is_chosen_at_its_rate(fault: Fault) -> None:
    """Alone at rate 0.1, a fault is chosen in 10% of 20,000 seeded draws (5σ bounds)."""
    rates = FaultRates().replace(**{fault.value: 0.1})
    rng = random.Random(1234)
    counts = Counter(choose_fault(rates, rng).fault for _ in range(DRAWS))
    assert within_binomial(counts[fault], DRAWS, 0.1)
    assert counts[fault] + counts[Fault.NONE] == DRAWS


def test_mixed_rates_are_each_respected() -> None:
    """With every fault configured at once, each lands at its own rate and NONE gets the rest."""
    rates = FaultRates(
        lose_after_commit=0.05,
        hold_after_commit=0.1,
        error_after_commit=0.15,
        reset_before_forward=0.2,
        error_before_forward=0.25,
    )
    rng = random.Random(99)
    counts = Counter(choose_fault(rates, rng).fault for _ in range(DRAWS))
    for fault in (*EXCLUSIVE_FAULTS, Fault.NONE):
        assert within_binomial(counts[fault], DRAWS, rates.rate(fault)), fault
    assert rates.rate(Fault.NONE) == pytest.approx(0.25)


def test_latency_is_independent_of_faults_and_within_its_range() -> None:
    """Latency applies at its own rate, on top of any fault, uniformly within latency_seconds."""
    rates = FaultRates(error_before_forward=0.5, latency=0.3, latency_seconds=(0.1, 0.3))
    rng = random.Random(7)
    choices = [choose_fault(rates, rng) for _ in range(DRAWS)]
    delayed = [c for c in choices if c.latency > 0]
    assert within_binomial(len(delayed), DRAWS, 0.3)
    assert all(0.1 <= c.latency <= 0.3 for c in delayed)
    mean = sum(c.latency for c in delayed) / len(delayed)
    assert mean == pytest.approx(0.2, abs=0.005)
    faulted = sum(c.fault is Fault.ERROR_BEFORE_FORWARD for c in delayed)
    assert within_binomial(faulted, len(delayed), 0.5)


def test_zero_rates_never_fault() -> None:
    """The default rates choose no fault and no latency."""
    rng = random.Random(0)
    choices = {choose_fault(FaultRates(), rng) for _ in range(1000)}
    assert choices == {FaultChoice(Fault.NONE, 0.0)}


def test_rates_of_one_always_fault() -> None:
    """A rate of 1.0 chooses that fault for every request."""
    rng = random.Random(0)
    rates = FaultRates(reset_before_forward=1.0)
    assert all(choose_fault(rates, rng).fault is Fault.RESET_BEFORE_FORWARD for _ in range(1000))


def test_each_choice_draws_three_numbers() -> None:
    """A choice consumes exactly three draws whatever the rates, so a seed stays aligned."""
    a, b = random.Random(5), random.Random(5)
    choose_fault(FaultRates(latency=1.0, lose_after_commit=0.5), a)
    choose_fault(FaultRates(), a)
    for _ in range(6):
        b.random()
    assert a.random() == b.random()


@pytest.mark.parametrize("value", [1.5, -0.1, math.nan, math.inf, "0.1", True])
@pytest.mark.parametrize("option", [f.value for f in EXCLUSIVE_FAULTS] + ["latency"])
def test_rate_outside_unit_interval_is_rejected(option: str, value: object) -> None:
    """A rate outside [0, 1] (or not a number) raises ConfigurationError naming the option."""
    with pytest.raises(ConfigurationError, match=option) as info:
        FaultRates(**{option: value})  # type: ignore[arg-type]
    assert info.value.option == option


def test_exclusive_rates_summing_over_one_are_rejected() -> None:
    """The exclusive fault rates must sum to at most 1."""
    with pytest.raises(ConfigurationError, match=r"sum to 1\.2") as info:
        FaultRates(lose_after_commit=0.6, error_before_forward=0.6)
    assert info.value.option == "error_before_forward"


def test_rates_summing_to_exactly_one_are_accepted() -> None:
    """Five rates of 0.2 sum to 1 (up to rounding) and are valid."""
    rates = FaultRates().replace(**{f.value: 0.2 for f in EXCLUSIVE_FAULTS})
    assert rates.rate(Fault.NONE) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("changes", "option"),
    [
        ({"latency_seconds": (0.3, 0.1)}, "latency_seconds"),
        ({"latency_seconds": (-1.0, 0.1)}, "latency_seconds"),
        ({"latency_seconds": "fast"}, "latency_seconds"),
        ({"hold_seconds": 0}, "hold_seconds"),
        ({"hold_seconds": -1.0}, "hold_seconds"),
        ({"hold_seconds": math.inf}, "hold_seconds"),
    ],
)
def test_bad_durations_are_rejected(changes: dict[str, object], option: str) -> None:
    """Inverted or negative latency ranges and non-positive holds raise ConfigurationError."""
    with pytest.raises(ConfigurationError) as info:
        FaultRates(**changes)  # type: ignore[arg-type]
    assert info.value.option == option


def test_healed_rates_are_all_zero_and_keep_durations() -> None:
    """healed() zeroes every rate, latency included, and keeps hold_seconds."""
    rates = FaultRates(lose_after_commit=0.3, latency=0.5, hold_seconds=3.0).healed()
    assert all(rates.rate(f) == 0 for f in EXCLUSIVE_FAULTS)
    assert rates.latency == 0
    assert rates.hold_seconds == 3.0
