"""Where Prometheus scrapes: a small HTTP server on its own thread (what ``--metrics`` starts),
or an ASGI / WSGI app to mount in your own application."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.observability._collect import StoreCollector
from retrysafe.observability._prometheus import Prometheus, prometheus_client

__all__ = ["MetricsServer", "metrics_asgi_app", "metrics_wsgi_app", "serve_metrics"]


def _registry(metrics: Prometheus | Any | None) -> Any:
    if metrics is None:
        return prometheus_client().REGISTRY
    if isinstance(metrics, Prometheus):
        return metrics.registry
    return metrics


def metrics_asgi_app(metrics: Prometheus | Any | None = None) -> Any:
    """An ASGI app answering every HTTP request with the registry of ``metrics`` (a
    :class:`Prometheus`, a ``CollectorRegistry``, or None: the global one) in Prometheus'
    text format (OpenMetrics when the scraper asks for it). Route ``/metrics`` to it
    (Starlette: ``Route("/metrics", metrics_asgi_app(m))``; a ``Mount`` answers only
    ``/metrics/``), or serve it alone (it completes the lifespan protocol)."""
    return _MetricsApp(prometheus_client().make_asgi_app(registry=_registry(metrics)))


class _MetricsApp:
    """The ASGI app of :func:`metrics_asgi_app` (an object, not a function, so that
    Starlette's ``Route`` calls it as an ASGI app rather than as a request handler)."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "http":
            await self._app(scope, receive, send)


def metrics_wsgi_app(metrics: Prometheus | Any | None = None) -> Any:
    """The WSGI twin of :func:`metrics_asgi_app`."""
    return prometheus_client().make_wsgi_app(registry=_registry(metrics))


class MetricsServer:
    """A running ``/metrics`` endpoint (see :func:`serve_metrics`).

    Attributes:
        host, port: where it listens (the port the system chose when 0 was asked).
        collector: the :class:`StoreCollector` it registered, or None.
    """

    def __init__(self, httpd: Any, thread: threading.Thread, registry: Any,
                 collector: StoreCollector | None) -> None:
        self._httpd = httpd
        self._thread = thread
        self._registry = registry
        self.collector = collector
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, unregister the collector and close its store. Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(timeout=5)
        if self.collector is not None:
            with contextlib.suppress(KeyError):
                self._registry.unregister(self.collector)
            self.collector.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(
    host: str, port: int, *, metrics: Prometheus | Any | None = None, store: Any = None
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread.

    Args:
        host, port: the address to bind (keep it on loopback or a private network: metrics
            name your queues and endpoints); port 0 lets the system choose.
        metrics: the :class:`Prometheus` (or registry) to serve; default the global registry.
        store: a store or URL whose jobs, backlog ages, dead letters and endpoints are read at
            each scrape (:class:`StoreCollector`, registered on that registry while serving).

    Raises:
        ConfigurationError: prometheus-client is missing.
        OSError: the address cannot be bound (in use, not an address of this machine).
    """
    prom = prometheus_client()
    registry = _registry(metrics)
    collector = None
    if store is not None:
        collector = StoreCollector(store)
        try:
            registry.register(collector)
        except ValueError as exc:
            collector.close()
            raise ConfigurationError(f"cannot register the store collector: {exc}",
                                     option="metrics") from None
    try:
        httpd, thread = prom.start_http_server(port, addr=host, registry=registry)
    except BaseException:
        if collector is not None:
            registry.unregister(collector)
            collector.close()
        raise
    return MetricsServer(httpd, thread, registry, collector)
