"""HTTP facts shared by the proxies (the gateway and the chaos proxy)."""

from __future__ import annotations

__all__ = ["HOP_BY_HOP"]

#: Hop-by-hop header fields (RFC 9110 §7.6.1): meaningful for one connection only, so a proxy
#: never forwards them. Lower-case bytes, as in ASGI and h11.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
