"""Observability: Prometheus metrics, OpenTelemetry traces, and where to scrape them.

Every instrumented part takes ``telemetry=`` — a :class:`Prometheus`, an
:class:`OpenTelemetry`, or a list of both — and reports to it at the points where it decides
(docs/observability.md lists every metric, span and attribute)::

    from retrysafe.observability import Prometheus, serve_metrics
    metrics = Prometheus()                      # the global prometheus_client registry
    app = IdempotencyMiddleware(app, store, telemetry=metrics)
    serve_metrics("127.0.0.1", 9464, metrics=metrics, store="sqlite:///retrysafe.db")

``import retrysafe`` imports neither prometheus-client nor opentelemetry; this package imports
them only when one of its classes is built (``pip install 'retrysafe[metrics]'`` /
``'retrysafe[tracing]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from retrysafe.observability._telemetry import BaseTelemetry, Telemetry, telemetry_of

if TYPE_CHECKING:
    from retrysafe.observability._collect import StoreCollector
    from retrysafe.observability._otel import OpenTelemetry
    from retrysafe.observability._prometheus import Prometheus
    from retrysafe.observability._serve import (
        MetricsServer,
        metrics_asgi_app,
        metrics_wsgi_app,
        serve_metrics,
    )

__all__ = [
    "BaseTelemetry",
    "MetricsServer",
    "OpenTelemetry",
    "Prometheus",
    "StoreCollector",
    "Telemetry",
    "metrics_asgi_app",
    "metrics_wsgi_app",
    "serve_metrics",
    "telemetry_of",
]

_LAZY = {
    "Prometheus": "retrysafe.observability._prometheus",
    "StoreCollector": "retrysafe.observability._collect",
    "MetricsServer": "retrysafe.observability._serve",
    "metrics_asgi_app": "retrysafe.observability._serve",
    "metrics_wsgi_app": "retrysafe.observability._serve",
    "serve_metrics": "retrysafe.observability._serve",
    "OpenTelemetry": "retrysafe.observability._otel",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'retrysafe.observability' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
