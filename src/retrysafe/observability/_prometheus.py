"""Prometheus metrics for retrysafe (``pip install 'retrysafe[metrics]'``).

:class:`Prometheus` is a :class:`~retrysafe.observability.Telemetry`: pass it as ``telemetry=``
and every report becomes a counter or histogram on its registry. Names follow Prometheus'
conventions (``retrysafe_…_total`` for counters, base units, ``_seconds``) and labels stay low
in cardinality: a decision, an outcome class, a status class, a queue, an operation, a store
kind, a webhook endpoint id — never an idempotency key, a job id or a URL.

Values that live in the store (jobs by state, the age of the oldest PENDING and UNKNOWN job,
webhook endpoints disabled, the dead-letter queue's size) are read from the store when
scraped, by :class:`~retrysafe.observability.StoreCollector`, so several worker processes
report one truth.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.observability._telemetry import BaseTelemetry, status_class

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from retrysafe.client._models import Attempt

__all__ = ["LATENCY_BUCKETS", "Prometheus", "prometheus_client"]

#: Histogram buckets (seconds) for store operations, requests and attempts: 0.5 ms to 60 s.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
)


def prometheus_client() -> Any:
    """The ``prometheus_client`` module.

    Raises:
        ConfigurationError: it is not installed (``pip install 'retrysafe[metrics]'``).
    """
    try:
        import prometheus_client as prom
    except ImportError:
        raise ConfigurationError(
            "metrics need prometheus-client: pip install 'retrysafe[metrics]'",
            option="metrics",
        ) from None
    return prom


class _Families:
    """The metric families of one registry (made once per registry: a second
    :class:`Prometheus` on the same registry shares them instead of failing as a duplicate)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        prom = prometheus_client()
        counter, histogram = prom.Counter, prom.Histogram
        r = registry
        self.decisions = counter(
            "retrysafe_server_decisions",
            "Protected requests by the middleware's decision (new, replayed, key-reused, "
            "in-progress, taken-over, released, fenced, store-unavailable, unkeyed, ...).",
            ["decision"], registry=r,
        )
        self.request_seconds = histogram(
            "retrysafe_server_request_duration_seconds",
            "Seconds a protected request spent in the middleware, handler included, by "
            "decision.",
            ["decision"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.events = counter(
            "retrysafe_server_events",
            "Middleware events beside a request's decision (client-gone, lease-lost, "
            "max-run-time, stored-late).",
            ["event"], registry=r,
        )
        self.renewals = counter(
            "retrysafe_server_lease_renewals",
            "Lease renewals of running handlers: renewed, lost (taken over) or failed "
            "(the store raised).",
            ["result"], registry=r,
        )
        self.store_seconds = histogram(
            "retrysafe_store_operation_duration_seconds",
            "Latency of one store operation, by store kind and operation.",
            ["store", "operation"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.store_errors = counter(
            "retrysafe_store_operation_errors",
            "Store operations that raised, by store kind, operation and error class "
            "(unavailable, error).",
            ["store", "operation", "error"], registry=r,
        )
        self.attempts = counter(
            "retrysafe_outbox_attempts",
            "Recorded outbox attempts by queue, outcome class (SPEC 5) and HTTP status class.",
            ["queue", "outcome", "status_class"], registry=r,
        )
        self.attempt_seconds = histogram(
            "retrysafe_outbox_attempt_duration_seconds",
            "Seconds from an attempt's first byte sent to its answer (or failure), by queue "
            "and outcome class.",
            ["queue", "outcome"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.transitions = counter(
            "retrysafe_outbox_job_transitions",
            "Jobs moved by a recorded attempt, by queue and the state they moved to.",
            ["queue", "state"], registry=r,
        )
        self.deferrals = counter(
            "retrysafe_outbox_budget_deferrals",
            "Retries deferred by the per-destination retry budget (deferred, not dropped).",
            ["queue"], registry=r,
        )
        self.reconciled = counter(
            "retrysafe_outbox_reconcile_results",
            "Reconcile attempts by the state the job ended in.",
            ["queue", "state"], registry=r,
        )
        self.deliveries = counter(
            "retrysafe_webhook_deliveries",
            "Webhook delivery attempts by endpoint id and outcome (delivered, retrying, "
            "failed, cancelled).",
            ["endpoint_id", "outcome"], registry=r,
        )
        self.disabled = counter(
            "retrysafe_webhook_endpoints_disabled",
            "Webhook endpoints disabled automatically, by reason (gone, failures).",
            ["reason"], registry=r,
        )
        self.agent_calls = counter(
            "retrysafe_agent_write_calls",
            "Agent write-tool calls by outcome (executed, replayed, unknown).",
            ["tool", "outcome"], registry=r,
        )
        self.refusals = counter(
            "retrysafe_agent_budget_refusals",
            "Agent calls refused by a budget (steps, attempts).",
            ["kind"], registry=r,
        )


_FAMILIES: weakref.WeakKeyDictionary[Any, _Families] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _families(registry: Any) -> _Families:
    with _LOCK:
        found = _FAMILIES.get(registry)
        if found is None:
            try:
                found = _Families(registry)
            except ValueError as exc:  # a name already registered by something else
                raise ConfigurationError(
                    f"cannot register retrysafe's metrics on this registry: {exc}",
                    option="registry",
                ) from None
            _FAMILIES[registry] = found
        return found


class _Children:
    """Label children of one family, cached by label values (``labels()`` takes a lock and
    builds a tuple each call; a dict lookup is a fraction of that)."""

    __slots__ = ("_cache", "_family")

    def __init__(self, family: Any) -> None:
        self._family = family
        self._cache: dict[Any, Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._family.labels(*values)
        return child


class Prometheus(BaseTelemetry):
    """retrysafe's Prometheus metrics on ``registry``.

    Pass it as ``telemetry=`` to the middleware, the gateway, the outbox worker, reconcile,
    the webhook worker or an agent run; serve the registry with
    :func:`~retrysafe.observability.serve_metrics`, :func:`metrics_asgi_app` /
    :func:`metrics_wsgi_app`, or your own ``/metrics``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (default: the global
            ``prometheus_client.REGISTRY``). Several ``Prometheus`` on one registry share its
            metric families.

    Raises:
        ConfigurationError: prometheus-client is not installed; ``registry`` is not a
            registry, or already holds a metric of the same name from elsewhere.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        prom = prometheus_client()
        if registry is None:
            registry = prom.REGISTRY
        elif not isinstance(registry, prom.CollectorRegistry):
            raise ConfigurationError(
                f"registry must be a prometheus_client.CollectorRegistry, not "
                f"{type(registry).__name__}",
                option="registry",
            )
        self.registry = registry
        f = self._f = _families(registry)
        self._decisions = _Children(f.decisions)
        self._request_seconds = _Children(f.request_seconds)
        self._events = _Children(f.events)
        self._renewals = _Children(f.renewals)
        self._store_seconds = _Children(f.store_seconds)
        self._store_errors = _Children(f.store_errors)
        self._attempts = _Children(f.attempts)
        self._attempt_seconds = _Children(f.attempt_seconds)
        self._transitions = _Children(f.transitions)
        self._deferrals = _Children(f.deferrals)
        self._reconciled = _Children(f.reconciled)
        self._deliveries = _Children(f.deliveries)
        self._disabled = _Children(f.disabled)
        self._agent_calls = _Children(f.agent_calls)
        self._refusals = _Children(f.refusals)
        self._per_decision: dict[str, tuple[Any, Any]] = {}
        self._per_operation: dict[tuple[str, str], Any] = {}

    def __repr__(self) -> str:
        return f"Prometheus(registry={self.registry!r})"

    # -- server
    def server_decision(
        self,
        decision: str,
        *,
        method: str,
        path: str,
        status: int,
        seconds: float,
        key_hash: str,
    ) -> None:
        pair = self._per_decision.get(decision)
        if pair is None:  # the hot path: one dict lookup for both samples
            pair = self._per_decision[decision] = (
                self._decisions(decision).inc,
                self._request_seconds(decision).observe,
            )
        pair[0]()
        pair[1](seconds)

    def server_event(self, event: str) -> None:
        self._events(event).inc()

    def lease_renewal(self, result: str) -> None:
        self._renewals(result).inc()

    def store_operation(
        self, store: str, operation: str, seconds: float, error: str | None
    ) -> None:
        observe = self._per_operation.get((store, operation))
        if observe is None:
            observe = self._per_operation[(store, operation)] = self._store_seconds(
                store, operation
            ).observe
        observe(seconds)
        if error is not None:
            self._store_errors(store, operation, error).inc()

    # -- outbox
    def attempt_recorded(self, queue: str, method: str, attempt: Attempt, state: str) -> None:
        outcome = attempt.outcome
        self._attempts(queue, outcome, status_class(attempt.status)).inc()
        self._attempt_seconds(queue, outcome).observe(attempt.duration)
        self._transitions(queue, state).inc()

    def budget_deferral(self, queue: str) -> None:
        self._deferrals(queue).inc()

    def reconciled(self, queue: str, state: str) -> None:
        self._reconciled(queue, state).inc()

    # -- webhooks
    def webhook_delivery(self, endpoint_id: str, outcome: str) -> None:
        self._deliveries(endpoint_id, outcome).inc()

    def endpoint_disabled(self, reason: str) -> None:
        self._disabled(reason).inc()

    # -- agents
    def agent_call(self, tool: str, outcome: str, seconds: float, key: str) -> None:
        self._agent_calls(tool, outcome).inc()

    def budget_refusal(self, kind: str) -> None:
        self._refusals(kind).inc()
