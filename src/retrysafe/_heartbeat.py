"""Heartbeats: renew a claim's lease while its work runs (SPEC §3 "Lease renewal", §5, §7).

The rule — how often, until when, what a failed renewal means — is
:class:`~retrysafe.core.LeaseTiming`; these are its two drivers:

* :class:`AsyncHeartbeat` renews from the running event loop, :class:`Heartbeat` from threads
  (each renewal in a short-lived daemon thread of its own, so a renewal stuck on a slow store
  never delays the others).
* Neither schedules anything per claim: starting one adds it to a set, stopping removes it.
  One sweeper per event loop (a task) or per process (a daemon thread) wakes every quarter of
  the shortest heartbeat interval it serves and renews the claims that are due. A claim with
  a shorter interval than any before wakes the sweeper at once (else a sweeper asleep for a
  long lease's tick would let a short lease run out before its first renewal), and the tick
  grows back once the short claims are gone. Requests
  shorter than one interval therefore cost a set insert and a set removal — measured by
  variant (h) of ``benchmarks/middleware_bench.py``. A renewal may come up to a quarter of an
  interval late; the default interval (a third of the lease) leaves room for that and for two
  failed renewals.

Both call ``renew()`` about every ``timing.heartbeat`` seconds (monotonic time) until
:meth:`stop`:

* ``renew()`` returns True: renewed. False: the claim is no longer ours (taken over, fenced,
  finished elsewhere) — renewal stops and ``on_lost()`` runs once, so the caller can log it
  loudly and not write its late result. An exception: logged by ``on_error(exc)``; renewal goes
  on at the next beat (a store hiccup must not give the claim away while the lease lasts).
* While ``bounded``, renewal stops once ``timing.keeps_renewing(started, clock())`` is false
  (the work ran past ``max_run_time``: a wedged claimant) and ``on_expired()`` runs once; the
  lease then runs out. Time the work spends waiting for its client is not counted
  (:meth:`wait_begins`). Set ``bounded = False`` when the work
  itself is over and only its result is still being recorded.

A renewal that finishes after :meth:`stop` is ignored, whatever it returned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from retrysafe.core import LeaseTiming

__all__ = ["AsyncHeartbeat", "Heartbeat"]

log = logging.getLogger("retrysafe.heartbeat")


def _nothing() -> None:
    return None


def _ignore(exc: BaseException) -> None:
    return None


def _log_error(exc: BaseException) -> None:
    log.warning("lease renewal failed (will retry at the next heartbeat): %r", exc)


def _renewed() -> bool:
    return True


async def _renewed_async() -> bool:
    return True


_R = TypeVar("_R")


class _Base(Generic[_R]):
    """What both drivers share: the callbacks, the run-time bound, and the bookkeeping around
    one renewal (``_before`` / ``_after``); the subclasses only await or call ``renew``."""

    __slots__ = (
        "_renew",
        "bounded",
        "busy",
        "clock",
        "due",
        "on_error",
        "on_expired",
        "on_lost",
        "renewals",
        "started",
        "stopped",
        "timing",
        "waiting_since",
    )

    def __init__(
        self,
        renew: Callable[[], _R],
        timing: LeaseTiming,
        *,
        clock: Callable[[], float] = time.time,
        started: float | None = None,
        on_lost: Callable[[], None] = _nothing,
        on_expired: Callable[[], None] = _nothing,
        on_error: Callable[[BaseException], None] = _log_error,
    ) -> None:
        self._renew = renew
        self.timing = timing
        self.clock = clock
        self.started = clock() if started is None else started
        self.on_lost = on_lost
        self.on_expired = on_expired
        self.on_error = on_error
        self.bounded = True
        self.waiting_since: float | None = None  # on ``clock``: a wait for the client
        self.stopped = False
        self.busy = False  # a renewal is in flight
        self.due = 0.0  # monotonic time of the next renewal
        self.renewals = 0

    def _stopped_now(self, renewed: Callable[[], _R]) -> None:
        """Mark stopped and drop the callbacks: they usually point back at the claimant, and a
        cycle would keep every finished request alive until the garbage collector runs."""
        self.stopped = True
        self._renew = renewed
        self.on_lost = self.on_expired = _nothing
        self.on_error = _ignore

    def wait_begins(self) -> None:
        """The work waits for its client from now (a send of its answer, held back by a slow
        or paused reader) until :meth:`wait_ends`: that time, the current wait's included,
        is not counted toward ``max_run_time``, which bounds the work's own time. An answer
        that is done but moves slowly to its client is no wedged claimant: cut off at
        ``max_run_time`` from the start, its key ran out of lease while the client still read
        and a retry ran the effect again (helper-56: a 20 MB answer read at 1.3 MB/s; helper-58:
        one send waiting longer than ``max_run_time`` for a client that paused). A client that
        never reads again holds its own key while its connection lasts."""
        self.waiting_since = self.clock()

    def wait_ends(self) -> None:
        """The wait :meth:`wait_begins` started is over; its time is left out of the run."""
        since, self.waiting_since = self.waiting_since, None
        if since is not None and not self.stopped:
            self.started += max(0.0, self.clock() - since)

    def _run_start(self) -> float:
        """``started`` moved on by the wait in progress, if any (not the work's time)."""
        since = self.waiting_since
        if since is None:
            return self.started
        return self.started + max(0.0, self.clock() - since)

    def _before(self) -> bool:
        """Whether to renew now: not past ``max_run_time`` while bounded (else say so once)."""
        if self.stopped:
            return False
        if self.bounded and not self.timing.keeps_renewing(self._run_start(), self.clock()):
            self.stopped = True
            self.on_expired()
            return False
        return True

    def _again(self, ok: bool, began: float, rounds: int) -> bool:
        """Whether to renew again at once: the renewal that began at ``began`` (monotonic)
        renewed but took over half an interval — it waited (another process held SQLite's
        write lock, a slow store), and the lease end it wrote was computed before the wait,
        so it may already be near or past and another claimant could take the work over
        (a fresh user's check: a renewal written 0.9 s after the end it set, two effects).
        The next one, asked for now, lands with a fresh end. Twice at most in a row: a store
        that is slow every time gets renewals back to back, not a loop."""
        return ok and rounds < 2 and time.monotonic() - began > self.timing.heartbeat / 2

    def _failed(self, exc: BaseException) -> None:
        if not self.stopped:
            self.on_error(exc)

    def _after(self, ok: bool) -> None:
        if not self.stopped:
            if ok:
                self.renewals += 1
            else:
                self.stopped = True
                self.on_lost()
        self.due = time.monotonic() + self.timing.heartbeat
        self.busy = False


class AsyncHeartbeat(_Base[Awaitable[bool]]):
    """Renews one claim from the running event loop (see the module docstring).

    Args:
        renew: ``async () -> bool``: one fenced renewal (True renewed, False not ours).
        timing: the lease timing (``heartbeat`` is the interval).
        clock: Unix seconds, the clock of ``started`` (the middleware's injected clock).
        started: when the work started on ``clock`` (default: now).
        on_lost, on_expired, on_error: see the module docstring.
    """

    __slots__ = ("_sweeper",)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> AsyncHeartbeat:
        """Renew from one interval from now on. Must run on the event loop: ``loop``, if the
        caller knows it (saves looking it up)."""
        sweeper = _loop_sweeper(asyncio.get_running_loop() if loop is None else loop)
        self._sweeper = sweeper
        self.due = time.monotonic() + self.timing.heartbeat
        sweeper.add(self)
        return self

    def stop(self) -> None:
        """Stop renewing. Idempotent; a renewal in flight finishes and is ignored."""
        self._stopped_now(_renewed_async)
        sweeper: _LoopSweeper | None = getattr(self, "_sweeper", None)
        if sweeper is not None:
            sweeper.beats.discard(self)

    async def _beat(self) -> None:
        ok = True
        try:
            rounds = 0
            while self._before():
                began = time.monotonic()
                ok = await self._renew()
                if not self._again(ok, began, rounds):
                    break
                rounds += 1
        except Exception as exc:
            self._failed(exc)
        finally:
            self._after(ok)


def _tick_of(beats: set[AsyncHeartbeat] | set[Heartbeat], default: float) -> float:
    """A sweeper's wake-up interval in seconds: a quarter of the shortest heartbeat it serves,
    or ``default`` while it serves none."""
    return min((b.timing.heartbeat / 4.0 for b in beats), default=default)


class _LoopSweeper:
    """The live heartbeats of one event loop, and the task that renews the due ones."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.beats: set[AsyncHeartbeat] = set()
        self.tick = 0.0
        self.task: asyncio.Task[None] | None = None
        self.renewals: set[asyncio.Task[None]] = set()
        self.waiter: asyncio.Future[None] | None = None  # the sleep in progress

    def add(self, beat: AsyncHeartbeat) -> None:
        self.beats.add(beat)
        tick = beat.timing.heartbeat / 4.0
        if not self.tick or tick < self.tick:
            self.tick = tick
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)  # asleep for a longer tick: sleep anew for this one
        if self.task is None:
            self.task = self.loop.create_task(self._run())

    async def _sleep(self) -> None:
        """Sleep one tick, or less if :meth:`add` wakes us."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(self.tick, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    async def _run(self) -> None:
        idle = 0
        try:
            while idle < 4:  # gone after four idle ticks; the next add starts it again
                await self._sleep()
                if not self.beats:
                    idle += 1
                    continue
                idle = 0
                now = time.monotonic()
                # Lost or past max_run_time: nothing more to renew, even if never stop()ped.
                self.beats.difference_update([b for b in self.beats if b.stopped])
                self.tick = _tick_of(self.beats, self.tick)
                for beat in [b for b in self.beats if b.due <= now and not b.busy]:
                    beat.busy = True
                    task = self.loop.create_task(beat._beat())
                    self.renewals.add(task)
                    task.add_done_callback(self.renewals.discard)
        finally:
            self.task = None  # cancelled with its loop: nothing more to renew there
        self.tick = _tick_of(self.beats, 0.0)
        if self.beats:  # added during the last idle tick
            self.task = self.loop.create_task(self._run())


class Heartbeat(_Base[bool]):
    """Renews one claim from threads (see the module docstring): for sync code (WSGI, sync
    agent tools).

    Args:
        renew: ``() -> bool``: one fenced renewal; it runs in a thread of its own, so it must
            be safe to call from any thread (retrysafe's sync stores are).
        timing, clock, started, on_lost, on_expired, on_error: as :class:`AsyncHeartbeat`.
    """

    __slots__ = ()

    def start(self) -> Heartbeat:
        """Renew from one interval from now on."""
        self.due = time.monotonic() + self.timing.heartbeat
        _THREAD_SWEEPER.add(self)
        return self

    def stop(self) -> None:
        """Stop renewing. Idempotent; a renewal in flight finishes and is ignored."""
        self._stopped_now(_renewed)
        _THREAD_SWEEPER.discard(self)

    def _beat(self) -> None:
        ok = True
        try:
            rounds = 0
            while self._before():
                began = time.monotonic()
                ok = self._renew()
                if not self._again(ok, began, rounds):
                    break
                rounds += 1
        except Exception as exc:
            self._failed(exc)
        finally:
            self._after(ok)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _ThreadSweeper:
    """The live thread heartbeats of this process, and the daemon thread that renews them.

    Args:
        idle_tick: seconds between wake-ups at most (and while nothing is served).
    """

    def __init__(self, idle_tick: float = 1.0) -> None:
        self._beats: set[Heartbeat] = set()
        self._lock = threading.Lock()
        self._idle_tick = idle_tick
        self._tick = idle_tick
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.add(beat)
            tick = beat.timing.heartbeat / 4.0
            if tick < self._tick:
                self._tick = tick
                self._wakeup.set()  # asleep for a longer tick: sleep anew for this one
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="retrysafe-heartbeat", daemon=True
                )
                self._thread.start()

    def discard(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            self._wakeup.wait(self._tick)
            self._wakeup.clear()
            now = time.monotonic()
            with self._lock:
                self._beats.difference_update([b for b in self._beats if b.stopped])
                self._tick = min(self._idle_tick, _tick_of(self._beats, self._idle_tick))
                due = [b for b in self._beats if b.due <= now and not b.busy]
                for beat in due:
                    beat.busy = True
            for beat in due:
                threading.Thread(target=beat._beat, name="retrysafe-renewal", daemon=True).start()


_LOOP_SWEEPERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSweeper] = (
    weakref.WeakKeyDictionary()
)
#: The last loop asked for and its sweeper: a process usually runs one loop, and a weak
#: reference's call costs a quarter of a WeakKeyDictionary look-up (which makes a new one).
_LAST: tuple[weakref.ref[asyncio.AbstractEventLoop], _LoopSweeper] | None = None


def _loop_sweeper(loop: asyncio.AbstractEventLoop) -> _LoopSweeper:
    """The sweeper of ``loop``, made on first use."""
    global _LAST
    last = _LAST
    if last is not None and last[0]() is loop:
        return last[1]
    sweeper = _LOOP_SWEEPERS.get(loop)
    if sweeper is None:
        sweeper = _LOOP_SWEEPERS[loop] = _LoopSweeper(loop)
    _LAST = (weakref.ref(loop), sweeper)
    return sweeper


_THREAD_SWEEPER = _ThreadSweeper()
