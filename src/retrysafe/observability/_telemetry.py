"""The telemetry seam: what retrysafe's parts report, and to whom.

Every instrumented part (the middleware's engine, the outbox worker and reconcile, webhook
delivery, agent tool calls) holds one :class:`Telemetry` or None and calls the methods below
at the points where it already decides something (the engine's decision line, the worker's
recorded attempt). A part with None does nothing more than today: the hot path pays one
``is not None`` test. :class:`~retrysafe.observability.Prometheus` and
:class:`~retrysafe.observability.OpenTelemetry` implement the seam; :func:`telemetry_of` combines
several.

Vocabulary (retrysafe's own convention; no semantic convention exists for idempotency):

* server decisions, one per request, by the engine's final decision: ``new`` (the handler ran
  on a fresh claim and its answer was stored), ``taken-over`` (ran after taking over an
  expired lease, stored), ``replayed``, ``replay-unavailable``, ``key-reused``,
  ``in-progress``, ``released`` (ran, answered "not done": the key was released),
  ``fenced``, ``outcome-unknown``, ``store-unavailable``, ``unrecorded`` (the answer could not
  be recorded in time: 503), ``store-failed``, ``unkeyed``, ``missing-key``, ``invalid-key``,
  ``body-too-large``, ``fail-open``, ``disconnect``;
* server events, beside the decision: ``client-gone``, ``lease-lost``, ``max-run-time``,
  ``stored-late``;
* lease renewals: ``renewed``, ``lost`` (the key was taken over), ``failed`` (the store
  raised; the next heartbeat tries again).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from retrysafe.client._models import Attempt, Job
    from retrysafe.client._sender import SendResult

__all__ = [
    "EVENTS",
    "AttemptTrace",
    "BaseTelemetry",
    "Telemetry",
    "decision_label",
    "status_class",
    "telemetry_of",
]

#: Engine lines that are events beside a request's decision, not its decision.
EVENTS = frozenset(
    {"answered-early", "client-gone", "lease-lost", "max-run-time", "stored-late", "renewal-failed"}
)


def decision_label(decision: str, claim: str | None) -> str:
    """The metric/span name of an engine decision line: ``stored`` becomes ``new`` or
    ``taken-over`` (by how the key was claimed), ``replay`` becomes ``replayed``."""
    if decision == "stored":
        return "taken-over" if claim == "takeover" else "new"
    if decision == "replay":
        return "replayed"
    return decision


def status_class(status: int | None) -> str:
    """``"2xx"`` … ``"5xx"`` for an HTTP status, ``"none"`` without an answer."""
    if not status or status < 100 or status > 599:
        return "none"
    return f"{status // 100}xx"


class AttemptTrace(Protocol):
    """One attempt's trace, opened before it is sent and ended with its result (a small
    object per attempt that dies with it)."""

    def headers(self) -> Sequence[tuple[str, str]]:
        """Headers to send with the attempt (W3C ``traceparent`` / ``tracestate``)."""
        ...

    def end(self, result: SendResult) -> None:
        """The attempt is over: its status, outcome class and error."""
        ...

    def cancelled(self) -> None:
        """The attempt was cancelled while in flight (worker stopping): it ends without a
        result, and its effect may have happened."""
        ...


class Telemetry(Protocol):
    """What instrumented parts report. Every method is cheap and never raises."""

    # -- server (the middleware's engine and the gateway)
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
        """One request's final decision (the vocabulary above; already labelled by
        :func:`decision_label`) after ``seconds`` in the middleware."""
        ...

    def server_event(self, event: str) -> None:
        """An engine event beside the decision (``client-gone``, ``lease-lost``, …)."""
        ...

    def lease_renewal(self, result: str) -> None:
        """A heartbeat's renewal: ``renewed``, ``lost`` or ``failed``."""
        ...

    def store_operation(
        self, store: str, operation: str, seconds: float, error: str | None
    ) -> None:
        """One store call: its kind (``sqlite``, ``postgresql``, ``redis``, ``memory``), the
        operation's name, its latency, and ``None`` or the error class (``unavailable``,
        ``error``)."""
        ...

    # -- outbox
    def job_submitted(self, queue: str, method: str, url: str) -> Sequence[tuple[str, str]]:
        """A job is being submitted: headers to store with it (its trace context), or ()."""
        ...

    def attempt_started(self, job: Job) -> AttemptTrace | None:
        """An attempt of ``job`` is about to be sent."""
        ...

    def attempt_recorded(self, queue: str, method: str, attempt: Attempt, state: str) -> None:
        """An attempt was recorded; ``state`` is the job's next state (``pending``, …)."""
        ...

    def budget_deferral(self, queue: str) -> None:
        """A retry was deferred by the per-destination retry budget (not an attempt)."""
        ...

    def reconciled(self, queue: str, state: str) -> None:
        """A reconcile attempt ended with the job in ``state``."""
        ...

    # -- webhooks
    def webhook_delivery(self, endpoint_id: str, outcome: str) -> None:
        """A delivery attempt to ``endpoint_id``: ``delivered``, ``retrying``, ``failed``
        (dead-lettered) or ``cancelled``."""
        ...

    def endpoint_disabled(self, reason: str) -> None:
        """An endpoint was disabled automatically (``gone``, ``failures``)."""
        ...

    # -- agents
    def agent_call(self, tool: str, outcome: str, seconds: float, key: str) -> None:
        """A write tool call ended: ``executed``, ``replayed`` or ``unknown``."""
        ...

    def budget_refusal(self, kind: str) -> None:
        """An agent call was refused by its budget (``steps``, ``attempts``)."""
        ...


class BaseTelemetry:
    """Every :class:`Telemetry` method as a no-op; implementations override what they
    report."""

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
        return None

    def server_event(self, event: str) -> None:
        return None

    def lease_renewal(self, result: str) -> None:
        return None

    def store_operation(
        self, store: str, operation: str, seconds: float, error: str | None
    ) -> None:
        return None

    def job_submitted(self, queue: str, method: str, url: str) -> Sequence[tuple[str, str]]:
        return ()

    def attempt_started(self, job: Job) -> AttemptTrace | None:
        return None

    def attempt_recorded(self, queue: str, method: str, attempt: Attempt, state: str) -> None:
        return None

    def budget_deferral(self, queue: str) -> None:
        return None

    def reconciled(self, queue: str, state: str) -> None:
        return None

    def webhook_delivery(self, endpoint_id: str, outcome: str) -> None:
        return None

    def endpoint_disabled(self, reason: str) -> None:
        return None

    def agent_call(self, tool: str, outcome: str, seconds: float, key: str) -> None:
        return None

    def budget_refusal(self, kind: str) -> None:
        return None


class _Traces:
    """Several attempt traces as one."""

    __slots__ = ("_traces",)

    def __init__(self, traces: list[AttemptTrace]) -> None:
        self._traces = traces

    def headers(self) -> Sequence[tuple[str, str]]:
        return [h for t in self._traces for h in t.headers()]

    def end(self, result: SendResult) -> None:
        for t in self._traces:
            t.end(result)

    def cancelled(self) -> None:
        for t in self._traces:
            t.cancelled()


class _Many(BaseTelemetry):
    """Several telemetries as one: each call goes to every one, in order."""

    def __init__(self, parts: Sequence[Telemetry]) -> None:
        self.parts = tuple(parts)

    def server_decision(self, decision: str, **fields: Any) -> None:
        for p in self.parts:
            p.server_decision(decision, **fields)

    def server_event(self, event: str) -> None:
        for p in self.parts:
            p.server_event(event)

    def lease_renewal(self, result: str) -> None:
        for p in self.parts:
            p.lease_renewal(result)

    def store_operation(
        self, store: str, operation: str, seconds: float, error: str | None
    ) -> None:
        for p in self.parts:
            p.store_operation(store, operation, seconds, error)

    def job_submitted(self, queue: str, method: str, url: str) -> Sequence[tuple[str, str]]:
        return [h for p in self.parts for h in p.job_submitted(queue, method, url)]

    def attempt_started(self, job: Job) -> AttemptTrace | None:
        traces = [t for t in (p.attempt_started(job) for p in self.parts) if t is not None]
        if not traces:
            return None
        return traces[0] if len(traces) == 1 else _Traces(traces)

    def attempt_recorded(self, queue: str, method: str, attempt: Attempt, state: str) -> None:
        for p in self.parts:
            p.attempt_recorded(queue, method, attempt, state)

    def budget_deferral(self, queue: str) -> None:
        for p in self.parts:
            p.budget_deferral(queue)

    def reconciled(self, queue: str, state: str) -> None:
        for p in self.parts:
            p.reconciled(queue, state)

    def webhook_delivery(self, endpoint_id: str, outcome: str) -> None:
        for p in self.parts:
            p.webhook_delivery(endpoint_id, outcome)

    def endpoint_disabled(self, reason: str) -> None:
        for p in self.parts:
            p.endpoint_disabled(reason)

    def agent_call(self, tool: str, outcome: str, seconds: float, key: str) -> None:
        for p in self.parts:
            p.agent_call(tool, outcome, seconds, key)

    def budget_refusal(self, kind: str) -> None:
        for p in self.parts:
            p.budget_refusal(kind)


def telemetry_of(value: Telemetry | Iterable[Telemetry] | None) -> Telemetry | None:
    """What a ``telemetry=`` argument means: None (nothing), one :class:`Telemetry`, or
    several (a list or tuple: each gets every report).

    Raises:
        ConfigurationError: something that is not a telemetry (or a sequence of them).
    """
    from retrysafe._exceptions import ConfigurationError

    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [telemetry_of(v) for v in value]
        kept = [p for p in parts if p is not None]
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else _Many(kept)
    if not callable(getattr(value, "server_decision", None)) or not callable(
        getattr(value, "attempt_recorded", None)
    ):
        raise ConfigurationError(
            f"telemetry must be a retrysafe.observability.Prometheus, OpenTelemetry, or a "
            f"list of them, not {type(value).__name__}",
            option="telemetry",
        )
    found: Telemetry = value  # type: ignore[assignment]
    return found
