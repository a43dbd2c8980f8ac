"""What the store knows, read at scrape time: jobs by state, backlog ages, the webhook
dead-letter queue and endpoints, and whether the store answers at all.

A counter in one worker process only knows that process's work; a job's state is one truth in
the store, so the gauges below are read from it when Prometheus scrapes (one grouped statement
for the outbox, one for webhook endpoints). A store that is down does not fail the scrape:
``retrysafe_store_up`` is 0 and the store's other gauges are absent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.client._models import JobState
from retrysafe.observability._prometheus import prometheus_client
from retrysafe.observability._timed import store_kind

__all__ = ["AGED_STATES", "StoreCollector", "disabled_reason_class"]

log = logging.getLogger("retrysafe.metrics")

#: States whose oldest job's age is exported: the backlog (PENDING), work held by a worker
#: (IN_FLIGHT) and the dead letters waiting for reconcile (UNKNOWN).
AGED_STATES = (JobState.PENDING, JobState.IN_FLIGHT, JobState.UNKNOWN)
_WEBHOOKS_QUEUE = "webhooks"
_DEFAULT_QUEUE = "default"
_DEAD_LETTERS = (JobState.UNKNOWN, JobState.REJECTED)


def disabled_reason_class(reason: str | None) -> str:
    """The ``reason`` label of a disabled webhook endpoint: ``gone`` (the receiver answered
    410), ``failures`` (disabled after consecutive failures), ``registered`` (created
    disabled), or ``operator`` (disabled by hand, whatever it says)."""
    from retrysafe.webhooks._delivery import FAILURES_REASON, GONE_REASON

    text = reason or ""
    if text.startswith(GONE_REASON):
        return "gone"
    if FAILURES_REASON in text:
        return "failures"
    if text == "registered disabled":
        return "registered"
    return "operator"


class _Source:
    """One store a collector reads: opened from its URL on first use (in the reading thread;
    a store that is down at start-up is only reported down), read by at most one thread at
    a time."""

    def __init__(self, name: str, store: Any) -> None:
        self.name = name
        self._url = store if isinstance(store, str) else None
        self._store = None if isinstance(store, str) else store
        self._owned: Any = None
        self._busy = threading.Lock()  # held by the read in flight, if any

    def close(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None:
            with contextlib.suppress(Exception):
                owned.close()

    def _opened(self) -> Any:
        if self._store is not None:
            return self._store
        if self._owned is None:
            from retrysafe.stores import open_store

            assert self._url is not None
            # Never create anything: a scrape of a missing store reports it down.
            sql = self._url.split(":", 1)[0].lower() in ("sqlite", "postgresql", "postgres")
            self._owned = open_store(self._url, **({"create": False} if sql else {}))
        return self._owned

    def start(self, clock: Any) -> tuple[threading.Event, list[tuple[bool, Any]]] | None:
        """Start this scrape's read in its own thread: ``(done, box)``, the box holding
        ``(True, (job rows or None, endpoint counts or None))`` or ``(False, why)`` once done
        is set; None when the previous scrape's read has not returned yet (the store is then
        reported down at once, instead of piling up more reads on it)."""
        if not self._busy.acquire(blocking=False):
            return None
        done = threading.Event()
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, _read(self._opened(), clock)))
            except Exception as exc:
                box.append((False, repr(exc)))
            finally:
                self._busy.release()
                done.set()

        threading.Thread(target=run, name=f"retrysafe-scrape-{self.name}", daemon=True).start()
        return done, box


_GAUGES = (
    ("retrysafe_store_up", "1 when the store answered this scrape's reads in time, else 0.",
     ("store",)),
    ("retrysafe_store_scrape_duration_seconds",
     "Seconds the store took to answer this scrape's reads (the timeout when it did not).",
     ("store",)),
    ("retrysafe_outbox_jobs",
     "Outbox jobs by queue and state (read from the store at scrape time).",
     ("store", "queue", "state")),
    ("retrysafe_outbox_oldest_job_age_seconds",
     "Seconds since the oldest job in this queue and state was created (0: none).",
     ("store", "queue", "state")),
    ("retrysafe_webhook_dead_letters",
     "Webhook deliveries in the dead-letter queue (UNKNOWN or REJECTED).", ("store",)),
    ("retrysafe_webhook_endpoints",
     "Webhook endpoints by state (enabled, disabled) and why disabled (gone, failures, "
     "registered, operator).", ("store", "state", "reason")),
)  # fmt: skip


class StoreCollector:
    """A Prometheus collector that reads retrysafe's stores at each scrape.

    Gauges, each labelled ``store`` (the store's name): ``retrysafe_store_up`` (1 when the
    store answered this scrape's reads within ``timeout``), ``retrysafe_store_scrape_duration_
    seconds``, and on stores with an outbox ``retrysafe_outbox_jobs{queue,state}``,
    ``retrysafe_outbox_oldest_job_age_seconds{queue,state}`` (seconds since the oldest
    PENDING, IN_FLIGHT or UNKNOWN job was created; 0 when there is none; the ``default`` queue
    is always reported), ``retrysafe_webhook_dead_letters`` (webhook deliveries UNKNOWN or
    REJECTED) and ``retrysafe_webhook_endpoints{state,reason}``. A key store (Redis, memory)
    reports ``retrysafe_store_up`` only, probed with one read.

    A store that is down, locked or slow never fails or stalls the scrape: the stores are read
    at once, and after ``timeout`` seconds one that has not answered is reported
    ``retrysafe_store_up 0`` (its other gauges absent) and a warning
    is logged; the read that did not return goes on in its thread, and later scrapes report
    the store down at once until it returns.

    Args:
        store: a store object or URL, or a mapping ``{name: store or URL}`` to read several
            (one collector per registry: the families are shared). A URL is opened at the
            first scrape, never created, and closed by :meth:`close`; a store object is the
            caller's to close.
        registry: where to register (default: none; call ``registry.register(collector)``);
            :func:`~retrysafe.observability.serve_metrics` registers it for you.
        clock: Unix-seconds clock (ages on SQLite are measured with it).
        timeout: seconds a scrape waits for each store (default 5, under Prometheus' default
            scrape timeout of 10 s).

    Raises:
        ConfigurationError: prometheus-client is missing; an empty mapping, a name that is not
            a string, a timeout that is not positive; the registry already has these gauges
            (a second collector: pass several stores to one instead).
    """

    def __init__(
        self,
        store: Any,
        *,
        registry: Any = None,
        clock: Any = time.time,
        timeout: float = 5.0,
    ) -> None:
        self._prom = prometheus_client()
        if isinstance(store, Mapping):
            if not store or not all(isinstance(k, str) and k for k in store):
                raise ConfigurationError(
                    "store must be a store, a URL, or a non-empty {name: store} mapping",
                    option="store",
                )
            self._sources = [_Source(name, s) for name, s in store.items()]
        else:
            self._sources = [_Source(store_kind(store), store)]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout < float("inf")
        ):
            raise ConfigurationError(f"timeout must be positive seconds, not {timeout!r}",
                                     option="timeout")  # fmt: skip
        self._timeout = float(timeout)
        self._clock = clock
        if registry is not None:
            try:
                registry.register(self)
            except ValueError as exc:
                raise ConfigurationError(
                    f"cannot register the store collector: {exc} (one StoreCollector per "
                    "registry: give it a {name: store} mapping to read several stores)",
                    option="registry",
                ) from None

    def close(self) -> None:
        """Close the stores this collector opened from URLs. Idempotent."""
        for source in self._sources:
            source.close()

    def describe(self) -> list[Any]:
        """The gauge names, without touching a store (so a registry refuses a second
        collector of the same names instead of serving a broken exposition)."""
        from prometheus_client.core import GaugeMetricFamily

        return [GaugeMetricFamily(name, doc, labels=list(labels)) for name, doc, labels in _GAUGES]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        fam = {
            name: GaugeMetricFamily(name, doc, labels=list(labels))
            for name, doc, labels in _GAUGES
        }
        # Every store is read at once, all within one timeout (not one timeout each).
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._timeout
        reads = [(source, source.start(self._clock)) for source in self._sources]
        for source, started in reads:
            ok: bool = False
            found: Any = "the previous scrape's read of this store has not returned yet"
            if started is not None:
                done, box = started
                done.wait(max(0.0, deadline - time.monotonic()))
                if box:
                    ok, found = box[0]
                else:
                    found = f"no answer within {self._timeout:g} s"
            fam["retrysafe_store_up"].add_metric([source.name], 1.0 if ok else 0.0)
            fam["retrysafe_store_scrape_duration_seconds"].add_metric(
                [source.name], time.perf_counter() - t0
            )
            if not ok:
                log.warning("metrics scrape: store %s did not answer: %s", source.name, found)
                continue
            rows, endpoints = found
            if rows is not None:
                _add_jobs(fam, source.name, rows, endpoints is not None)
            if endpoints is not None:
                for (state, reason), n in sorted(endpoints.items()):
                    fam["retrysafe_webhook_endpoints"].add_metric(
                        [source.name, state, reason], float(n)
                    )
        yield from (f for f in fam.values() if f.samples)


def _read(store: Any, clock: Any) -> tuple[Any, Any]:
    """What one scrape reads of ``store``: job rows and endpoint counts (None when the
    store has no outbox / no webhooks; a key store is probed with one read)."""
    from retrysafe.client._store import SQLOutboxStore, outbox_store

    try:
        outbox = outbox_store(store)
    except ConfigurationError:
        outbox = None
    if not isinstance(outbox, SQLOutboxStore):
        probe = getattr(store, "get", None)
        if probe is None:
            raise ConfigurationError(f"cannot probe store {store!r}", option="store")
        probe("0" * 64)  # a key store: one read says it answers
        return None, None
    return outbox.job_stats(now=clock()), _endpoints(store)


def _add_jobs(fam: dict[str, Any], name: str, rows: Any, webhooks: bool) -> None:
    by_queue: dict[str, dict[JobState, tuple[int, float]]] = {}
    for queue, state, n, age in rows:
        by_queue.setdefault(queue, {})[state] = (n, age)
    by_queue.setdefault(_DEFAULT_QUEUE, {})  # always there, so alerts never see "absent"
    dead = 0
    for queue in sorted(by_queue):
        seen = by_queue[queue]
        for state in JobState:
            n, age = seen.get(state, (0, 0.0))
            fam["retrysafe_outbox_jobs"].add_metric([name, queue, state.value], float(n))
            if state in AGED_STATES:
                fam["retrysafe_outbox_oldest_job_age_seconds"].add_metric(
                    [name, queue, state.value], age
                )
            if queue == _WEBHOOKS_QUEUE and state in _DEAD_LETTERS:
                dead += n
    if webhooks:
        fam["retrysafe_webhook_dead_letters"].add_metric([name], float(dead))


def _endpoints(store: Any) -> dict[tuple[str, str], int] | None:
    """Endpoint counts by (state, reason), or None for a store without webhooks."""
    from retrysafe.webhooks._store import webhook_store

    try:
        hooks = webhook_store(store)
    except ConfigurationError:
        return None
    counts: dict[tuple[str, str], int] = {("enabled", ""): 0}
    for endpoint in hooks.list_endpoints():
        if endpoint.enabled:
            label = ("enabled", "")
        else:
            label = ("disabled", disabled_reason_class(endpoint.disabled_reason))
        counts[label] = counts.get(label, 0) + 1
    return counts

