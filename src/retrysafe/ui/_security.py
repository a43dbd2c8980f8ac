"""The console's guard: it can change things, so every request passes here first.

* **Host check** (DNS rebinding): a console without a token answers only requests whose
  ``Host`` names a loopback address (``127.0.0.1``, ``localhost``, ``[::1]``, any port) —
  a page on another site that rebinds its name to 127.0.0.1 gets 421, not the console.
* **Token** (``--token`` / ``RETRYSAFE_UI_TOKEN``): when configured, every page but the login
  form and the static files needs it — ``Authorization: Bearer <token>`` for scripts, or the
  login cookie the form sets (HttpOnly, SameSite=Strict; an HMAC of the token, so a new token
  logs everyone out).
* **CSRF** (OWASP's synchronizer token pattern): every form carries a token derived from the
  browser's session cookie with a per-process secret; an action whose token is missing or
  wrong is refused (403) before it reads the store. A script that sends the token as
  ``Authorization: Bearer`` needs none (no browser adds that header by itself). A
  cross-site POST (``Sec-Fetch-Site: cross-site``, or an ``Origin`` that is not the
  console's) is refused too.
* **Headers** on every answer: a Content-Security-Policy allowing only the console's own
  scripts, styles and images, no framing, no referrer to other sites, no caching,
  ``nosniff``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "AUTH_COOKIE",
    "LOGIN_MAX_AGE",
    "SESSION_COOKIE",
    "Guard",
    "Secrets",
    "is_loopback_host",
    "local_path",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SESSION_COOKIE = "retrysafe_console_session"
#: Seconds a wrong token (login form or Bearer) costs its sender.
REFUSAL_DELAY = 1.0
AUTH_COOKIE = "retrysafe_console_auth"
#: Seconds a login lasts (the cookie's Max-Age, and checked on every request): 12 hours.
LOGIN_MAX_AGE = 12 * 3600
#: Paths reachable without the token (relative to the console's root).
_OPEN = ("/login", "/static/")
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", _CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # same-origin, not no-referrer: with no-referrer a browser sends "Origin: null" on the
    # console's own form posts, which the cross-site check could not tell from a sandboxed
    # attacker's page; other sites still get no referrer.
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a Host header's name, without the port) names this machine's
    loopback interface: ``localhost`` or a loopback address literal."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name part of a Host header value (``[::1]:8090`` → ``[::1]``); a value whose
    "port" is not one (``127.0.0.1:8090, evil``) is returned whole, so it names no host."""
    if value.startswith("["):
        name, close, rest = value.partition("]")
        if not close or (rest and not (rest[0] == ":" and _PORT.fullmatch(rest[1:]))):
            return value
        return name + "]"
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        return name if _PORT.fullmatch(port) else value
    return value


_PORT = re.compile(r"[0-9]{1,5}")


class Secrets:
    """The console's secrets: the operator's token (or None) and a per-process key for the
    CSRF tokens (a restart invalidates open forms: reload and submit again).

    Args:
        token: the access token, or None for a loopback console without one.
    """

    def __init__(self, token: str | None) -> None:
        self.token = token
        self._key = secrets.token_bytes(32)

    def csrf_token(self, session: str) -> str:
        """The CSRF token of a browser session (hex HMAC-SHA256 of its session cookie)."""
        return hmac.new(self._key, b"csrf:" + session.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: str | None, given: str | None) -> bool:
        """Whether ``given`` is the CSRF token of ``session`` (constant-time)."""
        if not session or not given:
            return False
        return hmac.compare_digest(self.csrf_token(session), given)

    def auth_value(self, now: float | None = None) -> str:
        """A new login cookie's value, ``<issued>.<nonce>.<mac>``: when it was issued (Unix
        seconds), 16 random bytes (every login gets its own value), and an HMAC-SHA256 of both
        keyed by the token (never the token itself). Stateless, so a console mounted in an app
        with several worker processes accepts it in each; valid for :data:`LOGIN_MAX_AGE`
        seconds or until the token changes."""
        assert self.token is not None
        issued = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(16)
        return f"{issued}.{nonce}.{self._login_mac(issued, nonce)}"

    def _login_mac(self, issued: str, nonce: str) -> str:
        assert self.token is not None
        message = f"retrysafe-console-login:{issued}:{nonce}".encode()
        return hmac.new(self.token.encode(), message, hashlib.sha256).hexdigest()

    def login_ok(self, cookie: str, now: float | None = None) -> bool:
        """Whether ``cookie`` is a login cookie of this token, issued less than
        :data:`LOGIN_MAX_AGE` seconds ago (and not in the future)."""
        if self.token is None:
            return False
        issued, _, rest = cookie.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (issued.isdigit() and len(issued) <= 12 and nonce and mac):
            return False
        age = (time.time() if now is None else now) - int(issued)
        if not -60 <= age < LOGIN_MAX_AGE:
            return False
        return hmac.compare_digest(self._login_mac(issued, nonce), mac)

    def token_ok(self, given: str | None) -> bool:
        """Whether ``given`` is the token (constant-time)."""
        if self.token is None or given is None:
            return False
        return hmac.compare_digest(self.token.encode(), given.encode("utf-8", "replace"))

    def bearer(self, headers: dict[bytes, bytes]) -> bool:
        """Whether a request carries the token as ``Authorization: Bearer`` (a script: a
        browser never adds that header to a cross-site request on its own, so such a request
        needs no CSRF token)."""
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, value = auth.partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def authorized(self, headers: dict[bytes, bytes], cookies: dict[str, str]) -> bool:
        """Whether a request carries the token (Bearer) or the login cookie; always True
        without a token."""
        if self.token is None or self.bearer(headers):
            return True
        cookie = cookies.get(AUTH_COOKIE)
        return cookie is not None and self.login_ok(cookie)


def cookies_of(headers: dict[bytes, bytes]) -> dict[str, str]:
    """The request's cookies (a malformed Cookie header reads as none)."""
    raw = headers.get(b"cookie", b"").decode("latin-1")
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # http.cookies raises CookieError and others on hostile input
        return {}
    return {k: m.value for k, m in jar.items()}


class Guard:
    """Pure ASGI middleware in front of the console (see the module docstring).

    Args:
        app: the console's Starlette app.
        secrets: the token and CSRF key.
        loopback_only: answer only requests whose Host is a loopback name (the default of a
            console without a token; a console mounted in another app passes False).
    """

    def __init__(self, app: ASGIApp, *, secrets: Secrets, loopback_only: bool) -> None:
        self.app = app
        self.secrets = secrets
        self.loopback_only = loopback_only
        self._refusals: Any = None

    async def refused_token(self, scope: Scope) -> None:
        """Log a wrong token and make its sender wait :data:`REFUSAL_DELAY` seconds, one
        refusal at a time (the login form and Bearer headers share the lock)."""
        import asyncio
        import logging

        client = (scope.get("client") or ("?",))[0]
        logging.getLogger("retrysafe.ui").warning(
            "console token refused", extra={"client": client}
        )
        if self._refusals is None:
            self._refusals = asyncio.Lock()
        async with self._refusals:
            await asyncio.sleep(REFUSAL_DELAY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.loopback_only and not is_loopback_host(_host_name(host)):
            await _plain(
                send,
                421,
                "This console answers only on a loopback address (127.0.0.1, localhost, "
                "[::1]); give it a --token to serve other names.",
            )
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        local = path[len(root) :] if root and path.startswith(root) else path
        cookies = cookies_of(headers)
        scope.setdefault("state", {})
        scope["state"]["cookies"] = cookies
        scope["state"]["bearer"] = self.secrets.token is not None and self.secrets.bearer(headers)
        if not local.startswith(_OPEN) and not self.secrets.authorized(headers, cookies):
            if headers.get(b"authorization"):
                # A wrong Bearer token costs what a wrong login costs: a second, one at a
                # time, and a log line.
                await self.refused_token(scope)
            if scope.get("method") == "GET" and b"text/html" in headers.get(b"accept", b""):
                query = scope.get("query_string", b"").decode("latin-1")
                target = local + ("?" + query if query else "")
                await _redirect(send, f"{root}/login?next={_safe_next(target)}")
            else:
                await _plain(
                    send,
                    401,
                    "This console needs its token: log in at /login, or send "
                    "Authorization: Bearer <token>.",
                )
            return
        if scope.get("method") not in ("GET", "HEAD") and _cross_site(headers, host):
            await _plain(send, 403, "Refused: a cross-site request cannot act on this console.")
            return

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def local_path(path: str) -> str:
    """``path`` if it is a path of this console (``/jobs?state=unknown``), else ``/``: never
    ``//evil.example``, ``/\\evil.example`` (browsers read both as another host), a scheme,
    or control characters. For every redirect and "back" link a form carries."""
    if (
        not path.startswith("/")
        or path[1:2] in ("/", "\\")
        or len(path) > 500
        or any(ord(c) < 33 or c in "\\\"'<>`" for c in path)
    ):
        return "/"
    return path


def _safe_next(path: str) -> str:
    """A login redirect's target: a path of this console only (never ``//evil``)."""
    from urllib.parse import quote

    # Every "?", "=" and "&" encoded: the whole target is the one value of ``next``, so
    # /jobs?state=unknown&queue=billing comes back with both filters.
    return quote(local_path(path), safe="/")


def _cross_site(headers: dict[bytes, bytes], host: str) -> bool:
    """Whether a state-changing request comes from another site."""
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
    if site == "cross-site":
        return True
    origin = headers.get(b"origin", b"").decode("latin-1")
    if origin and origin != "null":
        parts = urlsplit(origin)
        return _authority(parts.scheme, parts.netloc) != _authority(parts.scheme, host)
    # "null": a sandboxed frame, a file: page, or a page with Referrer-Policy: no-referrer
    # (a console behind a proxy that sets it): Sec-Fetch-Site tells the console's own apart.
    return origin == "null" and site != "same-origin"


def _authority(scheme: str, netloc: str) -> str:
    """``host[:port]`` lower case, the scheme's default port dropped (``a:443`` = ``a``)."""
    netloc = netloc.lower()
    default = {"https": ":443", "http": ":80"}.get(scheme.lower())
    if default and netloc.endswith(default):
        return netloc[: -len(default)]
    return netloc


async def _plain(send: Send, status: int, text: str) -> None:
    body = (text + "\n").encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _redirect(send: Send, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [
                (b"location", location.encode("latin-1", "replace")),
                (b"content-length", b"0"),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": b""})
