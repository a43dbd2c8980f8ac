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
from collections.abc import Iterator
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
    text = (reason or "").lower()
    if text.startswith("410"):
        return "gone"
    if "consecutive failed" in text:
        return "failures"
    if text == "registered disabled":
        return "registered"
    return "operator"


class StoreCollector:
    """A Prometheus collector that reads retrysafe's store at each scrape.

    Gauges: ``retrysafe_store_up{store}`` (1 when the store answered this scrape),
    ``retrysafe_store_scrape_duration_seconds{store}``, and on stores with an outbox
    ``retrysafe_outbox_jobs{queue,state}``, ``retrysafe_outbox_oldest_job_age_seconds{queue,
    state}`` (seconds since the oldest PENDING, IN_FLIGHT or UNKNOWN job was created; 0 when
    there is none), ``retrysafe_webhook_dead_letters`` (webhook deliveries UNKNOWN or
    REJECTED) and ``retrysafe_webhook_endpoints{state,reason}``. A key store (Redis, memory)
    reports ``retrysafe_store_up`` only, probed with one read.

    Args:
        store: a store object or URL (a URL is opened here and closed by :meth:`close`).
        registry: where to register (default: none; call ``registry.register(collector)``);
            :func:`~retrysafe.observability.serve_metrics` registers it for you.
        clock: Unix-seconds clock (ages on SQLite are measured with it).

    Raises:
        ConfigurationError: prometheus-client is missing; a malformed store URL.
    """

    def __init__(
        self, store: Any, *, registry: Any = None, clock: Any = time.time
    ) -> None:
        self._prom = prometheus_client()
        self._owned: Any = None
        if isinstance(store, str):
            from retrysafe.stores import open_store

            self._owned = store = open_store(store)
        self._store: Any = store
        self._lock = threading.Lock()
        self._clock = clock
        self.kind = store_kind(store)
        if registry is not None:
            registry.register(self)

    def close(self) -> None:
        """Close the store this collector opened from a URL. Idempotent."""
        owned, self._owned = self._owned, None
        if owned is not None:
            with contextlib.suppress(Exception):
                owned.close()

    def describe(self) -> list[Any]:
        # Nothing at registration time: collect() must not run (and touch the store) then.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily as gauge
        up = gauge("retrysafe_store_up", "1 when the store answered this scrape, else 0.",
                   labels=["store"])
        took = gauge("retrysafe_store_scrape_duration_seconds",
                     "Seconds the store took to answer this scrape's reads.", labels=["store"])
        t0 = time.perf_counter()
        families: list[Any] = []
        with self._lock:  # scrapes in parallel would only queue on the store
            try:
                families = self._read(gauge)
                ok = True
            except Exception as exc:  # the scrape answers; the store is reported down
                log.warning("metrics scrape: the store did not answer: %r", exc)
                ok = False
        up.add_metric([self.kind], 1.0 if ok else 0.0)
        took.add_metric([self.kind], time.perf_counter() - t0)
        yield up
        yield took
        yield from families

    def _read(self, gauge: Any) -> list[Any]:
        store = self._store
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
            return []
        rows = outbox.job_stats(now=self._clock())
        jobs = gauge("retrysafe_outbox_jobs", "Outbox jobs by queue and state (read from "
                     "the store at scrape time).", labels=["queue", "state"])
        ages = gauge("retrysafe_outbox_oldest_job_age_seconds",
                     "Seconds since the oldest job in this queue and state was created "
                     "(0: none); alert on state=\"unknown\" and state=\"pending\".",
                     labels=["queue", "state"])
        by_queue: dict[str, dict[JobState, tuple[int, float]]] = {}
        for queue, state, n, age in rows:
            by_queue.setdefault(queue, {})[state] = (n, age)
        by_queue.setdefault(_DEFAULT_QUEUE, {})  # always there, so alerts never see "absent"
        dead = 0
        for queue in sorted(by_queue):
            seen = by_queue[queue]
            for state in JobState:
                n, age = seen.get(state, (0, 0.0))
                jobs.add_metric([queue, state.value], float(n))
                if state in AGED_STATES:
                    ages.add_metric([queue, state.value], age)
                if queue == _WEBHOOKS_QUEUE and state in _DEAD_LETTERS:
                    dead += n
        out = [jobs, ages]
        endpoints = _endpoints(store)
        if endpoints is not None:
            dlq = gauge("retrysafe_webhook_dead_letters",
                        "Webhook deliveries in the dead-letter queue (UNKNOWN or REJECTED).")
            dlq.add_metric([], float(dead))
            ep = gauge("retrysafe_webhook_endpoints",
                       "Webhook endpoints by state (enabled, disabled) and why disabled "
                       "(gone, failures, registered, operator).", labels=["state", "reason"])
            for (ep_state, reason), n in sorted(endpoints.items()):
                ep.add_metric([ep_state, reason], float(n))
            out += [dlq, ep]
        return out


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

