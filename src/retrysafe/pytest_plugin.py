"""retrysafe's pytest plugin, registered through the ``pytest11`` entry point.

It gives every project that installs retrysafe two fixtures to test its own clients and
services against a network that loses answers (SPEC §8):

``chaos_proxy``
    a factory ``chaos_proxy(upstream_url, *, seed=0, log_path=None, **rates) -> ChaosProxy``
    that starts a :class:`retrysafe.chaos.ChaosProxy` in a background thread in front of
    ``upstream_url`` and stops it when the test ends. ``rates`` are the fields of
    :class:`retrysafe.chaos.FaultRates` (``lose_after_commit=0.2``, ``hold_seconds=2``, …).

``effect_ledger``
    a fresh in-memory :class:`retrysafe.chaos.EffectLedger`; record an effect in your server's
    handler with ``effect_ledger.record(operation_id)`` and compare with what the client
    believes using :func:`retrysafe.chaos.build_report`.

The plugin loads in every pytest run of every project that has retrysafe installed, so this
module imports nothing heavy: :mod:`retrysafe.chaos` is imported only when a fixture is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from retrysafe.chaos import ChaosProxy, EffectLedger

__all__ = ["ChaosProxyFactory", "chaos_proxy", "effect_ledger"]


class ChaosProxyFactory(Protocol):
    """The ``chaos_proxy`` fixture's type: call it to start a proxy."""

    def __call__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        log_path: str | Path | None = None,
        **rates: Any,
    ) -> ChaosProxy: ...


@pytest.fixture
def chaos_proxy() -> Iterator[ChaosProxyFactory]:
    """Start chaos proxies in front of an upstream; every one is stopped at teardown."""
    started: list[ChaosProxy] = []

    def factory(
        upstream: str,
        *,
        seed: int = 0,
        log_path: str | Path | None = None,
        **rates: Any,
    ) -> ChaosProxy:
        from retrysafe.chaos import ChaosProxy, FaultRates

        proxy = ChaosProxy(upstream, rates=FaultRates(**rates), seed=seed, log_path=log_path)
        proxy.start_in_thread()
        started.append(proxy)
        return proxy

    try:
        yield factory
    finally:
        for proxy in reversed(started):
            proxy.close()


@pytest.fixture
def effect_ledger() -> EffectLedger:
    """A fresh in-memory effect ledger (SPEC §8)."""
    from retrysafe.chaos import EffectLedger

    return EffectLedger()
