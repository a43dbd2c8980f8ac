"""A claim that landed late (it waited for a lock or a slow store) is renewed before the work
starts, so the lease it wrote, computed before the wait, never lets another claimant in while
the work runs (retrysafe.server._engine._renew_late)."""

from __future__ import annotations

from typing import Any

from retrysafe.core import InProgress
from retrysafe.server._engine import Claimed, claim_key
from retrysafe.stores import MemoryStore

H, FP, T0, LEASE = "k" * 64, "f" * 64, 1_000_000.0, 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _run(store: MemoryStore, clock: _Clock, during_claim: Any) -> tuple[list[str], object]:
    """The claim conversation for key H against ``store``; ``during_claim(store)`` runs once
    the first claim has landed, before its answer reaches the engine (the wait). Returns the
    operations asked for and the outcome."""
    gen = claim_key(H, FP, clock=clock, lease=LEASE, retention=3600.0)
    ops: list[str] = []
    try:
        name, args, kwargs = next(gen)
        while True:
            ops.append(name)
            result = getattr(store, name)(*args, **kwargs)
            if len(ops) == 1:
                during_claim(store)
            name, args, kwargs = gen.send(result)
    except StopIteration as stop:
        return ops, stop.value


def test_a_claim_answered_in_time_is_not_renewed() -> None:
    clock = _Clock()
    ops, outcome = _run(MemoryStore(), clock, lambda store: None)
    assert ops == ["claim"]
    assert isinstance(outcome, Claimed)


def test_a_claim_that_landed_late_is_renewed_before_the_work_starts() -> None:
    """The claim took 6 s of a 10 s lease: renewed at once, from the time it arrived."""
    clock = _Clock()
    store = MemoryStore()

    def wait(store: MemoryStore) -> None:
        clock.now += 6.0

    ops, outcome = _run(store, clock, wait)
    assert ops == ["claim", "extend_lease"]
    assert isinstance(outcome, Claimed) and outcome.fencing_token == 1
    assert outcome.at == T0 + 6.0  # max_run_time counts from here: the wait was no run
    record = store.get(H)
    assert record is not None and record.lease_expires_at == T0 + 6.0 + LEASE


def test_a_late_claim_taken_over_meanwhile_never_starts_the_work() -> None:
    """The claim landed with its lease already over, and another claimant took the key over
    before the renewal: the renewal is refused (fenced), and the request is in progress
    elsewhere — it must not run the work too."""
    clock = _Clock()
    store = MemoryStore()

    def taken_over(store: MemoryStore) -> None:
        clock.now += 11.0
        assert store.take_over(H, 1, now=clock.now, lease=LEASE) is not None

    ops, outcome = _run(store, clock, taken_over)
    assert ops == ["claim", "extend_lease", "get"]
    assert isinstance(outcome, InProgress)
    record = store.get(H)
    assert record is not None and record.fencing_token == 2
