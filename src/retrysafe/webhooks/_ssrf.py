"""The SSRF guard (SPEC §6): refuse endpoints that resolve to private, loopback, link-local,
multicast or reserved addresses, and pin the address that was checked.

A check at registration alone is not enough: DNS can answer a public address then, and
``127.0.0.1`` or ``169.254.169.254`` at send time (DNS rebinding). So every attempt resolves
the host once with :func:`socket.getaddrinfo`, refuses the request when *any* address is
not allowed, and connects to the checked address itself — the request keeps its original
``Host`` header and, over TLS, its original server name (SNI, certificate check) through
httpcore's ``sni_hostname`` extension. Nothing resolves the name a second time.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import TYPE_CHECKING

import httpx

from retrysafe._exceptions import DestinationRefusedError
from retrysafe._wire import WireError

if TYPE_CHECKING:
    from types import TracebackType

__all__ = [
    "DestinationRefused",
    "PinnedTransport",
    "SSRFGuard",
    "address_problem",
    "resolve_checked",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class DestinationRefused(httpx.ConnectError):
    """Raised inside the transport (so the attempt is recorded as not sent, error type
    ``DestinationRefused``, and retried like a DNS failure until the schedule ends)."""


def address_problem(ip: IPAddress) -> str | None:
    """Why ``ip`` is refused (``"loopback"``, ``"private"``, …), or None when it is a
    global unicast address.

    IPv6 addresses that carry an IPv4 address are judged by it too: IPv4-mapped
    (``::ffff:0:0/96``), 6to4 (``2002::/16``, RFC 3056) and Teredo (``2001::/32``, RFC 4380:
    server and client), so ``[2002:7f00:1::]`` is refused as loopback. An embedded address
    that passes does not make the IPv6 address pass: it is still checked itself.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        else:
            embedded = [ip.sixtofour] if ip.sixtofour is not None else []
            embedded += list(ip.teredo or ())
            for v4 in embedded:
                problem = address_problem(v4)
                if problem is not None:
                    return problem
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "not globally routable"
    return None


def resolve_checked(host: str, port: int, *, allow_private: bool, url: str) -> list[IPAddress]:
    """Resolve ``host`` and check every address (blocking: ``socket.getaddrinfo``).

    Returns:
        The addresses, in resolver order (the first is the one to pin).

    Raises:
        DestinationRefusedError: the host does not resolve, or (unless ``allow_private``)
            one of its addresses is refused.
    """
    try:
        literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise DestinationRefusedError(
                f"{url}: host {host!r} does not resolve ({why})", url=url, reason="unresolved"
            ) from exc
        addresses = []
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
            if ip not in addresses:
                addresses.append(ip)
        if not addresses:
            raise DestinationRefusedError(
                f"{url}: host {host!r} has no address", url=url, reason="unresolved"
            )
    if not allow_private:
        for ip in addresses:
            problem = address_problem(ip)
            if problem is not None:
                raise DestinationRefusedError(
                    f"{url} resolves to {problem} address {ip}; webhooks to private networks "
                    "are refused (SSRF guard) unless allowed: Webhooks(..., "
                    "allow_private=True), or --allow-private on the command line",
                    url=url,
                    address=str(ip),
                    reason=problem,
                )
    return addresses


class SSRFGuard:
    """The guard for the default HTTP engine (:class:`retrysafe._wire.AddressGuard`): the
    engine's resolver calls :meth:`resolve` for every new connection and connects only to
    the addresses it returns, all checked; IP literals are checked by :meth:`check_literal`
    before the request. The request keeps its URL, so ``Host``, SNI and the certificate
    check use the original name.

    Args:
        allow_private: allow private, loopback and link-local destinations.
    """

    def __init__(self, *, allow_private: bool = False) -> None:
        self.allow_private = allow_private

    def check_literal(self, host: str, port: int, url: str) -> None:
        self.resolve(host, port, url)

    def resolve(self, host: str, port: int, url: str) -> list[str]:
        try:
            addresses = resolve_checked(host, port, allow_private=self.allow_private, url=url)
        except DestinationRefusedError as exc:
            raise WireError("DestinationRefused", str(exc), sent=False) from exc
        return [str(ip) for ip in addresses]


class PinnedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that resolves, checks and pins every request's address.

    Args:
        inner: the transport that really sends (default ``AsyncHTTPTransport(retries=0)``).
        allow_private: allow private, loopback and link-local destinations.
    """

    def __init__(
        self, inner: httpx.AsyncBaseTransport | None = None, *, allow_private: bool = False
    ) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport(retries=0)
        self.allow_private = allow_private

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        host = url.host
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            literal = True
        except ValueError:
            literal = False
        try:
            if literal:
                addresses = resolve_checked(
                    host, port, allow_private=self.allow_private, url=str(url)
                )
            else:
                addresses = await asyncio.to_thread(
                    resolve_checked, host, port, allow_private=self.allow_private, url=str(url)
                )
        except DestinationRefusedError as exc:
            raise DestinationRefused(str(exc), request=request) from exc
        if not literal:
            pinned = str(addresses[0])
            request.url = url.copy_with(host=pinned)
            # The Host header was set from the original URL when the request was built;
            # TLS still sends and checks the original name.
            if url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": host}
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()
