"""A reverse proxy ASGI app: the gateway forwards every request to one HTTP upstream.

Wrapped in :class:`~retrysafe.server.IdempotencyMiddleware` it gives idempotency to a service
nobody can modify, whatever its language. Request and response bodies stream through (httpx on
the upstream side); hop-by-hop headers (RFC 9110 §7.6.1) are dropped; ``X-Forwarded-*`` are
added. An unreachable upstream answers ``502 bad-gateway`` and a slow one ``504``: both are
5xx, so the middleware releases the key and the client's retry runs again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from retrysafe._exceptions import ConfigurationError
from retrysafe._http import HOP_BY_HOP
from retrysafe.core import Problem

__all__ = ["ReverseProxy", "validate_upstream"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("retrysafe.gateway")

# Hop-by-hop fields (RFC 9110 §7.6.1) and fields this proxy recomputes.
_HOP_BY_HOP = HOP_BY_HOP | {b"host"}


def validate_upstream(url: str) -> str:
    """Return ``url`` without a trailing slash.

    Raises:
        ConfigurationError: not an absolute ``http://`` or ``https://`` URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"upstream {url!r} must be an absolute http:// or https:// URL", option="upstream"
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(
            f"upstream {url!r} must not carry a query or fragment", option="upstream"
        )
    return url.rstrip("/")


class ReverseProxy:
    """ASGI app forwarding HTTP requests to ``upstream``.

    Args:
        upstream: base URL, e.g. ``http://127.0.0.1:8000`` (a path prefix is kept).
        timeout: seconds for connecting and for each read from the upstream (default 30 s).
        client: an ``httpx.AsyncClient`` to use (tests); by default one is created with
            transport-level retries off, so retries happen in one layer only (SPEC §5).

    Raises:
        ConfigurationError: bad upstream URL or timeout <= 0.
    """

    def __init__(
        self, upstream: str, *, timeout: float = 30.0, client: httpx.AsyncClient | None = None
    ) -> None:
        if timeout <= 0:
            raise ConfigurationError("gateway timeout must be > 0 seconds", option="timeout")
        self.upstream = validate_upstream(upstream)
        self._timeout = timeout
        self._client = client

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(retries=0),
                timeout=httpx.Timeout(self._timeout),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets are not proxied
            return
        await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("raw_path") or scope["path"].encode("utf-8")
        if isinstance(path, bytes):
            path = path.decode("latin-1")
        url = self.upstream + path
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers: list[tuple[bytes, bytes]] = [
            (k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP
        ]
        client_addr = scope.get("client")
        if client_addr:
            headers.append((b"x-forwarded-for", str(client_addr[0]).encode("latin-1")))
        headers.append((b"x-forwarded-proto", str(scope.get("scheme", "http")).encode("latin-1")))
        for k, v in scope["headers"]:
            if k == b"host":
                headers.append((b"x-forwarded-host", v))
                break

        client = self._get_client()
        request = client.build_request(
            scope["method"], url, headers=headers, content=_body(receive)
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            await _problem(send, Problem("bad-gateway", 504, f"upstream timed out: {exc!r}"))
            log.warning("upstream timeout", extra={"upstream": self.upstream, "error": repr(exc)})
            return
        except httpx.HTTPError as exc:
            await _problem(
                send, Problem("bad-gateway", 502, f"upstream unreachable: {type(exc).__name__}")
            )
            log.warning("upstream error", extra={"upstream": self.upstream, "error": repr(exc)})
            return
        try:
            out_headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
            )
            try:
                async for chunk in response.aiter_raw():
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                # The answer broke off mid-body: the client sees a truncated response, exactly
                # what the upstream gave. Raising lets the server abort the connection.
                log.warning(
                    "upstream body truncated",
                    extra={"upstream": self.upstream, "error": repr(exc)},
                )
                raise
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _problem(send: Send, problem: Problem) -> None:
    body = problem.body()
    await send(
        {
            "type": "http.response.start",
            "status": problem.status,
            "headers": [(k.encode(), v.encode()) for k, v in problem.headers(len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})
