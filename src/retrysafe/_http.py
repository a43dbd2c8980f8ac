"""HTTP facts shared by the proxies (the gateway and the chaos proxy)."""

from __future__ import annotations

import http.cookiejar
from typing import Any

__all__ = ["HOP_BY_HOP", "no_cookie_jar"]

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


class _RefuseCookies(http.cookiejar.DefaultCookiePolicy):
    """A cookie policy that keeps no cookie and sends none."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


def no_cookie_jar() -> http.cookiejar.CookieJar:
    """A cookie jar for an ``httpx`` client that never keeps a cookie from an answer nor adds
    one to a request. A client shared by many requests (the gateway's, the engines') must not
    carry one caller's ``Set-Cookie`` to another's request: a gateway would hand one user's
    session to the next anonymous request; a worker, one tenant's to another's job."""
    return http.cookiejar.CookieJar(policy=_RefuseCookies())
