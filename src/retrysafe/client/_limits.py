"""Attempts in flight per destination, each under an adaptive limit (AIMD), pure.

Why: one worker's slots are shared by every destination. An endpoint that accepts
connections and never answers holds each slot it gets for the whole attempt timeout, so a
backlog of jobs to it would soon hold every slot, and the jobs to healthy destinations would
wait behind it (SPEC §5: a timeout is "I don't know", retried with the same key; it must not
also stop everyone else).

The rule, per destination (``scheme://host:port``, as the retry budget's), is TCP's
congestion window (RFC 5681) and Netflix's ``concurrency-limits`` "AIMD" limit, applied to
attempts in flight:

* the limit starts at ``cap`` (the worker's concurrency, or its ``max_per_destination``);
* an attempt that **timed out** (no complete answer within its timeout: it held a slot for
  the whole timeout) halves it, down to 1;
* an attempt that ended any other way (an answer of any status, a refused or reset
  connection: its slot came back in time) raises it by one, up to ``cap``.

So a destination whose attempts keep timing out soon has one attempt in flight (a probe),
and the other slots serve everyone else; once its attempts answer in time its limit climbs
back (by one per answer, so it doubles every round trip, like TCP's slow start). A healthy
destination never times out and keeps the whole ``cap``; a rare timeout (a lost answer)
costs half the slots for about one round trip. Fast failures do not lower the limit: they
hold no slot for long, and the retry budget already defers their retries.

A limit is per worker (each process keeps its own); nothing is stored.
"""

from __future__ import annotations

__all__ = ["TIMED_OUT", "DestinationLimits"]

#: The transport errors that mean "no complete answer within the timeout" (see
#: :mod:`retrysafe.client._sender`): connecting, writing, waiting for a read, or the
#: attempt's total timeout. A pool timeout is the worker's own pool, not the destination.
TIMED_OUT = frozenset({"ConnectTimeout", "ReadTimeout", "WriteTimeout", "AttemptTimeout"})

#: Destinations remembered with nothing in flight (their lowered limit) before the oldest
#: are forgotten (back to ``cap``): memory stays bounded whatever the number of hosts.
_REMEMBERED = 4096


class DestinationLimits:
    """The attempts in flight to each destination and each one's limit (module docstring).

    Args:
        cap: the highest limit, in attempts (>= 1).

    One event loop uses an instance; nothing here blocks or awaits.
    """

    __slots__ = ("_down", "_full", "_in_flight", "_limit", "cap")

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self._in_flight: dict[str, int] = {}
        #: Limits below ``cap`` (a destination absent here has ``cap``).
        self._limit: dict[str, int] = {}
        #: The destinations whose attempts in flight reached their limit.
        self._full: set[str] = set()
        #: The destinations whose limit fell to 1 and has not climbed back to ``cap``.
        self._down: set[str] = set()

    def limit(self, destination: str) -> int:
        """The most attempts ``destination`` may have in flight now."""
        return self._limit.get(destination, self.cap)

    def in_flight(self, destination: str) -> int:
        """Attempts to ``destination`` started and not yet ended."""
        return self._in_flight.get(destination, 0)

    def full(self) -> list[str]:
        """The destinations at their limit, sorted: a claim skips their jobs."""
        return sorted(self._full)

    def start(self, destination: str) -> bool:
        """Take a slot for an attempt to ``destination``; False (nothing taken) when it is
        already at its limit (give the job back unstarted)."""
        n = self._in_flight.get(destination, 0)
        limit = self._limit.get(destination, self.cap)
        if n >= limit:
            return False
        self._in_flight[destination] = n + 1
        if n + 1 >= limit:
            self._full.add(destination)
        return True

    def answered(self, destination: str, *, timed_out: bool) -> str | None:
        """An attempt to ``destination`` ended (its slot is still taken): halve the limit if
        it ``timed_out``, else raise it by one.

        Returns:
            ``"down"`` when the limit just fell to 1 (from more), ``"up"`` when it just
            climbed back to ``cap`` after having been 1, else None (what a worker logs).
        """
        if not timed_out and destination not in self._limit:
            return None  # at the cap already: nothing changes (every healthy attempt)
        old = self._limit.get(destination, self.cap)
        new = max(1, old // 2) if timed_out else min(self.cap, old + 1)
        if new >= self.cap:
            self._limit.pop(destination, None)
        else:
            self._limit[destination] = new
            if len(self._limit) > _REMEMBERED:
                self._forget()
        self._refresh(destination)
        if new == 1 and old > 1:
            self._down.add(destination)
            return "down"
        if new == self.cap and destination in self._down:
            self._down.discard(destination)
            return "up"
        return None

    def end(self, destination: str) -> None:
        """Give back the slot :meth:`start` took for ``destination``."""
        n = self._in_flight.get(destination, 0) - 1
        if n > 0:
            self._in_flight[destination] = n
        else:
            self._in_flight.pop(destination, None)
        self._refresh(destination)

    def _refresh(self, destination: str) -> None:
        if self._in_flight.get(destination, 0) >= self._limit.get(destination, self.cap):
            self._full.add(destination)
        else:
            self._full.discard(destination)

    def _forget(self) -> None:
        """Drop the oldest lowered limits of destinations with nothing in flight."""
        for destination in list(self._limit):
            if len(self._limit) <= _REMEMBERED // 2:
                break
            if destination not in self._in_flight:
                del self._limit[destination]
                self._down.discard(destination)
