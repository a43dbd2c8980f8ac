"""Heartbeats: renew a claim's lease while its work runs (SPEC §3 "Lease renewal", §5, §7).

The rule — how often, until when, what a failed renewal means — is
:class:`~retrysafe.core.LeaseTiming`; these are its two drivers:

* :class:`AsyncHeartbeat` renews on the running event loop with ``loop.call_later``: starting
  and stopping one costs a timer handle, so requests shorter than one heartbeat interval pay
  nothing else.
* :class:`Heartbeat` renews from threads: one daemon scheduler thread per process keeps a heap
  of due renewals, and each renewal runs in a short-lived daemon thread of its own, so a
  renewal stuck on a slow store never delays the others. Starting and stopping one is a heap
  push under a lock.

Both call ``renew()`` every ``timing.heartbeat`` seconds (monotonic time) until :meth:`stop`:

* ``renew()`` returns True: renewed. False: the claim is no longer ours (taken over, fenced,
  finished elsewhere) — renewal stops and ``on_lost()`` runs once, so the caller can log it
  loudly and not write its late result. An exception: logged by ``on_error(exc)``; renewal goes
  on at the next beat (a store hiccup must not give the claim away while the lease lasts).
* While ``bounded``, renewal stops once ``timing.keeps_renewing(started, clock())`` is false
  (the work ran past ``max_run_time``: a wedged claimant) and ``on_expired()`` runs once; the
  lease then runs out. Set ``bounded = False`` when the work itself is over and only its result
  is still being recorded.

A renewal that finishes after :meth:`stop` is ignored, whatever it returned.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from retrysafe.core import LeaseTiming

__all__ = ["AsyncHeartbeat", "Heartbeat"]

log = logging.getLogger("retrysafe.heartbeat")


def _nothing() -> None:
    return None


def _log_error(exc: BaseException) -> None:
    log.warning("lease renewal failed (will retry at the next heartbeat): %r", exc)


class _Base:
    __slots__ = (
        "bounded",
        "clock",
        "on_error",
        "on_expired",
        "on_lost",
        "renewals",
        "started",
        "stopped",
        "timing",
    )

    def __init__(
        self,
        timing: LeaseTiming,
        *,
        clock: Callable[[], float],
        started: float | None,
        on_lost: Callable[[], None],
        on_expired: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.timing = timing
        self.clock = clock
        self.started = clock() if started is None else started
        self.on_lost = on_lost
        self.on_expired = on_expired
        self.on_error = on_error
        self.bounded = True
        self.stopped = False
        self.renewals = 0

    def _expired(self) -> bool:
        """Past ``max_run_time`` while bounded: stop renewing (and say so once)."""
        if self.bounded and not self.timing.keeps_renewing(self.started, self.clock()):
            self.stopped = True
            self.on_expired()
            return True
        return False

    def _outcome(self, ok: bool) -> None:
        if self.stopped:
            return
        if ok:
            self.renewals += 1
            return
        self.stopped = True
        self.on_lost()


class AsyncHeartbeat(_Base):
    """Renews one claim from the running event loop (see the module docstring).

    Args:
        renew: ``async () -> bool``: one fenced renewal (True renewed, False not ours).
        timing: the lease timing (``heartbeat`` is the interval).
        clock: Unix seconds, the clock of ``started`` (the middleware's injected clock).
        started: when the work started on ``clock`` (default: now).
        on_lost, on_expired, on_error: see the module docstring.
    """

    __slots__ = ("_handle", "_loop", "_renew", "_task")

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        timing: LeaseTiming,
        *,
        clock: Callable[[], float] = time.time,
        started: float | None = None,
        on_lost: Callable[[], None] = _nothing,
        on_expired: Callable[[], None] = _nothing,
        on_error: Callable[[BaseException], None] = _log_error,
    ) -> None:
        super().__init__(
            timing,
            clock=clock,
            started=started,
            on_lost=on_lost,
            on_expired=on_expired,
            on_error=on_error,
        )
        self._renew = renew
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> AsyncHeartbeat:
        """Schedule the first renewal one interval from now. Must run on the event loop."""
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self.timing.heartbeat, self._due)
        return self

    def stop(self) -> None:
        """Stop renewing. Idempotent; a renewal in flight finishes and is ignored."""
        self.stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _due(self) -> None:
        self._handle = None
        if self.stopped or self._loop is None:
            return
        self._task = self._loop.create_task(self._beat())

    async def _beat(self) -> None:
        try:
            if self._expired():
                return
            try:
                ok = await self._renew()
            except Exception as exc:
                if not self.stopped:
                    self.on_error(exc)
                ok = True
            self._outcome(ok)
        finally:
            self._task = None
        if not self.stopped and self._loop is not None:
            self._handle = self._loop.call_later(self.timing.heartbeat, self._due)


class Heartbeat(_Base):
    """Renews one claim from threads (see the module docstring): for sync code (WSGI, sync
    agent tools).

    Args:
        renew: ``() -> bool``: one fenced renewal; it runs in a thread of its own, so it must
            be safe to call from any thread (retrysafe's sync stores are).
        timing, clock, started, on_lost, on_expired, on_error: as :class:`AsyncHeartbeat`.
    """

    __slots__ = ("_renew",)

    def __init__(
        self,
        renew: Callable[[], bool],
        timing: LeaseTiming,
        *,
        clock: Callable[[], float] = time.time,
        started: float | None = None,
        on_lost: Callable[[], None] = _nothing,
        on_expired: Callable[[], None] = _nothing,
        on_error: Callable[[BaseException], None] = _log_error,
    ) -> None:
        super().__init__(
            timing,
            clock=clock,
            started=started,
            on_lost=on_lost,
            on_expired=on_expired,
            on_error=on_error,
        )
        self._renew = renew

    def start(self) -> Heartbeat:
        """Schedule the first renewal one interval from now."""
        _SCHEDULER.add(self, time.monotonic() + self.timing.heartbeat)
        return self

    def stop(self) -> None:
        """Stop renewing. Idempotent; a renewal in flight finishes and is ignored."""
        self.stopped = True

    def _beat(self) -> None:
        if self.stopped or self._expired():
            return
        try:
            ok = self._renew()
        except Exception as exc:
            if not self.stopped:
                self.on_error(exc)
            ok = True
        self._outcome(ok)
        if not self.stopped:
            _SCHEDULER.add(self, time.monotonic() + self.timing.heartbeat)


class _Scheduler:
    """One daemon thread per process: pops due heartbeats and runs each renewal in a thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Heartbeat]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def add(self, beat: Heartbeat, due: float) -> None:
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), beat))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="retrysafe-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is beat:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    # Drop stopped heartbeats first so short requests leave nothing to wake for.
                    while self._heap and self._heap[0][2].stopped:
                        heapq.heappop(self._heap)
                    wait = self._heap[0][0] - time.monotonic() if self._heap else 60.0
                    if self._heap and wait <= 0:
                        beat = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(wait)
            threading.Thread(target=beat._beat, name="retrysafe-renewal", daemon=True).start()


_SCHEDULER = _Scheduler()
