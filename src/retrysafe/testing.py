"""Turn off retrysafe's own waiting in tests, after stamina's ``set_testing``.

retrysafe waits, on purpose, in two places between its own retries:

* an agent tool's retries (``@tool(attempts=…, wait_initial=…, wait_max=…)``) back off with
  full jitter before the next attempt (SPEC §7);
* the idempotency middleware and the webhook receiver, given an ``in_progress_wait``, poll a
  key that another request holds for up to that many seconds before answering
  ``409 request-in-progress`` (SPEC §3).

While testing is on, both take no time: a tool retries at once, and a repeat of a running
request gets its 409 straight away. Everything else keeps its real timing, because that
timing is what a test of it checks: leases and their heartbeats (crash detection), a store's
busy timeout and the middleware's retries of a store outage (bounded by wall-clock
deadlines), and the outbox and webhook workers, whose schedules are due times kept in the
store, not sleeps (drive those with an injected ``clock``).

Use it as a context manager, or switch it for a whole session::

    import retrysafe.testing

    with retrysafe.testing.no_waiting():
        run_agent()                       # tool retries do not sleep

    retrysafe.testing.set_testing(True)   # e.g. in conftest.py; set_testing(False) undoes it

In pytest, an autouse fixture does it for every test::

    @pytest.fixture(autouse=True)
    def _no_waiting():
        with retrysafe.testing.no_waiting():
            yield

The switch is process-wide (threads and event loops included), like stamina's: tools retried
in worker threads see it too. This module imports nothing but the standard library, so
retrysafe's own code may consult it on every wait.
"""

from __future__ import annotations

from types import TracebackType

__all__ = ["is_testing", "no_waiting", "set_testing", "waited"]

_testing = False


class _Restore:
    """What :func:`set_testing` returns: used as a context manager, it puts the previous
    setting back on exit (so ``with set_testing(True):`` and nested uses restore)."""

    __slots__ = ("_previous",)

    def __init__(self, previous: bool) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _testing
        _testing = self._previous


def set_testing(testing: bool) -> _Restore:
    """Switch testing mode on (``True``: retrysafe's retry waits take no time) or off.

    Args:
        testing: the new setting.

    Returns:
        A context manager that restores the previous setting on exit; ignore it to keep the
        new setting until the next call.

    Raises:
        TypeError: ``testing`` is not a bool.
    """
    global _testing
    if not isinstance(testing, bool):
        raise TypeError(f"set_testing takes True or False, not {testing!r}")
    previous, _testing = _testing, testing
    return _Restore(previous)


def no_waiting() -> _Restore:
    """``set_testing(True)`` as a context manager: inside the ``with`` block, retrysafe's
    retry waits take no time; on exit the previous setting is back."""
    return set_testing(True)


def is_testing() -> bool:
    """Whether testing mode is on."""
    return _testing


def waited(seconds: float) -> float:
    """How long retrysafe really waits where it would wait ``seconds`` between its own
    retries: ``seconds`` (never negative, NaN as 0), or ``0.0`` while testing.

    The hook every such wait consults (an agent tool's backoff sleep, the in-progress wait of
    the middleware and the receiver); see the module docstring for what it leaves alone.
    """
    if _testing or not seconds > 0:  # NaN and negatives: no wait
        return 0.0
    return float(seconds)
