"""Store operations timed for telemetry: a store wrapped so that every operation reports its
latency and error class (``Telemetry.store_operation``). Only parts given a telemetry wrap
their store; the others call it directly and pay nothing."""

from __future__ import annotations

import inspect
import time
from typing import Any

from retrysafe._exceptions import StoreError, StoreUnavailableError
from retrysafe.observability._telemetry import Telemetry

__all__ = ["store_kind", "timed_store"]

#: Attributes passed through untimed: lifecycle, faces, transactions.
_UNTIMED = frozenset(
    {"close", "aclose", "transaction", "asyncio_key_store", "asyncio_outbox_store", "url",
     "connector", "clock", "check_eviction"}
)


def store_kind(store: object) -> str:
    """The ``store`` label: ``sqlite``, ``postgresql``, ``redis`` (clusters too) or
    ``memory`` for a store URL or one of retrysafe's stores (their faces included), else the
    class name in lower case."""
    if isinstance(store, str):
        return _url_kind(store) or store.split(":", 1)[0].lower()
    for probe in (store, getattr(store, "_store", None), getattr(store, "connector", None)):
        url = getattr(probe, "url", None)
        if isinstance(url, str):
            kind = _url_kind(url)
            if kind is not None:
                return kind
    name = type(store).__name__.lower()
    for kind in ("sqlite", "postgres", "redis", "memory"):
        if kind in name:
            return "postgresql" if kind == "postgres" else kind
    return name


def _url_kind(url: str) -> str | None:
    scheme = url.split(":", 1)[0].lower()
    if scheme.startswith("postgres"):
        return "postgresql"
    if scheme.startswith("redis"):  # redis, rediss, redis+cluster, rediss+cluster
        return "redis"
    return scheme if scheme in ("sqlite", "memory") else None


def _error(exc: BaseException) -> str:
    return "unavailable" if isinstance(exc, StoreUnavailableError) else "error"


class _Timed:
    """``inner`` with each public operation timed (methods made on first use, then cached
    on the instance)."""

    def __init__(self, inner: Any, kind: str, telemetry: Telemetry) -> None:
        self._inner = inner
        self._kind = kind
        self._telemetry = telemetry

    def __repr__(self) -> str:
        return f"timed({self._inner!r})"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or name in _UNTIMED or not callable(attr):
            return attr
        report = self._telemetry.store_operation
        kind = self._kind
        if inspect.iscoroutinefunction(attr):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    value = await attr(*args, **kwargs)
                except StoreError as exc:
                    report(kind, name, time.perf_counter() - t0, _error(exc))
                    raise
                report(kind, name, time.perf_counter() - t0, None)
                return value

            setattr(self, name, timed_async)
            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                value = attr(*args, **kwargs)
            except StoreError as exc:
                report(kind, name, time.perf_counter() - t0, _error(exc))
                raise
            report(kind, name, time.perf_counter() - t0, None)
            return value

        setattr(self, name, timed)
        return timed


def timed_store(store: Any, telemetry: Telemetry | None, kind: str | None = None) -> Any:
    """``store`` itself when ``telemetry`` is None, else a wrapper reporting every
    operation's latency to it under ``kind`` (default :func:`store_kind` of ``store``)."""
    if telemetry is None:
        return store
    return _Timed(store, kind or store_kind(store), telemetry)
