"""Which fault the chaos proxy applies to a request (SPEC §8), as pure values and one pure function.

The proxy draws exactly three numbers from a ``random.Random(seed)`` per request, in arrival
order, through :func:`choose_fault`; tests check the rates statistically by calling it directly,
without sockets.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, fields, replace
from typing import Any

from retrysafe._exceptions import ConfigurationError

__all__ = ["EXCLUSIVE_FAULTS", "Fault", "FaultChoice", "FaultRates", "choose_fault"]


class Fault(str, enum.Enum):
    """The fault applied to one request. At most one per request; latency comes on top.

    ``NONE``: forward and answer faithfully.
    ``LOSE_AFTER_COMMIT``: forward, read the whole upstream answer, then close the client
    connection without answering — the effect happened, the client cannot know.
    ``HOLD_AFTER_COMMIT``: forward, read the answer, and hold it ``hold_seconds`` before sending
    it (past a typical client timeout), or until the client goes away.
    ``ERROR_AFTER_COMMIT``: forward, discard the answer, send ``503``.
    ``RESET_BEFORE_FORWARD``: reset the client connection (TCP RST); the upstream never sees it.
    ``ERROR_BEFORE_FORWARD``: answer ``503``; the upstream never sees it.
    """

    NONE = "none"
    LOSE_AFTER_COMMIT = "lose_after_commit"
    HOLD_AFTER_COMMIT = "hold_after_commit"
    ERROR_AFTER_COMMIT = "error_after_commit"
    RESET_BEFORE_FORWARD = "reset_before_forward"
    ERROR_BEFORE_FORWARD = "error_before_forward"

    @property
    def forwards(self) -> bool:
        """Whether the request reaches the upstream under this fault."""
        return self not in (Fault.RESET_BEFORE_FORWARD, Fault.ERROR_BEFORE_FORWARD)


#: The mutually exclusive faults, in the order :func:`choose_fault` lays them on ``[0, 1)``.
EXCLUSIVE_FAULTS: tuple[Fault, ...] = (
    Fault.LOSE_AFTER_COMMIT,
    Fault.HOLD_AFTER_COMMIT,
    Fault.ERROR_AFTER_COMMIT,
    Fault.RESET_BEFORE_FORWARD,
    Fault.ERROR_BEFORE_FORWARD,
)

# Sums of five floats such as 0.2 may exceed 1 by rounding only.
_SUM_TOLERANCE = 1e-9


def _check_rate(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number in [0, 1], got {value!r}", option=name)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ConfigurationError(f"{name} must be in [0, 1], got {value!r}", option=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultRates:
    """Per-request probabilities of each fault; frozen and validated.

    Attributes:
        lose_after_commit: probability of closing the client connection after the upstream
            answered in full.
        hold_after_commit: probability of holding the upstream's answer ``hold_seconds``.
        error_after_commit: probability of replacing the upstream's answer with ``503``.
        reset_before_forward: probability of a TCP reset without forwarding.
        error_before_forward: probability of a ``503`` without forwarding.
        latency: probability, independent of the faults above, of waiting a uniform
            ``latency_seconds`` before forwarding.
        latency_seconds: ``(min, max)`` added latency in seconds.
        hold_seconds: how long a held answer waits, in seconds (default 30, longer than most
            client timeouts).

    Raises:
        ConfigurationError: a rate outside ``[0, 1]``, exclusive rates summing to more than 1,
            a negative or inverted latency range, or ``hold_seconds <= 0``. ``option`` names
            the field.
    """

    lose_after_commit: float = 0.0
    hold_after_commit: float = 0.0
    error_after_commit: float = 0.0
    reset_before_forward: float = 0.0
    error_before_forward: float = 0.0
    latency: float = 0.0
    latency_seconds: tuple[float, float] = (0.05, 0.2)
    hold_seconds: float = 30.0

    def __post_init__(self) -> None:
        for fault in EXCLUSIVE_FAULTS:
            _check_rate(fault.value, getattr(self, fault.value))
        _check_rate("latency", self.latency)
        total = sum(self.rate(fault) for fault in EXCLUSIVE_FAULTS)
        if total > 1.0 + _SUM_TOLERANCE:
            names = ", ".join(f.value for f in EXCLUSIVE_FAULTS if self.rate(f) > 0)
            raise ConfigurationError(
                f"the fault rates ({names}) sum to {total:g}; at most one fault applies per "
                "request, so their sum must be at most 1",
                option=next(f.value for f in reversed(EXCLUSIVE_FAULTS) if self.rate(f) > 0),
            )
        try:
            low, high = (float(v) for v in self.latency_seconds)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"latency_seconds must be a (min, max) pair, got {self.latency_seconds!r}",
                option="latency_seconds",
            ) from None
        if not (math.isfinite(low) and math.isfinite(high)) or low < 0 or high < low:
            raise ConfigurationError(
                f"latency_seconds must satisfy 0 <= min <= max, got {self.latency_seconds!r}",
                option="latency_seconds",
            )
        object.__setattr__(self, "latency_seconds", (low, high))
        hold = self.hold_seconds
        if isinstance(hold, bool) or not isinstance(hold, int | float) or not hold > 0:
            raise ConfigurationError(
                f"hold_seconds must be a positive number of seconds, got {hold!r}",
                option="hold_seconds",
            )
        if not math.isfinite(hold):
            raise ConfigurationError("hold_seconds must be finite", option="hold_seconds")

    def rate(self, fault: Fault) -> float:
        """The probability of ``fault`` (``NONE``: whatever the exclusive faults leave)."""
        if fault is Fault.NONE:
            return max(0.0, 1.0 - sum(self.rate(f) for f in EXCLUSIVE_FAULTS))
        value: float = getattr(self, fault.value)
        return value

    def replace(self, **changes: Any) -> FaultRates:
        """A copy with ``changes`` applied and validated."""
        return replace(self, **changes)

    def healed(self) -> FaultRates:
        """A copy with every rate (faults and latency) at 0; durations are kept."""
        return self.replace(**{f.value: 0.0 for f in EXCLUSIVE_FAULTS}, latency=0.0)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-serialisable values."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["latency_seconds"] = list(self.latency_seconds)
        return out


@dataclass(frozen=True, slots=True)
class FaultChoice:
    """What the proxy does to one request.

    Attributes:
        fault: the exclusive fault (``Fault.NONE`` for none).
        latency: seconds to wait before forwarding (0.0 for none).
    """

    fault: Fault
    latency: float = 0.0


def choose_fault(rates: FaultRates, rng: random.Random) -> FaultChoice:
    """Choose the fault for one request. Pure apart from consuming ``rng``.

    Draws exactly three numbers from ``rng`` whatever the outcome, so a seed gives the same
    sequence of choices for the same sequence of requests even when rates change:
    ``u`` picks the exclusive fault (the faults take consecutive slices of ``[0, 1)`` in
    :data:`EXCLUSIVE_FAULTS` order; the rest is ``NONE``), ``v < latency`` adds latency and
    ``w`` places it uniformly in ``latency_seconds``.

    Args:
        rates: the configured rates.
        rng: the proxy's seeded random source.

    Returns:
        The :class:`FaultChoice` for this request.
    """
    u, v, w = rng.random(), rng.random(), rng.random()
    fault = Fault.NONE
    edge = 0.0
    for candidate in EXCLUSIVE_FAULTS:
        edge += rates.rate(candidate)
        if u < edge:
            fault = candidate
            break
    latency = 0.0
    if v < rates.latency:
        low, high = rates.latency_seconds
        latency = low + (high - low) * w
    return FaultChoice(fault, latency)
