"""HTTP facts shared by the proxies (the gateway and the chaos proxy) and the clients."""

from __future__ import annotations

import http.cookiejar
from typing import Any, TypeVar

__all__ = ["HOP_BY_HOP", "drop_tracebacks", "no_cookie_jar"]

_E = TypeVar("_E", bound=BaseException)

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


def drop_tracebacks(exc: _E) -> _E:
    """``exc``, without its traceback and those of the errors it was raised from or during.

    aiohttp keeps a parser's error on the connection's protocol, and the error's traceback
    keeps the frames it passed through, whose locals are that protocol and the bytes it was
    parsing: a reference cycle that holds each failed answer's buffers (up to the 256 KiB head
    cap, and aiohttp's read chunks) until the garbage collector's next full pass. With the
    served commands' collector thresholds (:mod:`retrysafe._gc`) a worker whose endpoint
    answered non-HTTP bytes grew to 0.35-0.9 GB (a fresh user's check: 64 KiB of junk per
    answer, 256 jobs at concurrency 8). The error's type and words are all an attempt
    records; aiohttp's own frames help no one reading a job's ``last_error``. (The gateway
    keeps its upstream's error past its ``except`` block the same way.)
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen or len(seen) >= 16:
            continue
        seen.add(id(err))
        err.__traceback__ = None
        pending += (err.__cause__, err.__context__)
        pending += (a for a in err.args if isinstance(a, BaseException))
    return exc
