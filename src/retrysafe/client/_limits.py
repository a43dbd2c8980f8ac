"""Attempts in flight per destination, each under an adaptive limit (AIMD), pure.

Why: one worker's slots are shared by every destination. An endpoint that accepts
connections and never answers (or answers an error only just before the timeout) holds each
slot it gets for the whole timeout, so a backlog of jobs to it would soon hold every slot, and
the jobs to healthy destinations would wait behind it (SPEC §5: a timeout is "I don't know",
retried with the same key; it must not also stop everyone else).

The rule, per destination (``scheme://host:port``, as the retry budget's), is TCP's
congestion avoidance (RFC 5681: additive increase, multiplicative decrease) applied to
attempts in flight instead of bytes:

* a destination nothing is known of yet (no attempt of it ended lately) gets **one
  attempt in flight**, a probe, until that attempt ends or has been in flight :data:`SLOW`
  seconds; then it starts at ``cap`` (the worker's concurrency, or its
  ``max_per_destination``), or, after a probe that long, it is slow (below) and gets its
  fair share at once. Without the probe, each new endpoint that never answers took every
  slot it could get for one timeout, and a backlog grouped by destination (bulk submits,
  dead letters replayed endpoint by endpoint) met them one after another: 16 such
  endpoints with 10 jobs each held 100 jobs to a healthy destination for 16 timeouts at
  concurrency 8 (a fresh user's check). Not more than that, as TCP's slow start would: a
  healthy destination whose attempts take long (a slow AI call) would run a fraction of
  its slots for round trip after round trip; the probe costs it one slot for a second,
  and a quick destination one round trip;
* an attempt that ends **congested** halves the limit (down to 1) when another of the
  destination's last eight attempts ended congested too. Congested: it timed out (no
  complete answer within its timeout), or it failed after holding its slot for at least half
  the timeout (a 504 or a reset from a gateway that gave up just before the client). A lone
  one is a lost answer, not a sick destination (the demo's chaos proxy holds one answer in
  500: halving on each took a third of a healthy destination's slots away, and the protected
  pass took 47 % longer); an endpoint that stops answering ends every attempt congested, and
  one that hangs one attempt in ten has another in its last eight more often than not.
  Nor does it halve while fewer than :data:`CONGESTED_SHARE` of the destination's recent
  attempts ended congested (its endings over about one attempt timeout, exponentially
  weighted), when the worker says when attempts end: at the end of a drain, the few answers
  the network lost while thousands of others came back end one after the other, a timeout
  after they were sent, with nothing between them, so each had another in its last eight
  and a healthy destination fell to one attempt in flight (and was logged as timing out)
  just as its backlog ran out;
* each attempt that ends well adds ``1 / limit`` (one per round trip: additive increase), so
  a destination that hangs one attempt in ten settles at a few slots, not all, and one that
  recovers from 1 climbs back in about ``cap² / 2`` good attempts.

Destinations whose limit fell to a quarter of ``cap`` or less after being congested
("throttled") share at most half of the worker's slots between them (at least one): however
many endpoints stop answering, the others keep half the slots.

A destination that answers, but slowly (a model that takes ten seconds to answer), is not
sick and keeps its limit; but slots go to due jobs first come first served, so a backlog of
such jobs would hold every slot for as long as it lasts and the other destinations' jobs
would wait behind it. A destination whose attempts take :data:`SLOW` seconds or more (the
moving average of its last few, :data:`SLOW_WEIGHT`) is therefore **slow**, until that
average is under :data:`QUICK_AGAIN` seconds. The slow
destinations get their **fair share** of the slots (half of them together, at least one,
taking turns, each within its own limit) before anything else is claimed, and more only when
no other destination has a due job (the worker claims the other destinations' jobs first,
then gives the slow ones what is left). That is fair queuing in its simplest work-conserving
form: slow destinations alone keep every slot; beside others they keep half, however many
of them there are.

A limit is per worker (each process keeps its own); nothing is stored.
"""

from __future__ import annotations

import math

__all__ = ["CONGESTED_SHARE", "QUICK_AGAIN", "TIMED_OUT", "DestinationLimits", "congested"]

#: The transport errors that mean "no complete answer within the timeout" (see
#: :mod:`retrysafe.client._sender`): connecting, writing, waiting for a read, or the
#: attempt's total timeout. A pool timeout is the worker's own pool, not the destination.
TIMED_OUT = frozenset({"ConnectTimeout", "ReadTimeout", "WriteTimeout", "AttemptTimeout"})

def congested(
    error_type: str | None, status: int | None, duration: float, timeout: float
) -> bool:
    """Whether an attempt ended **congested** (module docstring): it timed out
    (:data:`TIMED_OUT`), or it failed — no answer, 429 or 5xx — after holding its slot for at
    least half of ``timeout`` (both in seconds). A slow success or a slow definitive 4xx is
    not: the destination answered."""
    if error_type in TIMED_OUT:
        return True
    failed = status is None or status == 429 or status >= 500
    return failed and duration >= timeout / 2


#: The share of a destination's recent endings that must be congested for a congested one to
#: halve its limit (module docstring): one in a hundred. A destination that hangs one attempt
#: in a hundred, each until a timeout, while the rest answer in milliseconds, already spends
#: most of its slots' time on hangs; lost answers (the demo's one in five hundred) stay below
#: it even at the end of a drain, where the recent endings are mostly lost ones (at most about
#: e times their share over the run: the answers that came back before are weighted down by
#: at most one timeout's decay).
CONGESTED_SHARE = 0.01

#: Destinations remembered with nothing in flight before the oldest are forgotten (they start
#: afresh): memory stays bounded whatever the number of hosts.
_REMEMBERED = 4096

#: Seconds an attempt to a **slow** destination takes, on average (module docstring): well
#: above an API's answer (tens of milliseconds) and a webhook receiver's, at a model's.
SLOW = 1.0

#: Seconds under which a **slow** destination's average must fall before it is quick again
#: (hysteresis): answers that straddle a second moved it in and out at every answer.
QUICK_AGAIN = SLOW / 2

#: The weight of each new attempt in a destination's moving average of attempt durations
#: (an exponentially weighted mean over about its last four attempts; a new destination's
#: first attempt is its average). So a destination known to answer quickly becomes slow
#: after about three slow attempts in a row, not at one lost answer held to the timeout,
#: and a new destination whose first attempt is slow is slow at once.
SLOW_WEIGHT = 0.25

#: The longest duration an attempt counts for in the average, in seconds: twice
#: :data:`SLOW`, so that one answer lost and held to the timeout (10 s by default) moves a
#: quick destination's average by half a second, not by two and a half (it made it slow at
#: once, and the quick answers beside it quick again milliseconds later: 69 log lines in 38 s
#: for one request in 150 lost, a fresh user's check). A destination whose attempts all take
#: longer still averages 2 s: slow. A slow one is quick again after about five quick answers.
_LONGEST = 2 * SLOW


class DestinationLimits:
    """The attempts in flight to each destination and each one's limit (module docstring).

    Args:
        cap: the highest limit of one destination, in attempts (>= 1).
        slots: the worker's concurrency (throttled destinations share half of it).

    One event loop uses an instance; nothing here blocks or awaits.
    """

    __slots__ = (
        "_down",
        "_halved",
        "_history",
        "_in_flight",
        "_limit",
        "_means",
        "_probes",
        "_recent",
        "_slow",
        "_throttled",
        "cap",
        "share",
        "throttle_at",
    )

    def __init__(self, cap: int, slots: int | None = None) -> None:
        self.cap = max(1, cap)
        #: A limit at or below this, after a congested attempt, is throttled.
        self.throttle_at = max(1, self.cap // 4)
        #: Slots the throttled destinations may hold together, and a slow destination's
        #: fair share: half the worker's, at least one.
        self.share = max(1, (slots if slots is not None else self.cap) // 2)
        self._in_flight: dict[str, int] = {}
        #: Each known destination's limit (a fraction between whole attempts).
        self._limit: dict[str, float] = {}
        #: The destinations whose limit was ever halved (only they can be throttled).
        self._halved: set[str] = set()
        #: The throttled destinations.
        self._throttled: set[str] = set()
        #: The destinations reported down (limit 1 after a congested attempt).
        self._down: set[str] = set()
        #: The last eight endings of each destination that had a congested one among them,
        #: one bit each (1: congested), the latest lowest.
        self._history: dict[str, int] = {}
        #: The moving average of attempt durations (seconds) of each destination that
        #: answered lately (see :data:`SLOW_WEIGHT`), and the slow ones among them.
        self._means: dict[str, float] = {}
        self._slow: set[str] = set()
        #: The destinations on probation with their probe in flight: when it started
        #: (seconds on the caller's clock), or None when the caller gave no time.
        self._probes: dict[str, float | None] = {}
        #: Each destination's recent endings, exponentially weighted (see
        #: :meth:`_congested_share`): [answered, congested, when last updated].
        self._recent: dict[str, list[float]] = {}

    def limit(self, destination: str) -> int:
        """``destination``'s adaptive limit of attempts in flight (``cap`` until its attempts
        end congested). While nothing is known of it, its probe allows one (:meth:`allows`)."""
        return int(self._limit.get(destination, self.cap))

    def allows(self, destination: str) -> int:
        """The most attempts ``destination`` may have in flight now: one while it is on
        probation (no attempt of it ended lately: module docstring), else :meth:`limit`."""
        if destination not in self._means:
            return 1
        return self.limit(destination)

    def in_flight(self, destination: str) -> int:
        """Attempts to ``destination`` started and not yet ended."""
        return self._in_flight.get(destination, 0)

    def _throttled_in_flight(self) -> int:
        return sum(self._in_flight.get(d, 0) for d in self._throttled)

    def allowance(self, destination: str) -> int:
        """How many more attempts to ``destination`` may start now (>= 0)."""
        room = self.allows(destination) - self._in_flight.get(destination, 0)
        if destination in self._throttled:
            room = min(room, self.share - self._throttled_in_flight())
        return max(0, room)

    def full(self) -> list[str]:
        """The destinations that may start no attempt now, sorted: a claim skips their jobs."""
        out = {d for d, n in self._in_flight.items() if n >= self.allows(d)}
        if self._throttled and self._throttled_in_flight() >= self.share:
            out |= self._throttled
        return sorted(out)

    def start(
        self, destination: str, *, force: bool = False, now: float | None = None
    ) -> bool:
        """Take a slot for an attempt to ``destination``; False (nothing taken) when it may
        start none now (give the job back unstarted). ``force``: take it whatever the limit
        (a caller that would otherwise leave a slot idle: reconcile). ``now``: seconds on a
        clock that does not go back, for :meth:`age_probes` (None: a probe of this start
        ends only with its attempt)."""
        if not force and self.allowance(destination) <= 0:
            return False
        self._in_flight[destination] = self._in_flight.get(destination, 0) + 1
        if destination not in self._means and destination not in self._probes:
            self._probes[destination] = now
        return True

    def start_beside_probe(self, destination: str, seconds_left: float) -> bool:
        """Take a slot for an attempt to ``destination`` beside its probe in flight when the
        attempt cannot wait for the probe: its deadline is ``seconds_left`` away, less than
        the :data:`SLOW` seconds a probe may take (without the probe it would have started
        at once). False, nothing taken: no probe in flight, or time enough to wait."""
        if destination not in self._probes or seconds_left >= SLOW:
            return False
        return self.start(destination, force=True)

    def probe_wait(self, now: float) -> float | None:
        """Seconds from ``now`` until the oldest probe in flight has taken :data:`SLOW`
        seconds (0 when one has), or None: no probe with a start time is in flight. A
        caller that waits longer than that should look again then (:meth:`age_probes`)."""
        if not self._probes:
            return None
        times = [t for t in self._probes.values() if t is not None]
        return max(0.0, min(times) + SLOW - now) if times else None

    def age_probes(self, now: float) -> None:
        """Probes in flight :data:`SLOW` seconds or more at ``now`` (the clock given to
        :meth:`start`): their destinations are known now, as slow ones (module docstring),
        and get their fair share of the slots instead of one."""
        if not self._probes:
            return
        for destination, since in list(self._probes.items()):
            if since is not None and now - since >= SLOW:
                del self._probes[destination]
                self._means[destination] = SLOW
                self._slow.add(destination)

    def answered(
        self,
        destination: str,
        *,
        congested: bool,
        now: float | None = None,
        window: float | None = None,
    ) -> str | None:
        """An attempt to ``destination`` ended (its slot is still taken): halve the limit if
        it was ``congested``, so was another of the last eight and, when ``now`` and
        ``window`` are given, at least :data:`CONGESTED_SHARE` of its recent endings; raise
        it if it was not (module docstring).

        Args:
            now: when the attempt ended, in seconds on any clock that does not go back (the
                worker's ``time.monotonic()``); None: the share is not looked at.
            window: the attempt timeout in seconds: endings older than about that weigh
                less (exponentially: by ``1/e`` per window).

        Returns:
            ``"down"`` when a congested attempt left the limit at 1 (once, until it climbs
            back), ``"up"`` when the limit climbed back to ``cap`` after that, else None
            (what a worker logs).
        """
        share = 1.0
        if now is not None and window is not None:
            share = self._congested_share(destination, congested, now, window)
        limits, history = self._limit, self._history
        old = limits.get(destination)
        seen = history.get(destination, 0)
        if not congested and not seen and (old is None or old >= self.cap):
            return None  # at the cap already (every attempt of a healthy destination)
        bits = ((seen << 1) | congested) & 0xFF
        if bits:
            history[destination] = bits
        else:
            history.pop(destination, None)
        if old is None:
            old = float(self.cap)
            if len(limits) >= _REMEMBERED:
                self._forget()
        halved = congested and seen and share >= CONGESTED_SHARE
        if halved:
            new = max(1.0, float(int(old) // 2))
            self._halved.add(destination)
        elif congested:
            new = old  # a lone one, or a rare one: remembered, not acted on
        else:
            new = min(float(self.cap), old + 1.0 / max(1.0, old))
        limits[destination] = new
        if destination in self._halved and int(new) <= self.throttle_at:
            self._throttled.add(destination)
        else:
            self._throttled.discard(destination)
        if halved and int(new) == 1 and destination not in self._down:
            self._down.add(destination)
            return "down"
        if not congested and new >= self.cap and destination in self._down:
            self._down.discard(destination)
            return "up"
        return None

    def _congested_share(
        self, destination: str, congested: bool, now: float, window: float
    ) -> float:
        """Count one ending of ``destination`` at ``now`` among its recent endings (weighted
        by ``exp(-age / window)``) and return the share of them that ended congested (0–1).
        A ``now`` that is not later than the last one (NaN, a clock that went back) weighs
        nothing down."""
        recent = self._recent.get(destination)
        if recent is None:
            if len(self._recent) >= _REMEMBERED:
                for idle in [d for d in self._recent if d not in self._in_flight]:
                    del self._recent[idle]
            recent = self._recent[destination] = [0.0, 0.0, now]
        else:
            elapsed = now - recent[2]
            if elapsed > 0 and window > 0:
                decay = math.exp(-elapsed / window)
                recent[0] *= decay
                recent[1] *= decay
                recent[2] = now
        recent[1 if congested else 0] += 1.0
        return recent[1] / (recent[0] + recent[1])

    def took(self, destination: str, seconds: float) -> None:
        """An attempt to ``destination`` held its slot ``seconds``: update its moving average
        and whether it is slow (module docstring). A duration that is not a number is not
        counted."""
        self._probes.pop(destination, None)
        if not seconds >= 0:  # NaN, or a clock that went back
            return
        seconds = min(seconds, _LONGEST)
        means = self._means
        mean = means.get(destination)
        if mean is None:
            if len(means) >= _REMEMBERED:
                for idle in [d for d in means if d not in self._in_flight]:
                    del means[idle]
                    self._slow.discard(idle)
            mean = seconds
        else:
            mean += SLOW_WEIGHT * (seconds - mean)
        means[destination] = mean
        if mean >= SLOW:
            self._slow.add(destination)
        elif mean < QUICK_AGAIN:
            self._slow.discard(destination)

    def slow(self) -> list[str]:
        """The slow destinations, sorted."""
        return sorted(self._slow)

    def slow_room(self) -> int:
        """How many more attempts the slow destinations may start together within their fair
        share of the slots (half of them, at least one; >= 0): what they are given, each
        within its own :meth:`allowance`, before the other destinations' jobs are claimed."""
        held = sum(self._in_flight.get(d, 0) for d in self._slow)
        return max(0, self.share - held)

    def end(self, destination: str) -> None:
        """Give back the slot :meth:`start` took for ``destination``."""
        n = self._in_flight.get(destination, 0) - 1
        if n > 0:
            self._in_flight[destination] = n
        else:
            self._in_flight.pop(destination, None)
            self._probes.pop(destination, None)  # given back before it ended: probe anew

    def _forget(self) -> None:
        """Drop the oldest half of the destinations with nothing in flight."""
        for destination in list(self._limit):
            if len(self._limit) <= _REMEMBERED // 2:
                break
            if destination not in self._in_flight:
                del self._limit[destination]
                self._history.pop(destination, None)
                self._recent.pop(destination, None)
                self._halved.discard(destination)
                self._throttled.discard(destination)
                self._down.discard(destination)
