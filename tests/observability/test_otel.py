"""OpenTelemetry behind the telemetry seam: the spans, attributes, trace propagation and HTTP
duration metrics retrysafe reports, read back from opentelemetry-sdk's in-memory exporter
and metric reader."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from retrysafe import ConfigurationError, IdempotencyMiddleware, Outbox, RetryPolicy, Webhooks
from retrysafe._serving import ServerThread
from retrysafe.agents import start_run, tool
from retrysafe.client import Job, JobState, SendResult
from retrysafe.core import classify_response, classify_transport_error, key_hash
from retrysafe.observability import OpenTelemetry, telemetry_of
from retrysafe.observability._otel import DURATION_BUCKETS

KEY_HASH = hashlib.sha256(b"scope\x00order-42").hexdigest()
JOB_ID = "0123456789abcdef0123456789abcdef"


@dataclass
class Sdk:
    """An SDK tracer provider exporting to memory, and a meter provider read in memory."""

    tracer_provider: TracerProvider
    exporter: InMemorySpanExporter
    meter_provider: MeterProvider
    reader: InMemoryMetricReader

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        found = self.exporter.get_finished_spans()
        return [s for s in found if name is None or s.name == name]

    def points(self, metric: str) -> list[HistogramDataPoint]:
        data = self.reader.get_metrics_data()
        out: list[HistogramDataPoint] = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == metric:
                        points = m.data.data_points
                        out.extend(p for p in points if isinstance(p, HistogramDataPoint))
        return out


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Sdk(tracer_provider, exporter, meter_provider, reader)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def otel(sdk: Sdk) -> OpenTelemetry:
    return OpenTelemetry(
        tracer_provider=sdk.tracer_provider,
        meter_provider=sdk.meter_provider,
        propagator=TraceContextTextMapPropagator(),
    )


def make_job(**fields: Any) -> Job:
    values: dict[str, Any] = {
        "id": JOB_ID,
        "key": "order-42",
        "state": JobState.IN_FLIGHT,
        "method": "POST",
        "url": "https://user:secret@api.example.com/v1/orders?token=abc#frag",
        "destination": "https://api.example.com:443",
        "headers": (("content-type", "application/json"),),
        "body": b"{}",
        "created_at": 1.0,
        "updated_at": 1.0,
        "due_at": 1.0,
        "deadline_at": None,
        "attempts": 0,
        "sends": 0,
        "polls": 0,
        "last_delay": 0.0,
        "lease_token": "t",
        "lease_expires_at": 2.0,
        "finished_at": None,
        "last_status": None,
        "last_outcome": None,
        "last_error": None,
    }
    values.update(fields)
    return Job(**values)


def answered(status: int, *, replayed: bool = False, duration: float = 0.03) -> SendResult:
    return SendResult(
        classification=classify_response(status),
        started_at=1.0,
        duration=duration,
        status=status,
        error_type=None,
        replayed=replayed,
        retry_after=None,
        detail=None,
    )


def unanswered(error_type: str = "ReadTimeout") -> SendResult:
    return SendResult(
        classification=classify_transport_error(sent=True),
        started_at=1.0,
        duration=0.5,
        status=None,
        error_type=error_type,
        replayed=False,
        retry_after=None,
        detail="no answer within 0.5 s",
    )


def traceparent(headers: Any) -> tuple[int, int, bool]:
    """``(trace_id, span_id, sampled)`` of the one ``traceparent`` among ``headers``."""
    values = [v for k, v in headers if k.lower() == "traceparent"]
    assert len(values) == 1, headers
    _version, trace_id, span_id, flags = values[0].split("-")
    return int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1)


def all_attribute_values(spans: list[ReadableSpan]) -> list[Any]:
    return [v for s in spans for v in (s.attributes or {}).values()]


# ---------------------------------------------------------------------- construction


def test_importing_retrysafe_and_the_module_does_not_import_opentelemetry() -> None:
    """``import retrysafe`` (and the OpenTelemetry module itself) never imports opentelemetry;
    only building an OpenTelemetry does."""
    code = (
        "import sys, retrysafe, retrysafe.observability, retrysafe.observability._otel as m\n"
        "assert not [n for n in sys.modules if n.startswith('opentelemetry')], 'imported early'\n"
        "m.OpenTelemetry()\n"
        "assert 'opentelemetry.trace' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_global_providers_set_after_it_is_built_are_used() -> None:
    """With no providers given it follows the globals, even those set after it was built
    (in a child process: the global tracer provider can be set only once)."""
    code = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import "
        "InMemorySpanExporter\n"
        "from retrysafe.observability import OpenTelemetry\n"
        "otel = OpenTelemetry()\n"
        "exporter = InMemorySpanExporter()\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
        "trace.set_tracer_provider(provider)\n"
        "otel.server_decision('new', method='POST', path='/', status=201, seconds=0.0,"
        " key_hash='')\n"
        "names = [s.name for s in exporter.get_finished_spans()]\n"
        "assert names == ['retrysafe.idempotency'], names\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_opentelemetry_is_a_configuration_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the opentelemetry package, building one says which extra to install."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'retrysafe\[tracing\]'") as err:
        OpenTelemetry()
    assert err.value.option == "telemetry"


@pytest.mark.parametrize(
    ("argument", "value"),
    [("tracer_provider", "x"), ("meter_provider", object()), ("propagator", 42)],
)
def test_a_provider_that_is_not_one_is_a_configuration_error(argument: str, value: Any) -> None:
    """A tracer provider, meter provider or propagator of the wrong kind is refused at once,
    naming the argument."""
    with pytest.raises(ConfigurationError, match=argument) as err:
        OpenTelemetry(**{argument: value})
    assert err.value.option == argument


def test_the_seam_accepts_it_alone_and_in_a_list(otel: OpenTelemetry) -> None:
    """``telemetry=`` takes an OpenTelemetry, alone or with others."""
    assert telemetry_of(otel) is otel
    assert telemetry_of([otel]) is otel


# ---------------------------------------------------------------------- server decisions


def test_a_server_decision_is_one_internal_span_child_of_the_current_span(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """A decision is a ``retrysafe.idempotency`` INTERNAL span under the active span (the
    app's server span), with the decision, replayed, the key hash prefix and HTTP fields."""
    tracer = sdk.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as server:
        otel.server_decision(
            "new", method="POST", path="/orders", status=201, seconds=0.25, key_hash=KEY_HASH
        )
    (span,) = sdk.spans("retrysafe.idempotency")
    assert span.kind is SpanKind.INTERNAL
    assert span.parent is not None
    assert span.parent.span_id == server.get_span_context().span_id
    assert span.context is not None
    assert span.context.trace_id == server.get_span_context().trace_id
    assert dict(span.attributes or {}) == {
        "retrysafe.decision": "new",
        "retrysafe.replayed": False,
        "retrysafe.key_hash_prefix": KEY_HASH[:12],
        "http.request.method": "POST",
        "url.path": "/orders",
        "http.response.status_code": 201,
    }
    assert span.status.status_code is StatusCode.UNSET


def test_a_server_span_starts_the_given_seconds_before_it_ends(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """The span covers the time the request spent in the middleware, reported after the fact."""
    otel.server_decision(
        "replayed", method="POST", path="/o", status=201, seconds=0.25, key_hash=KEY_HASH
    )
    (span,) = sdk.spans("retrysafe.idempotency")
    assert span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time == pytest.approx(250_000_000, abs=1_000)
    assert (span.attributes or {})["retrysafe.replayed"] is True


@pytest.mark.parametrize(
    ("decision", "error"),
    [
        ("store-unavailable", True),
        ("store-failed", True),
        ("unrecorded", True),
        ("fenced", True),
        ("new", False),
        ("replayed", False),
        ("key-reused", False),
        ("in-progress", False),
    ],
)
def test_only_decisions_that_could_not_be_served_safely_are_errors(
    sdk: Sdk, otel: OpenTelemetry, decision: str, error: bool
) -> None:
    """store-unavailable, store-failed, unrecorded and fenced mark the span as an error; a
    client's own mistake (key-reused, in-progress) does not."""
    otel.server_decision(
        decision, method="POST", path="/o", status=503, seconds=0.01, key_hash=KEY_HASH
    )
    (span,) = sdk.spans("retrysafe.idempotency")
    assert (span.status.status_code is StatusCode.ERROR) is error


def test_a_decision_without_an_answer_has_no_status_and_no_server_duration(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """Status 0 (no answer was sent): no ``http.response.status_code``, no histogram point."""
    otel.server_decision(
        "disconnect", method="POST", path="/o", status=0, seconds=0.01, key_hash=KEY_HASH
    )
    (span,) = sdk.spans("retrysafe.idempotency")
    assert "http.response.status_code" not in (span.attributes or {})
    assert sdk.points("http.server.request.duration") == []


def test_an_unkeyed_request_has_no_key_hash_prefix(sdk: Sdk, otel: OpenTelemetry) -> None:
    """Without a key there is no key hash attribute at all."""
    otel.server_decision("unkeyed", method="GET", path="/", status=200, seconds=0.0, key_hash="")
    (span,) = sdk.spans("retrysafe.idempotency")
    assert "retrysafe.key_hash_prefix" not in (span.attributes or {})


def test_a_key_hash_that_is_not_a_digest_is_hashed_before_it_is_shown(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """Should a caller pass a raw key where the hash belongs, only its SHA-256 prefix shows."""
    raw = "order-42-raw-key-from-the-client"
    otel.server_decision("new", method="POST", path="/o", status=201, seconds=0.0, key_hash=raw)
    (span,) = sdk.spans("retrysafe.idempotency")
    assert (span.attributes or {})["retrysafe.key_hash_prefix"] == (
        hashlib.sha256(raw.encode()).hexdigest()[:12]
    )
    assert not any(raw in str(v) for v in all_attribute_values(sdk.spans()))


def test_an_unknown_method_is_other_on_spans_and_metrics(sdk: Sdk, otel: OpenTelemetry) -> None:
    """A method the HTTP conventions do not know is ``_OTHER`` (bounded cardinality), the
    original kept on the span only."""
    otel.server_decision(
        "new", method="BREW", path="/pot", status=201, seconds=0.01, key_hash=KEY_HASH
    )
    (span,) = sdk.spans("retrysafe.idempotency")
    assert (span.attributes or {})["http.request.method"] == "_OTHER"
    assert (span.attributes or {})["http.request.method_original"] == "BREW"
    (point,) = sdk.points("http.server.request.duration")
    assert dict(point.attributes or {}) == {
        "http.request.method": "_OTHER",
        "http.response.status_code": 201,
    }


def test_server_duration_is_a_seconds_histogram_with_the_recommended_buckets(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """``http.server.request.duration``: one point per answered decision, in seconds, with the
    conventions' bucket boundaries and ``error.type`` on a 5xx."""
    otel.server_decision("new", method="POST", path="/a", status=201, seconds=0.02, key_hash="")
    otel.server_decision(
        "store-unavailable", method="POST", path="/a", status=503, seconds=0.2, key_hash=""
    )
    points = {
        (p.attributes or {})["http.response.status_code"]: p
        for p in sdk.points("http.server.request.duration")
    }
    assert points[201].sum == pytest.approx(0.02)
    assert points[201].explicit_bounds == DURATION_BUCKETS
    assert "error.type" not in (points[201].attributes or {})
    assert (points[503].attributes or {})["error.type"] == "503"


# ---------------------------------------------------------------------- outbox


def test_submitting_a_job_is_a_producer_span_whose_context_is_returned(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """``job_submitted`` ends a PRODUCER span under the current span and returns its W3C
    ``traceparent`` (sampled), to be stored with the job."""
    tracer = sdk.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("checkout") as outer:
        headers = otel.job_submitted("default", "POST", "https://api.example.com/v1/orders")
    (span,) = sdk.spans("retrysafe.outbox.submit default")
    assert span.kind is SpanKind.PRODUCER
    assert span.parent is not None and span.parent.span_id == outer.get_span_context().span_id
    assert span.context is not None
    assert traceparent(headers) == (span.context.trace_id, span.context.span_id, True)
    assert (span.attributes or {})["retrysafe.queue"] == "default"


def test_an_attempt_is_a_client_span_under_the_job_submit_span(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """An attempt of a job stored with a trace context is a CLIENT span named by its method,
    child of the submit span, and sends its own span's ``traceparent``."""
    stored = otel.job_submitted("default", "POST", "https://api.example.com/v1/orders")
    job = make_job(headers=(("content-type", "application/json"), *stored))
    attempt = otel.attempt_started(job)
    assert attempt is not None
    sent = attempt.headers()
    attempt.end(answered(201))
    (submit,) = sdk.spans("retrysafe.outbox.submit default")
    (span,) = sdk.spans("POST")
    assert span.kind is SpanKind.CLIENT
    assert submit.context is not None and span.context is not None
    assert span.parent is not None and span.parent.span_id == submit.context.span_id
    assert traceparent(sent) == (submit.context.trace_id, span.context.span_id, True)


def test_attempt_attributes_follow_the_http_client_conventions(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """Method, server address and port, a ``url.full`` without query or userinfo, the status,
    and retrysafe's job id, queue, outcome and replayed."""
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    attempt.end(answered(201, replayed=True))
    (span,) = sdk.spans("POST")
    assert dict(span.attributes or {}) == {
        "http.request.method": "POST",
        "server.address": "api.example.com",
        "server.port": 443,
        "url.full": "https://api.example.com/v1/orders",
        "http.response.status_code": 201,
        "retrysafe.job.id": JOB_ID,
        "retrysafe.queue": "default",
        "retrysafe.attempt.outcome": "success",
        "retrysafe.replayed": True,
    }
    assert span.status.status_code is StatusCode.UNSET


def test_an_explicit_port_and_an_ipv6_host_are_kept(sdk: Sdk, otel: OpenTelemetry) -> None:
    """``server.port`` is the URL's port when it has one; an IPv6 host keeps its brackets in
    ``url.full``."""
    attempt = otel.attempt_started(make_job(url="http://[::1]:8080/hook?sig=x", queue="webhooks"))
    assert attempt is not None
    attempt.end(answered(204))
    (span,) = sdk.spans("POST")
    attributes = span.attributes or {}
    assert attributes["server.address"] == "::1"
    assert attributes["server.port"] == 8080
    assert attributes["url.full"] == "http://[::1]:8080/hook"
    assert attributes["retrysafe.queue"] == "webhooks"


def test_resend_count_is_absent_on_the_first_attempt_and_counts_resends_after(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """``http.request.resend_count`` appears only on resent attempts, equal to the attempts
    sent before (``job.sends``)."""
    for sends in (0, 1, 2):
        attempt = otel.attempt_started(make_job(sends=sends))
        assert attempt is not None
        attempt.end(answered(503))
    counts = [(s.attributes or {}).get("http.request.resend_count") for s in sdk.spans("POST")]
    assert counts == [None, 1, 2]


def test_attempts_of_a_job_without_a_trace_context_share_one_deterministic_trace(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """Without a stored ``traceparent`` every attempt's parent is derived from the job id
    (trace id = SHA-256(id)[:16], span id = the next 8 bytes): one trace across attempts,
    workers and restarts; another job, another trace."""
    digest = hashlib.sha256(JOB_ID.encode()).digest()
    for job in (make_job(), make_job(sends=1), make_job(id="f" * 32)):
        attempt = otel.attempt_started(job)
        assert attempt is not None
        attempt.end(answered(201))
    first, second, other = sdk.spans("POST")
    for span in (first, second):
        assert span.context is not None and span.parent is not None
        assert span.context.trace_id == int.from_bytes(digest[:16], "big")
        assert span.parent.span_id == int.from_bytes(digest[16:24], "big")
        assert span.parent.is_remote
    assert other.context is not None and first.context is not None
    assert other.context.trace_id != first.context.trace_id


@pytest.mark.parametrize(
    "garbage",
    [
        "not-a-traceparent",
        "00-00000000000000000000000000000000-0000000000000000-01",
        "00-zz",
        "",
    ],
)
def test_a_garbage_stored_traceparent_falls_back_to_the_deterministic_parent(
    sdk: Sdk, otel: OpenTelemetry, garbage: str
) -> None:
    """A stored ``traceparent`` that does not parse never raises: the attempt joins the job's
    deterministic trace instead."""
    job = make_job(headers=(("traceparent", garbage), ("tracestate", "=,=")))
    attempt = otel.attempt_started(job)
    assert attempt is not None
    sent = attempt.headers()
    attempt.end(answered(201))
    (span,) = sdk.spans("POST")
    digest = hashlib.sha256(JOB_ID.encode()).digest()
    assert span.context is not None
    assert span.context.trace_id == int.from_bytes(digest[:16], "big")
    assert traceparent(sent)[:2] == (span.context.trace_id, span.context.span_id)


def test_a_5xx_is_an_error_with_its_status_as_error_type(sdk: Sdk, otel: OpenTelemetry) -> None:
    """A 5xx answer: error status, ``error.type`` the status code, outcome server_error."""
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    attempt.end(answered(503))
    (span,) = sdk.spans("POST")
    attributes = span.attributes or {}
    assert span.status.status_code is StatusCode.ERROR
    assert attributes["error.type"] == "503"
    assert attributes["http.response.status_code"] == 503
    assert attributes["retrysafe.attempt.outcome"] == "server_error"


def test_no_answer_is_an_error_named_by_the_transport_error(sdk: Sdk, otel: OpenTelemetry) -> None:
    """No complete answer: error status, ``error.type`` the error's class, no status code."""
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    attempt.end(unanswered("ReadTimeout"))
    (span,) = sdk.spans("POST")
    attributes = span.attributes or {}
    assert span.status.status_code is StatusCode.ERROR
    assert attributes["error.type"] == "ReadTimeout"
    assert "http.response.status_code" not in attributes
    assert attributes["retrysafe.attempt.outcome"] == "transport_error"


def test_a_4xx_answer_is_not_an_error_on_the_span(sdk: Sdk, otel: OpenTelemetry) -> None:
    """A 4xx is a definitive answer from the server (rejected or polled), not a failed
    attempt: no error status and no ``error.type``."""
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    attempt.end(answered(409))
    (span,) = sdk.spans("POST")
    assert span.status.status_code is StatusCode.UNSET
    assert "error.type" not in (span.attributes or {})


def test_client_duration_is_recorded_per_attempt_with_low_cardinality_attributes(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """``http.client.request.duration``: the attempt's duration in seconds, by method, server
    address and port, status and error type — never the job id or the URL."""
    for result in (answered(201, duration=0.03), unanswered("ConnectError")):
        attempt = otel.attempt_started(make_job())
        assert attempt is not None
        attempt.end(result)
    points = sdk.points("http.client.request.duration")
    by_attributes = {tuple(sorted((p.attributes or {}).items())): p for p in points}
    ok = (
        ("http.request.method", "POST"),
        ("http.response.status_code", 201),
        ("server.address", "api.example.com"),
        ("server.port", 443),
    )
    failed = (
        ("error.type", "ConnectError"),
        ("http.request.method", "POST"),
        ("server.address", "api.example.com"),
        ("server.port", 443),
    )
    assert set(by_attributes) == {ok, failed}
    assert by_attributes[ok].sum == pytest.approx(0.03)
    assert by_attributes[failed].sum == pytest.approx(0.5)
    assert by_attributes[ok].explicit_bounds == DURATION_BUCKETS


def test_the_global_propagator_is_used_by_default(sdk: Sdk) -> None:
    """Without ``propagator=``, the global one (W3C ``traceparent`` by default) carries the
    context."""
    otel = OpenTelemetry(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    sent = attempt.headers()
    attempt.end(answered(201))
    (span,) = sdk.spans("POST")
    assert span.context is not None
    assert traceparent(sent)[:2] == (span.context.trace_id, span.context.span_id)


# ---------------------------------------------------------------------- agents


def test_an_agent_call_is_an_internal_span_with_its_outcome_and_hashed_key(
    sdk: Sdk, otel: OpenTelemetry
) -> None:
    """An agent write call: ``retrysafe.agent.call {tool}``, its outcome, the SHA-256 prefix
    of its key (never the key), covering ``seconds``; ``unknown`` is an error."""
    key = "agent-run-7:charge:0"
    otel.agent_call("charge", "executed", 0.5, key)
    otel.agent_call("charge", "unknown", 0.1, key)
    executed, unknown = sdk.spans("retrysafe.agent.call charge")
    assert executed.kind is SpanKind.INTERNAL
    assert dict(executed.attributes or {}) == {
        "retrysafe.agent.tool": "charge",
        "retrysafe.agent.outcome": "executed",
        "retrysafe.key_hash_prefix": hashlib.sha256(key.encode()).hexdigest()[:12],
    }
    assert executed.start_time is not None and executed.end_time is not None
    assert executed.end_time - executed.start_time == pytest.approx(500_000_000, abs=1_000)
    assert executed.status.status_code is StatusCode.UNSET
    assert unknown.status.status_code is StatusCode.ERROR
    assert key not in all_attribute_values(sdk.spans())


# ---------------------------------------------------------------------- never raises


class _BrokenTracer:
    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("exporter bug")


class _BrokenProvider:
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _BrokenTracer()


def test_a_failing_tracer_never_breaks_the_caller(sdk: Sdk) -> None:
    """A tracer that raises costs the spans, never the request or the attempt."""
    otel = OpenTelemetry(
        tracer_provider=_BrokenProvider(),  # type: ignore[arg-type]
        meter_provider=sdk.meter_provider,
    )
    otel.server_decision("new", method="POST", path="/", status=201, seconds=0.1, key_hash="")
    otel.agent_call("charge", "executed", 0.1, "k")
    assert otel.job_submitted("default", "POST", "https://api.example.com/") == ()
    assert otel.attempt_started(make_job()) is None


def test_ending_an_attempt_with_nonsense_never_raises(sdk: Sdk, otel: OpenTelemetry) -> None:
    """A result with a nonsense duration still ends the span; nothing raises."""
    attempt = otel.attempt_started(make_job())
    assert attempt is not None
    attempt.end(replace(answered(201), duration=float("nan")))
    assert len(sdk.spans("POST")) == 1
    (point,) = sdk.points("http.client.request.duration")
    assert point.sum == 0.0


def test_a_malformed_url_still_gives_a_span(sdk: Sdk, otel: OpenTelemetry) -> None:
    """A URL whose port does not parse yields a span without a port, not an exception."""
    attempt = otel.attempt_started(make_job(url="http://api.example.com:99999999/x"))
    assert attempt is not None
    attempt.end(unanswered("ConnectError"))
    (span,) = sdk.spans("POST")
    attributes = span.attributes or {}
    assert "server.port" not in attributes
    assert attributes["server.address"] == "api.example.com"
    assert attributes["url.full"] == "http://api.example.com:99999999/x"


def test_the_current_span_does_not_leak_into_an_attempt(sdk: Sdk, otel: OpenTelemetry) -> None:
    """An attempt's parent is the job's context, not whatever span is active in the worker:
    a job's attempts stay in the job's trace."""
    tracer = sdk.tracer_provider.get_tracer("worker")
    with tracer.start_as_current_span("poll loop") as loop:
        attempt = otel.attempt_started(make_job())
        assert attempt is not None
        attempt.end(answered(201))
    (span,) = sdk.spans("POST")
    assert span.context is not None
    assert span.context.trace_id != loop.get_span_context().trace_id
    assert trace.get_current_span() is trace.INVALID_SPAN


# ---------------------------------------------------------------------- end to end


@dataclass
class Received:
    path: str
    headers: dict[str, str]


class Endpoint:
    """A real HTTP endpoint (uvicorn on a loopback port) answering each path's scripted
    statuses in turn (the last one repeats) and keeping every request's headers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.plans: dict[str, list[int]] = {}
        self.seen: list[Received] = []
        self._lock = threading.Lock()

    def plan(self, path: str, *statuses: int) -> str:
        self.plans[path] = list(statuses)
        return path

    def requests(self, path: str) -> list[Received]:
        return [r for r in self.seen if r.path == path]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        with self._lock:
            plan = self.plans.get(path) or [201]
            status = plan.pop(0) if len(plan) > 1 else plan[0]
            self.seen.append(
                Received(path, {k.decode().lower(): v.decode() for k, v in scope["headers"]})
            )
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})


@pytest.fixture(scope="module")
def _endpoint_server() -> Iterator[tuple[ServerThread, list[Endpoint]]]:
    holder: list[Endpoint] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await holder[0](scope, receive, send)

    with ServerThread(app) as server:
        holder.append(Endpoint(server.url))
        yield server, holder


@pytest.fixture
def endpoint(_endpoint_server: tuple[ServerThread, list[Endpoint]]) -> Endpoint:
    """A fresh script on the module's endpoint server."""
    server, holder = _endpoint_server
    holder[0] = Endpoint(server.url)
    return holder[0]


#: Retries without real waits (the attempts are sent back to back).
FAST = RetryPolicy(attempts=2, wait_initial=0.01, wait_max=0.02, timeout=5.0, poll_interval=0.01)


def run_worker(outbox: Outbox) -> None:
    outbox.worker(poll_interval=0.01, budget=None).run_until_idle()


def test_an_outbox_job_is_one_trace_with_a_span_per_attempt(
    sdk: Sdk, otel: OpenTelemetry, endpoint: Endpoint, tmp_path: Path
) -> None:
    """A job answered 503 then 201: one trace (the submit span and two attempt spans under
    it), ``resend_count`` absent then 1, and the endpoint received each attempt's own
    ``traceparent`` in the job's trace."""
    path = endpoint.plan("/orders", 503, 201)
    with Outbox(f"sqlite:///{tmp_path / 'o.db'}", policy=FAST, telemetry=otel) as outbox:
        job = outbox.submit(endpoint.url + path, json={"order": 1})
        run_worker(outbox)
        assert outbox.get(job.id).state is JobState.SUCCEEDED
    (submit,) = sdk.spans("retrysafe.outbox.submit default")
    attempts = sdk.spans("POST")
    assert submit.context is not None
    trace_id = submit.context.trace_id
    assert [s.context.trace_id for s in attempts if s.context] == [trace_id, trace_id]
    assert [s.parent.span_id for s in attempts if s.parent] == [submit.context.span_id] * 2
    assert [(s.attributes or {}).get("http.request.resend_count") for s in attempts] == [None, 1]
    assert [(s.attributes or {})["http.response.status_code"] for s in attempts] == [503, 201]
    assert [(s.attributes or {})["retrysafe.job.id"] for s in attempts] == [job.id] * 2
    received = [traceparent(r.headers.items()) for r in endpoint.requests(path)]
    assert received == [(trace_id, s.context.span_id, True) for s in attempts if s.context]
    assert job.key not in all_attribute_values(sdk.spans())


def test_a_reconcile_attempt_joins_the_job_trace(
    sdk: Sdk, otel: OpenTelemetry, endpoint: Endpoint, tmp_path: Path
) -> None:
    """A job left UNKNOWN after two 503s is reconciled with a 201: the reconcile attempt is a
    third span in the same trace, ``resend_count`` 2."""
    path = endpoint.plan("/unknown", 503, 503, 201)
    with Outbox(f"sqlite:///{tmp_path / 'o.db'}", policy=FAST, telemetry=otel) as outbox:
        job = outbox.submit(endpoint.url + path, json={"order": 2})
        run_worker(outbox)
        assert outbox.get(job.id).state is JobState.UNKNOWN
        assert len(sdk.spans("POST")) == 2
        report = outbox.reconcile()
        assert outbox.get(job.id).state is JobState.SUCCEEDED, report
    (submit,) = sdk.spans("retrysafe.outbox.submit default")
    *_, reconciled = attempts = sdk.spans("POST")
    assert len(attempts) == 3
    assert submit.context is not None and reconciled.context is not None
    assert {s.context.trace_id for s in attempts if s.context} == {submit.context.trace_id}
    assert (reconciled.attributes or {})["http.request.resend_count"] == 2
    assert (reconciled.attributes or {})["http.response.status_code"] == 201
    (last,) = endpoint.requests(path)[-1:]
    assert traceparent(last.headers.items())[:2] == (
        submit.context.trace_id,
        reconciled.context.span_id,
    )


def test_a_job_submitted_without_telemetry_still_gets_one_trace_across_processes(
    sdk: Sdk, otel: OpenTelemetry, endpoint: Endpoint, tmp_path: Path
) -> None:
    """A job stored without a trace context, sent by one worker and reconciled by another
    Outbox (a restart): every attempt is in the trace derived from the job id."""
    path = endpoint.plan("/untraced", 503, 503, 201)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    with Outbox(url, policy=FAST) as plain:
        job = plain.submit(endpoint.url + path, json={"order": 3})
        plain.worker(poll_interval=0.01, budget=None, telemetry=otel).run_until_idle()
    with Outbox(url, policy=FAST, telemetry=otel) as restarted:
        restarted.reconcile()
        assert restarted.get(job.id).state is JobState.SUCCEEDED
    expected = int.from_bytes(hashlib.sha256(job.id.encode()).digest()[:16], "big")
    attempts = sdk.spans("POST")
    assert len(attempts) == 3
    assert {s.context.trace_id for s in attempts if s.context} == {expected}
    assert {traceparent(r.headers.items())[0] for r in endpoint.requests(path)} == {expected}
    assert sdk.spans("retrysafe.outbox.submit default") == []


def test_a_webhook_delivery_attempt_is_a_client_span_that_propagates_its_context(
    sdk: Sdk, otel: OpenTelemetry, endpoint: Endpoint, tmp_path: Path
) -> None:
    """A webhook delivery is sent like any outbox attempt: a CLIENT span in the ``webhooks``
    queue, its ``traceparent`` sent to the endpoint."""
    path = endpoint.plan("/hook", 200)
    with Webhooks(f"sqlite:///{tmp_path / 'w.db'}", allow_private=True) as hooks:
        hooks.add_endpoint(endpoint.url + path)
        hooks.send("invoice.paid", {"amount": 42})
        hooks.worker(poll_interval=0.01, budget=None, telemetry=otel).run_until_idle()
    (span,) = sdk.spans("POST")
    assert (span.attributes or {})["retrysafe.queue"] == "webhooks"
    assert (span.attributes or {})["http.response.status_code"] == 200
    (received,) = endpoint.requests(path)
    assert span.context is not None
    assert traceparent(received.headers.items())[:2] == (
        span.context.trace_id,
        span.context.span_id,
    )


class WatchedExporter(InMemorySpanExporter):
    """An in-memory exporter the test can wait on (spans end on the server's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        with self.changed:
            self.changed.notify_all()
        return result

    def wait_for(self, name: str, count: int, timeout: float = 10.0) -> list[ReadableSpan]:
        with self.changed:
            self.changed.wait_for(
                lambda: len([s for s in self.get_finished_spans() if s.name == name]) >= count,
                timeout=timeout,
            )
        return [s for s in self.get_finished_spans() if s.name == name]


def test_the_middleware_under_a_real_app_gives_one_span_per_decision(
    sdk: Sdk, tmp_path: Path
) -> None:
    """Two requests with one key through a real server: a ``retrysafe.idempotency`` span for
    each (new, then replayed) under that request's server span, the key only as its hash
    prefix, and two ``http.server.request.duration`` points."""
    exporter = WatchedExporter()
    sdk.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel = OpenTelemetry(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)
    tracer = sdk.tracer_provider.get_tracer("app")

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"id":1}'})

    protected = IdempotencyMiddleware(handler, f"sqlite:///{tmp_path / 'k.db'}", telemetry=otel)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        with tracer.start_as_current_span("POST /orders", kind=SpanKind.SERVER):
            await protected(scope, receive, send)

    key = "order-42-from-the-client"
    with ServerThread(app) as server:
        answers = [
            httpx.post(server.url + "/orders", json={"n": 1}, headers={"Idempotency-Key": key})
            for _ in range(2)
        ]
        decisions = exporter.wait_for("retrysafe.idempotency", 2)
        servers = exporter.wait_for("POST /orders", 2)
    protected.close()
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert [(s.attributes or {})["retrysafe.decision"] for s in decisions] == ["new", "replayed"]
    assert [(s.attributes or {})["retrysafe.replayed"] for s in decisions] == [False, True]
    assert [s.parent.span_id for s in decisions if s.parent] == [
        s.context.span_id for s in servers if s.context
    ]
    prefix = key_hash("", key)[:12]
    assert {(s.attributes or {})["retrysafe.key_hash_prefix"] for s in decisions} == {prefix}
    assert key not in all_attribute_values(list(exporter.get_finished_spans()))
    (point,) = sdk.points("http.server.request.duration")
    assert point.count == 2
    assert dict(point.attributes or {}) == {
        "http.request.method": "POST",
        "http.response.status_code": 201,
    }


def test_an_agent_write_call_and_its_replay_are_two_spans(
    sdk: Sdk, otel: OpenTelemetry, tmp_path: Path
) -> None:
    """An agent run's write call executes, then replays: two ``retrysafe.agent.call`` spans,
    executed then replayed, neither carrying the call's key."""

    @tool(kind="write", name="charge")
    def charge(amount: int) -> int:
        return amount

    with start_run(f"sqlite:///{tmp_path / 'a.db'}", "run-1", telemetry=otel) as run:
        with run.step(1):
            charge(5)
            charge(5)
        (call,) = run.calls()
    spans = sdk.spans("retrysafe.agent.call charge")
    assert [(s.attributes or {})["retrysafe.agent.outcome"] for s in spans] == [
        "executed",
        "replayed",
    ]
    assert call.key not in all_attribute_values(sdk.spans())
    assert {(s.attributes or {})["retrysafe.key_hash_prefix"] for s in spans} == {
        hashlib.sha256(call.key.encode()).hexdigest()[:12]
    }
