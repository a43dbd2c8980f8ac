"""OpenTelemetry traces and HTTP duration metrics behind the telemetry seam.

:class:`OpenTelemetry` implements :class:`~retrysafe.observability._telemetry.Telemetry` with the
OpenTelemetry *API* only (``pip install 'retrysafe[tracing]'``); the SDK, its exporters and
samplers are the application's choice. ``opentelemetry`` is imported when an
:class:`OpenTelemetry` is built, never by ``import retrysafe``.

What it reports (span kinds and names; retrysafe's own attributes under ``retrysafe.*``, since
no semantic convention exists for idempotency):

* ``retrysafe.idempotency`` (INTERNAL), one per middleware decision, child of the current
  context (the application's HTTP server span when one is active);
* ``retrysafe.outbox.submit {queue}`` (PRODUCER), when a job is submitted; its trace context is
  stored with the job (W3C ``traceparent``) and is the parent of every attempt;
* ``{method}`` (CLIENT), one per attempt, named and attributed per OpenTelemetry's stable HTTP
  client conventions, with ``http.request.resend_count`` on every resent attempt. A job stored
  without a trace context gets a deterministic remote parent derived from its id, so every
  attempt of one job — across workers, reconcile and restarts — lands in one trace;
* ``retrysafe.agent.call {tool}`` (INTERNAL), one per agent write call;
* histograms ``http.client.request.duration`` and ``http.server.request.duration`` (seconds,
  with the conventions' recommended bucket boundaries).

A raw idempotency key never becomes an attribute: only the first 12 hex digits of its
SHA-256 (``retrysafe.key_hash_prefix``).

See https://opentelemetry.io/docs/specs/semconv/http/http-spans/ and
https://opentelemetry.io/docs/specs/semconv/http/http-metrics/.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from retrysafe._exceptions import ConfigurationError
from retrysafe.observability._telemetry import BaseTelemetry

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import Histogram, MeterProvider
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from retrysafe.client._models import Job
    from retrysafe.client._sender import SendResult

__all__ = ["OpenTelemetry"]

logger = logging.getLogger("retrysafe.observability")

#: The instrumentation scope's name, and the semantic conventions' schema it follows.
SCOPE = "retrysafe"
SCHEMA_URL = "https://opentelemetry.io/schemas/1.26.0"

#: Bucket boundaries (seconds) the HTTP metric conventions recommend for request durations.
DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

#: Server decisions whose span is marked as an error: the request could not be served safely.
ERROR_DECISIONS = frozenset({"store-unavailable", "store-failed", "unrecorded", "fenced"})

#: Agent call outcomes that are not errors.
_AGENT_OK = frozenset({"executed", "replayed"})

#: Methods the HTTP conventions know; any other becomes ``_OTHER`` (bounded cardinality).
_KNOWN_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY", "TRACE"}
)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HEX = frozenset("0123456789abcdef")


def _method(method: str) -> tuple[str, str | None]:
    """``(http.request.method, http.request.method_original or None)`` per the conventions."""
    if method in _KNOWN_METHODS:
        return method, None
    return "_OTHER", method


def _key_prefix(key_hash: str) -> str:
    """The first 12 hex digits of a key hash; anything that is not a hex digest is hashed
    first, so a raw key can never pass through."""
    low = key_hash.lower()
    if len(low) < 12 or not _HEX.issuperset(low):
        low = hashlib.sha256(key_hash.encode("utf-8", "surrogatepass")).hexdigest()
    return low[:12]


def _target(url: str) -> tuple[str, str, int | None]:
    """``(url.full, server.address, server.port)`` of a request URL: the query string,
    fragment and any userinfo removed; the port explicit, else the scheme's default (None
    when the URL's port does not parse)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = parts.netloc.rpartition("@")[2]
    full = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    try:
        port = parts.port
    except ValueError:
        return full, host, None
    if port is None:
        port = _DEFAULT_PORTS.get(parts.scheme.lower())
    return full, host, port


def _span_ids(job_id: str) -> tuple[int, int]:
    """The deterministic ``(trace_id, span_id)`` of a job without a stored trace context:
    the first 16 bytes of SHA-256(job id), then the next 8 (never all zero: invalid in W3C)."""
    digest = hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def _seconds(value: float) -> float:
    """A duration as a finite, non-negative number of seconds (0.0 for anything else)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return 0.0
    return seconds if 0.0 < seconds < 1e9 else 0.0


def _interval(seconds: float) -> tuple[int, int]:
    """``(start, end)`` in Unix nanoseconds of something that just took ``seconds``."""
    end = time.time_ns()
    return end - int(seconds * 1e9), end


_warned: set[str] = set()


def _swallow(what: str, exc: BaseException) -> None:
    """Telemetry never breaks the caller: log the first failure of each kind, then debug."""
    level = logging.DEBUG if what in _warned else logging.WARNING
    _warned.add(what)
    logger.log(level, "OpenTelemetry %s failed; continuing without it", what, exc_info=exc)


class OpenTelemetry(BaseTelemetry):
    """Traces and HTTP duration metrics through the OpenTelemetry API.

    Pass it as ``telemetry=`` to the middleware, :class:`~retrysafe.Outbox`, the worker,
    reconcile, the webhooks worker or an agent run; combine it with
    :class:`~retrysafe.observability.Prometheus` by passing a list.

    Args:
        tracer_provider: where spans go; None: the global provider
            (``opentelemetry.trace.set_tracer_provider``, resolved when spans start, so it
            may be set after this object is built).
        meter_provider: where the duration histograms go; None: the global provider.
        propagator: how trace context enters and leaves requests; None: the global
            propagator (``opentelemetry.propagate``; W3C ``traceparent``/``tracestate`` and
            ``baggage`` by default), looked up at each use.

    Raises:
        ConfigurationError: ``opentelemetry-api`` is not installed (``option="telemetry"``),
            or a provider or propagator is not one, or a provider given here raises when
            asked for its tracer or meter (``option`` names the argument).
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        try:
            from opentelemetry import metrics, trace
            from opentelemetry.trace import SpanKind, Status, StatusCode
        except ImportError as exc:
            raise ConfigurationError(
                f"OpenTelemetry telemetry needs the OpenTelemetry API "
                f"({exc.name or exc}): pip install 'retrysafe[tracing]'",
                option="telemetry",
            ) from exc
        _check(tracer_provider, "tracer_provider", ("get_tracer",))
        _check(meter_provider, "meter_provider", ("get_meter",))
        _check(propagator, "propagator", ("inject", "extract"))
        from retrysafe import __version__

        try:
            self._tracer: Tracer = trace.get_tracer(
                SCOPE, __version__, tracer_provider, schema_url=SCHEMA_URL
            )
        except Exception as exc:  # a provider that cannot give a tracer: say which, now
            raise ConfigurationError(
                f"tracer_provider.get_tracer() failed: {exc!r}", option="tracer_provider"
            ) from exc
        try:
            meter = metrics.get_meter(SCOPE, __version__, meter_provider, schema_url=SCHEMA_URL)
        except Exception as exc:
            raise ConfigurationError(
                f"meter_provider.get_meter() failed: {exc!r}", option="meter_provider"
            ) from exc
        self._client_duration = _histogram(
            meter, "http.client.request.duration", "Duration of HTTP client requests."
        )
        self._server_duration = _histogram(
            meter, "http.server.request.duration", "Duration of HTTP server requests."
        )
        self._propagator = propagator
        self._internal = SpanKind.INTERNAL
        self._producer = SpanKind.PRODUCER
        self._client = SpanKind.CLIENT
        self._error = StatusCode.ERROR
        self._status = Status

    def __repr__(self) -> str:
        return "OpenTelemetry()"

    # ------------------------------------------------------------------ propagation
    def _textmap(self) -> TextMapPropagator:
        if self._propagator is not None:
            return self._propagator
        from opentelemetry.propagate import get_global_textmap

        return get_global_textmap()

    def _inject(self, context: Context) -> list[tuple[str, str]]:
        """The propagator's headers for ``context`` (``traceparent`` …) as ``(name, value)``."""
        carrier: dict[str, str] = {}
        self._textmap().inject(carrier, context=context)
        return list(carrier.items())

    def _job_context(self, job: Job) -> Context:
        """The parent context of ``job``'s attempts: extracted from its stored headers
        (``traceparent``, or whatever the propagator reads), or, when they carry none that
        is valid, the deterministic remote parent derived from its id (sampled). Never the
        caller's current context: a job's attempts stay in the job's trace."""
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        carrier = {name.lower(): value for name, value in job.headers}
        try:
            context = self._textmap().extract(carrier, context=Context())
        except Exception as exc:  # a third-party propagator choking on stored garbage
            _swallow("extract", exc)
            context = Context()
        if trace.get_current_span(context).get_span_context().is_valid:
            return context
        trace_id, span_id = _span_ids(job.id)
        parent = SpanContext(
            trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
        )
        return trace.set_span_in_context(NonRecordingSpan(parent), context)

    # ------------------------------------------------------------------ server
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
        """A ``retrysafe.idempotency`` span (INTERNAL, child of the current context) that
        started ``seconds`` ago, and, with a status, one ``http.server.request.duration``."""
        try:
            seconds = _seconds(seconds)
            start, end = _interval(seconds)
            name, original = _method(method)
            attributes: dict[str, Any] = {
                "retrysafe.decision": decision,
                "retrysafe.replayed": decision == "replayed",
                "http.request.method": name,
                "url.path": path,
            }
            if original is not None:
                attributes["http.request.method_original"] = original
            if key_hash:
                attributes["retrysafe.key_hash_prefix"] = _key_prefix(key_hash)
            if status > 0:
                attributes["http.response.status_code"] = status
            span = self._tracer.start_span(
                "retrysafe.idempotency", kind=self._internal, attributes=attributes,
                start_time=start,
            )  # fmt: skip
            if decision in ERROR_DECISIONS:
                span.set_status(self._status(self._error, decision))
            span.end(end_time=end)
            if status > 0:
                metric: dict[str, Any] = {
                    "http.request.method": name,
                    "http.response.status_code": status,
                }
                if status >= 500:
                    metric["error.type"] = str(status)
                self._server_duration.record(seconds, metric)
        except Exception as exc:
            _swallow("server_decision", exc)

    # ------------------------------------------------------------------ outbox
    def job_submitted(self, queue: str, method: str, url: str) -> Sequence[tuple[str, str]]:
        """A ``retrysafe.outbox.submit {queue}`` span (PRODUCER, child of the current
        context, ended at once); returns its propagated headers, to store with the job."""
        try:
            _full, host, port = _target(url)
            attributes: dict[str, Any] = {"retrysafe.queue": queue}
            if host:
                attributes["server.address"] = host
            if port is not None:
                attributes["server.port"] = port
            span = self._tracer.start_span(
                f"retrysafe.outbox.submit {queue}", kind=self._producer, attributes=attributes
            )
            span.end()
            from opentelemetry import trace

            return self._inject(trace.set_span_in_context(span))
        except Exception as exc:
            _swallow("job_submitted", exc)
            return ()

    def attempt_started(self, job: Job) -> _Attempt | None:
        """A ``{method}`` span (CLIENT) for the attempt about to be sent, child of the job's
        context (:meth:`_job_context`)."""
        try:
            return _Attempt(self, job)
        except Exception as exc:
            _swallow("attempt_started", exc)
            return None

    # ------------------------------------------------------------------ agents
    def agent_call(self, tool: str, outcome: str, seconds: float, key: str) -> None:
        """A ``retrysafe.agent.call {tool}`` span (INTERNAL) that started ``seconds`` ago;
        the key appears only as its SHA-256 prefix."""
        try:
            start, end = _interval(_seconds(seconds))
            attributes: dict[str, Any] = {
                "retrysafe.agent.tool": tool,
                "retrysafe.agent.outcome": outcome,
                "retrysafe.key_hash_prefix": hashlib.sha256(
                    key.encode("utf-8", "surrogatepass")
                ).hexdigest()[:12],
            }
            span = self._tracer.start_span(
                f"retrysafe.agent.call {tool}", kind=self._internal, attributes=attributes,
                start_time=start,
            )  # fmt: skip
            if outcome not in _AGENT_OK:
                span.set_status(self._status(self._error, outcome))
            span.end(end_time=end)
        except Exception as exc:
            _swallow("agent_call", exc)


class _Attempt:
    """One attempt's CLIENT span: opened when the attempt starts, ended with its result."""

    __slots__ = ("_headers", "_metric", "_otel", "_span", "_span_context")

    def __init__(self, otel: OpenTelemetry, job: Job) -> None:
        from opentelemetry import trace

        self._otel = otel
        name, original = _method(job.method)
        full, host, port = _target(job.url)
        attributes: dict[str, Any] = {
            "http.request.method": name,
            "url.full": full,
            "retrysafe.job.id": job.id,
            "retrysafe.queue": job.queue,
        }
        metric: dict[str, Any] = {"http.request.method": name}
        if original is not None:
            attributes["http.request.method_original"] = original
        if host:
            attributes["server.address"] = metric["server.address"] = host
        if port is not None:
            attributes["server.port"] = metric["server.port"] = port
        if job.sends > 0:
            attributes["http.request.resend_count"] = job.sends
        parent = otel._job_context(job)
        self._span: Span = otel._tracer.start_span(
            "HTTP" if original is not None else name,
            context=parent,
            kind=otel._client,
            attributes=attributes,
        )
        self._span_context = trace.set_span_in_context(self._span, parent)
        self._metric = metric
        self._headers: list[tuple[str, str]] | None = None

    def headers(self) -> Sequence[tuple[str, str]]:
        """The attempt span's context as headers (``traceparent`` …), to send with it."""
        if self._headers is None:
            try:
                self._headers = self._otel._inject(self._span_context)
            except Exception as exc:
                _swallow("inject", exc)
                self._headers = []
        return self._headers

    def end(self, result: SendResult) -> None:
        """Record the answer (or its absence) on the span, end it, record its duration."""
        try:
            span = self._span
            status = result.status
            error: str | None = None
            if status is None:
                error = result.error_type or "_OTHER"
            elif status >= 500:
                error = str(status)
            metric: Mapping[str, Any] = self._metric
            if status is not None:
                span.set_attribute("http.response.status_code", status)
                metric = {**metric, "http.response.status_code": status}
            if error is not None:
                span.set_attribute("error.type", error)
                metric = {**metric, "error.type": error}
                description = (result.detail or error)[:200] if status is None else None
                span.set_status(self._otel._status(self._otel._error, description))
            span.set_attribute("retrysafe.attempt.outcome", result.classification.outcome.value)
            span.set_attribute("retrysafe.replayed", result.replayed)
            span.end()
            self._otel._client_duration.record(_seconds(result.duration), metric)
        except Exception as exc:
            _swallow("attempt end", exc)


    def cancelled(self) -> None:
        """The attempt was cancelled in flight: end the span as an error (``error.type``
        ``cancelled``; its effect may have happened), without a duration sample."""
        try:
            span = self._span
            span.set_attribute("error.type", "cancelled")
            span.set_status(self._otel._status(self._otel._error, "attempt cancelled in flight"))
            span.end()
        except Exception as exc:
            _swallow("attempt cancelled", exc)


def _check(value: object, option: str, methods: tuple[str, ...]) -> None:
    """A provider or propagator argument must be None or have the API's methods."""
    if value is None:
        return
    if not all(callable(getattr(value, m, None)) for m in methods):
        raise ConfigurationError(
            f"{option} must be an OpenTelemetry {option.replace('_', ' ')} (with "
            f"{', '.join(m + '()' for m in methods)}), not {type(value).__name__}",
            option=option,
        )


def _histogram(meter: Any, name: str, description: str) -> Histogram:
    """A seconds histogram with the recommended boundaries (as an advisory where the API
    supports it: opentelemetry-api >= 1.23)."""
    try:
        histogram: Histogram = meter.create_histogram(
            name,
            unit="s",
            description=description,
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
    except TypeError:
        histogram = meter.create_histogram(name, unit="s", description=description)
    return histogram
