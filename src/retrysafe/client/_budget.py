"""A per-destination retry budget: a token bucket, pure (SPEC §5).

The idea comes from gRPC's retry throttling and the AWS SDKs' retry quota: first attempts are
always allowed; each retry spends a token; successes put tokens back; tokens also refill
slowly with time. During an outage the bucket empties and retries are **deferred** (the worker
reschedules them for when a token will be there) instead of multiplying the load on a
destination that is already failing. Nothing is dropped and a deferral is not an attempt.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from retrysafe._exceptions import ConfigurationError

__all__ = ["BudgetState", "RetryBudget"]


@dataclass(frozen=True, slots=True)
class BudgetState:
    """The bucket of one destination: ``tokens`` as of ``updated_at`` (Unix seconds)."""

    tokens: float
    updated_at: float


#: The longest time (seconds) the refill alone may take to pay for one retry.
SLOWEST_REFILL_S = 86_400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudget:
    """Token-bucket settings, applied per destination (``scheme://host:port``).

    Attributes:
        capacity: tokens when full: the burst of retries allowed at once (default 100,
            like the AWS SDKs' retry quota of 500 tokens at 5 per retry).
        refill_per_second: tokens added per second (default 10: at most about ten retries
            per second to a destination that keeps failing, after the burst).
        retry_cost: tokens one retry spends (default 1).
        success_credit: tokens a success puts back (default 1).

    Raises:
        ConfigurationError: a value that is not a finite number >= 0 (NaN turned the budget
            off: no comparison with it is true), ``capacity < retry_cost``, no refill at all,
            or a refill so slow that one retry waits more than a day for it
            (:data:`SLOWEST_REFILL_S`; 0 refills by successes only).
    """

    capacity: float = 100.0
    refill_per_second: float = 10.0
    retry_cost: float = 1.0
    success_credit: float = 1.0

    def __post_init__(self) -> None:
        for name in ("capacity", "refill_per_second", "retry_cost", "success_credit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigurationError(
                    f"retry budget {name} must be a number, not {value!r:.40}", option=name
                )
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int beyond any float
                finite = False
            if not finite or value < 0:
                raise ConfigurationError(
                    f"retry budget {name} must be a finite number >= 0, not {value!r:.40}",
                    option=name,
                )
        rate = self.refill_per_second
        if rate > 0 and self.retry_cost / rate > SLOWEST_REFILL_S:
            raise ConfigurationError(
                f"retry budget refill_per_second {rate!r} refills one retry (retry_cost "
                f"{self.retry_cost:g}) in {self.retry_cost / rate / 3600:.3g} hours, so a "
                "deferred retry would wait that long; refill one within a day, or set 0 to "
                "refill by successes only",
                option="refill_per_second",
            )
        if self.capacity < self.retry_cost:
            raise ConfigurationError(
                "retry budget capacity must be >= retry_cost", option="capacity"
            )
        if self.refill_per_second == 0 and self.success_credit == 0:
            raise ConfigurationError(
                "a retry budget that never refills would defer retries forever",
                option="refill_per_second",
            )

    def full(self, now: float) -> BudgetState:
        """A full bucket at ``now``."""
        return BudgetState(self.capacity, now)

    def refill(self, state: BudgetState, now: float) -> BudgetState:
        """The bucket at ``now`` after time-based refill (never above capacity)."""
        elapsed = max(0.0, now - state.updated_at)
        tokens = min(self.capacity, state.tokens + elapsed * self.refill_per_second)
        return BudgetState(tokens, max(now, state.updated_at))

    def spend(self, state: BudgetState, now: float) -> tuple[bool, float, BudgetState]:
        """Try to pay for one retry at ``now``.

        Returns:
            ``(allowed, wait, new_state)``: when not allowed, ``wait`` is the seconds until a
            token will be there by refill alone (the worker defers the retry that long).
        """
        state = self.refill(state, now)
        if state.tokens >= self.retry_cost:
            return True, 0.0, BudgetState(state.tokens - self.retry_cost, state.updated_at)
        missing = self.retry_cost - state.tokens
        wait = missing / self.refill_per_second if self.refill_per_second > 0 else 1.0
        return False, wait, state

    def credit(self, state: BudgetState, now: float) -> BudgetState:
        """Put ``success_credit`` tokens back after a success."""
        state = self.refill(state, now)
        return BudgetState(min(self.capacity, state.tokens + self.success_credit), state.updated_at)
