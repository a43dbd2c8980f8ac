"""A lean asyncio transport for the Redis key store's async face: one Redis server, plain TCP.

Every command of one event loop goes over one connection, pipelined: a command is packed by
hiredis, appended to the connection's output (written once per event-loop iteration, so the
claims of many concurrent requests leave in one ``send``), and its future is answered in order
as hiredis parses the replies in ``data_received``. There is no connection pool to check out
from, no lock per command and no timer per command, which is where redis-py's asyncio client
spends most of a command's time: about 55 µs of CPU per EVALSHA against 7 µs here, with 32
concurrent callers; in ``benchmarks/middleware_bench.py`` the middleware serves 3,711 req/s on
it against 2,214 on redis-py's client (variants (f) and (i)). Redis runs one connection's
commands in order and a Lua script atomically, so pipelining changes no outcome.

What it keeps from redis-py: URLs are read by redis-py's ``parse_url``, replies that are errors
become redis-py's exception classes (``NoScriptError``, ``ReadOnlyError``, ``BusyLoadingError``
…), and failures raise ``redis.ConnectionError`` / ``redis.TimeoutError`` /
``redis.AuthenticationError``, so :meth:`RedisStore._translate <retrysafe.stores.RedisStore>`
stays the one translation into retrysafe's errors.

Failure handling: no reply for ``timeout`` seconds while commands are pending (a paused or
hung server), a reset, or a protocol error closes the connection and fails every pending
command (``TimeoutError`` / ``ConnectionError``: the store answers them as unavailable); the
next command opens a new connection. A command whose caller was cancelled still gets its reply
read, in order, and dropped.

Used only when hiredis is installed (``pip install retrysafe[redis]`` installs it) and the URL
is plain ``redis://host:port/db`` with optional user and password. TLS (``rediss://``), Unix
sockets, clusters and other connection options go through redis-py's own asyncio client.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, cast

import redis
from hiredis import ProtocolError, Reader, ReplyError, pack_command  # pack_command: hiredis >= 2.1
from redis.asyncio.connection import parse_url

from retrysafe._wire import total_timeout

try:  # redis-py's mapping of error replies to exception classes (redis >= 5)
    from redis._parsers.base import BaseParser
except ImportError:  # pragma: no cover - older layouts
    BaseParser = None  # type: ignore[assignment,misc]


def _parse_error(response: str) -> redis.RedisError:
    """The exception redis-py raises for an error reply (``NOSCRIPT …``: NoScriptError)."""
    if BaseParser is None:  # pragma: no cover
        return redis.ResponseError(response)
    error: redis.RedisError = BaseParser.parse_error(response)  # type: ignore[no-untyped-call]
    return error


__all__ = ["RedisWire", "wire_options"]


def _pack(args: Sequence[Any]) -> bytes:
    """One command in RESP, packed by hiredis (str, bytes, int and float arguments)."""
    packed: bytes = pack_command(tuple(args))
    return packed

_PLAIN = frozenset({"host", "port", "db", "username", "password"})


def wire_options(url: str) -> dict[str, Any] | None:
    """The connection options of ``url`` when the lean transport can serve it (``redis://``,
    host, port, db, user, password, nothing else), else None (redis-py serves it)."""
    try:
        options = parse_url(url)
    except ValueError:
        return None
    if not url.lower().startswith("redis://") or not set(options) <= _PLAIN:
        return None
    return dict(options)


class _Connection(asyncio.Protocol):
    """One pipelined connection: commands out in order, futures answered in order."""

    def __init__(self, where: str, timeout: float | None) -> None:
        self.where = where
        self.timeout = timeout
        self.reader = Reader()
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.progress = 0.0  # monotonic time of the last reply (or of the first pending command)
        self.watchdog: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Any stream transport: asyncio's own, or uvloop's (uvicorn's loop wherever uvloop is
        # installed, as `uvicorn[standard]` does), which does not subclass asyncio.Transport.
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        pending = self.pending
        reader.feed(data)
        try:
            while True:
                reply = reader.gets()
                if reply is False:
                    break
                future = pending.popleft()
                if future.done():  # its caller was cancelled: the reply is read and dropped
                    continue
                if isinstance(reply, ReplyError):
                    future.set_exception(_parse_error(str(reply)))
                else:
                    future.set_result(reply)
        except (ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked
            self.fail(redis.ConnectionError(f"protocol error from {self.where}: {exc!r}"))
            return
        if pending:
            self.progress = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc is not None else ""
        self.fail(redis.ConnectionError(f"Connection closed by server {self.where}{why}"))

    # ------------------------------------------------------------------ commands
    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue one packed command; its future gets the reply (or the failure)."""
        future: asyncio.Future[Any] = self.loop.create_future()
        if self.closed:
            future.set_exception(redis.ConnectionError(f"Connection to {self.where} closed"))
            return future
        out = self.out
        if not out:
            self.loop.call_soon(self.flush)
        out.append(packed)
        pending = self.pending
        if not pending:
            self.progress = time.monotonic()
            if self.watchdog is None and self.timeout is not None:
                self.watchdog = self.loop.call_later(self.timeout, self.check)
        pending.append(future)
        return future

    def flush(self) -> None:
        """Write what this event-loop iteration queued, in one write."""
        out, self.out = self.out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def check(self) -> None:
        """The watchdog: fail everything when no reply came for ``timeout`` seconds."""
        self.watchdog = None
        if self.closed or not self.pending or self.timeout is None:
            return
        idle = time.monotonic() - self.progress
        if idle >= self.timeout:
            self.fail(redis.TimeoutError(f"Timeout reading from {self.where}"))
        else:
            self.watchdog = self.loop.call_later(self.timeout - idle, self.check)

    def fail(self, exc: redis.RedisError) -> None:
        """Close the connection and fail every pending command with ``exc``. Idempotent."""
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        pending, self.pending = self.pending, deque()
        for future in pending:
            if not future.done():
                future.set_exception(exc)
        self.out = []
        if self.transport is not None:
            self.transport.abort()


class RedisWire:
    """The lean transport of one event loop (see the module docstring).

    Args:
        options: from :func:`wire_options` (host, port, db, username, password).
        timeout: seconds a pending command may wait for its reply (None: for ever).
        connect_timeout: seconds to open a connection and log in.
    """

    def __init__(
        self, options: Mapping[str, Any], *, timeout: float | None, connect_timeout: float | None
    ) -> None:
        self.host = str(options.get("host") or "localhost")
        self.port = int(options.get("port") or 6379)
        self.db = int(options.get("db") or 0)
        self.username: str | None = options.get("username")
        self.password: str | None = options.get("password")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.where = f"{self.host}:{self.port}"
        self._conn: _Connection | None = None
        self._opening: asyncio.Lock | None = None
        self._closed = False

    def call(self, args: Sequence[Any]) -> Awaitable[Any]:
        """Send one command (``("EVALSHA", sha, n, *keys, *args)``) and await its reply.

        Raises:
            redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError: the server
                could not be reached, stopped answering, or refused the login.
            redis.ResponseError: the server answered with an error (a subclass for known
                codes, e.g. ``NoScriptError``).
        """
        conn = self._conn
        if conn is None or conn.closed:
            return self._call_connecting(args)
        return conn.send(_pack(args))

    async def _call_connecting(self, args: Sequence[Any]) -> Any:
        conn = await self._connected()
        return await conn.send(_pack(args))

    async def _connected(self) -> _Connection:
        if self._closed:
            raise redis.ConnectionError(f"Connection to {self.where} closed")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = await self._open()
            return conn

    async def _open(self) -> _Connection:
        conn = _Connection(self.where, self.timeout)
        try:
            if self.connect_timeout is None:
                await self._dial(conn)
            else:  # not asyncio.wait_for: on 3.11 it can drop a cancellation
                async with total_timeout(self.connect_timeout):
                    await self._dial(conn)
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is an OSError
            error: redis.RedisError = redis.TimeoutError(f"Timeout connecting to {self.where}")
            conn.fail(error)
            raise error from None
        except OSError as exc:
            error = redis.ConnectionError(
                f"Error {exc.errno} connecting to {self.where}. {exc.strerror or exc}."
            )
            conn.fail(error)
            raise error from None
        except BaseException as exc:
            why = exc if isinstance(exc, redis.RedisError) else None
            conn.fail(why or redis.ConnectionError(f"connecting to {self.where} failed"))
            raise
        return conn

    async def _dial(self, conn: _Connection) -> None:
        """Connect, then log in and select the database (pipelined, one round trip)."""
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: conn, self.host, self.port)
        steps: list[tuple[str, asyncio.Future[Any]]] = []
        if self.password is not None:
            login: tuple[Any, ...] = ("AUTH", self.password)
            if self.username:
                login = ("AUTH", self.username, self.password)
            steps.append(("login", conn.send(_pack(login))))
        if self.db:
            steps.append(("select", conn.send(_pack(("SELECT", self.db)))))
        # Every step's outcome is collected, so none is left with an unread failure.
        outcomes = await asyncio.gather(*(f for _, f in steps), return_exceptions=True)
        for (step, _), outcome in zip(steps, outcomes, strict=True):
            if step == "login" and isinstance(outcome, redis.ResponseError):
                raise redis.AuthenticationError(str(outcome))
            if isinstance(outcome, BaseException):
                raise outcome

    async def aclose(self) -> None:
        """Close the connection; pending commands fail. Idempotent."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.fail(redis.ConnectionError(f"Connection to {self.where} closed"))
