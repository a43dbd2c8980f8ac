"""Propagation: outgoing httpx requests made inside a write tool carry the call's key.

Attach once, to the client your tools use::

    client = retrysafe.agents.instrument(httpx.Client())       # or httpx.AsyncClient()

or build the client on the transport::

    client = httpx.Client(transport=IdempotencyKeyTransport(httpx.HTTPTransport()))

Inside a write tool every request then carries ``Idempotency-Key: <the call's key>`` (unless
it set one itself), on every attempt, so a server protected by
:class:`~retrysafe.IdempotencyMiddleware`, or a provider's own idempotency support (Stripe,
…), dedupes the effect too. Outside write tools nothing is added.
"""

from __future__ import annotations

from typing import TypeVar

import httpx

from retrysafe.agents._run import current_call_key

__all__ = ["AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport", "instrument"]

HEADER = "Idempotency-Key"
_C = TypeVar("_C", httpx.Client, httpx.AsyncClient)


def _add_key(request: httpx.Request) -> None:
    key = current_call_key()
    if key is not None and HEADER not in request.headers:
        request.headers[HEADER] = key


async def _async_add_key(request: httpx.Request) -> None:
    _add_key(request)


def instrument(client: _C) -> _C:
    """Add the key-propagating request hook to ``client`` (sync or async). Returns it.

    Idempotent: instrumenting twice adds one hook.
    """
    hooks = client.event_hooks
    hook = _async_add_key if isinstance(client, httpx.AsyncClient) else _add_key
    request_hooks = list(hooks.get("request", []))
    if hook not in request_hooks:
        request_hooks.append(hook)
        hooks["request"] = request_hooks
        client.event_hooks = hooks
    return client


class IdempotencyKeyTransport(httpx.BaseTransport):
    """A sync transport wrapper that adds the current write call's ``Idempotency-Key``."""

    def __init__(self, transport: httpx.BaseTransport) -> None:
        self._transport = transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        _add_key(request)
        return self._transport.handle_request(request)

    def close(self) -> None:
        self._transport.close()


class AsyncIdempotencyKeyTransport(httpx.AsyncBaseTransport):
    """The async twin of :class:`IdempotencyKeyTransport`."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        _add_key(request)
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self._transport.aclose()
