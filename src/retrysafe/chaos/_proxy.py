"""The chaos proxy: a real HTTP/1.1 reverse proxy on a real socket that loses answers (SPEC §8).

Requests are parsed with h11 (sans-I/O), forwarded with retrysafe's HTTP engine (aiohttp;
it never retries), and one :class:`~retrysafe.chaos.FaultChoice` per request — drawn from
``random.Random(seed)`` in arrival order — decides what the client gets. "After commit" means
after the upstream's whole answer was read: the upstream finished, whatever it does is done.

Every request writes one JSON line (see ``docs/chaos.md``)::

    {"ts": "2025-01-01T12:00:00.123456+00:00", "seq": 7, "method": "POST", "path": "/posts",
     "idempotency_key": "abc", "fault": "lose_after_commit", "latency_s": 0.0,
     "upstream_status": 201, "upstream_s": 0.012, "outcome": "closed", "client_status": null}
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import json
import logging
import os
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import h11
import httpx

from retrysafe._addresses import reaches_listener
from retrysafe._exceptions import ConfigurationError
from retrysafe._http import HOP_BY_HOP
from retrysafe._wire import AiohttpEngine, WireError, total_timeout
from retrysafe.chaos._faults import Fault, FaultChoice, FaultRates, choose_fault
from retrysafe.core import Problem

__all__ = ["ChaosProxy", "Outcome", "ProxyStats"]

log = logging.getLogger("retrysafe.chaos")

# Hop-by-hop fields (RFC 9110 §7.6.1) and fields this proxy recomputes.
_HOP_BY_HOP = HOP_BY_HOP | {b"host", b"content-length"}
_READ_SIZE = 65536
#: Larger upstream answers are answered 502 (the proxy holds each answer whole).
_MAX_UPSTREAM_BODY = 64 * 1024 * 1024
_MAX_UPSTREAM_CONNECTIONS = 256
_MAX_RECORDS = 100_000


class Outcome:
    """What the client saw, as written in the ``outcome`` field of a log line."""

    ANSWERED = "answered"  #: the upstream's answer, unchanged
    HELD_ANSWERED = "held_answered"  #: the upstream's answer, after the hold
    CLOSED = "closed"  #: connection closed without an answer, after the upstream finished
    RESET = "reset"  #: TCP reset, nothing forwarded
    ERROR_503 = "error_503"  #: a 503 problem from the proxy
    BAD_GATEWAY = "bad_gateway"  #: upstream unreachable or failed: 502 problem
    CLIENT_GONE = "client_gone"  #: the client went away before the answer was sent


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """Counts since the proxy started.

    Attributes:
        requests: requests received.
        by_fault: requests per fault (every :class:`Fault` is a key).
        latency_added: requests that got extra latency.
        upstream_errors: requests the upstream failed to answer (502 to the client).
        by_outcome: requests per client-visible :class:`Outcome`.
    """

    requests: int
    by_fault: dict[Fault, int]
    latency_added: int
    upstream_errors: int
    by_outcome: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable counts."""
        return {
            "requests": self.requests,
            "faults": {f.value: n for f, n in self.by_fault.items()},
            "latency_added": self.latency_added,
            "upstream_errors": self.upstream_errors,
            "outcomes": dict(self.by_outcome),
        }


def _check_upstream(upstream: str) -> httpx.URL:
    """The upstream as an ``httpx.URL``, after the outbox's own URL check (a host, a port
    from 1 to 65535, no whitespace; the gateway's too)."""
    from retrysafe.client._jobs import _check_url, shown_url

    _check_url(upstream, option="upstream")  # a string, http(s), a host: checked there
    try:
        return httpx.URL(upstream)
    except httpx.InvalidURL as exc:
        raise ConfigurationError(
            f"invalid upstream URL {shown_url(upstream)!r}: {exc}", option="upstream"
        ) from exc


def _check_log_path(log_path: str | os.PathLike[str] | None) -> Path | None:
    """The log file's path; its directory must exist (like a SQLite store's, never created)."""
    if log_path is None:
        return None
    path = Path(log_path)
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigurationError(
            f"cannot open the log file {str(path)!r}: directory {str(parent)!r} does not exist",
            option="log",
        )
    return path


class _Conn:
    """One client connection: the h11 state machine and the stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.h11 = h11.Connection(h11.SERVER)
        self.reader = reader
        self.writer = writer

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.reader.read(_READ_SIZE))
                continue
            return event

    async def send(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, reason: bytes = b""
    ) -> None:
        data = self.h11.send(h11.Response(status_code=status, headers=headers, reason=reason))
        assert data is not None
        if body:
            data += self.h11.send(h11.Data(data=body)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        self.writer.write(data)
        await self.writer.drain()

    def abort(self, *, reset: bool = False) -> None:
        if reset:
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    # SO_LINGER on with timeout 0: close() sends RST instead of FIN.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


class ChaosProxy:
    """A fault-injecting HTTP reverse proxy in front of ``upstream`` (SPEC §8).

    Sync use (a background thread with its own event loop)::

        with ChaosProxy("http://127.0.0.1:8000", rates=FaultRates(lose_after_commit=0.1),
                        seed=7) as proxy:
            httpx.post(proxy.url + "/posts", ...)
            proxy.heal()          # every rate to 0, e.g. before reconciling
            print(proxy.stats())

    Async use, in the caller's event loop: ``async with ChaosProxy(...) as proxy`` or
    ``await proxy.start()`` … ``await proxy.aclose()``.

    Args:
        upstream: base URL of the real API, ``http(s)://host[:port][/prefix]``; the request
            target is appended to it.
        rates: the :class:`FaultRates` (default: no faults).
        seed: seed of the ``random.Random`` that chooses faults, one choice per request in
            arrival order; None seeds from the OS (and is then not reproducible).
        host: address to listen on (default loopback).
        port: port to listen on; 0 picks a free one (see :attr:`port` once started).
        log_path: append one JSON line per request to this file; None for no file. Its
            directory must exist.
        upstream_timeout: seconds to wait for the upstream before answering 502.
        on_record: called with every log record (a dict) from the proxy's event loop.

    Raises:
        ConfigurationError: a bad ``upstream`` URL (``option="upstream"``), a ``log_path``
            whose directory does not exist (``option="log"``); from ``start``, a port that
            cannot be bound (``option="listen"``) or a log file that cannot be opened.
    """

    def __init__(
        self,
        upstream: str,
        *,
        rates: FaultRates | None = None,
        seed: int | None = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | os.PathLike[str] | None = None,
        upstream_timeout: float = 30.0,
        on_record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.upstream = _check_upstream(upstream)
        self._rates = rates if rates is not None else FaultRates()
        self.seed = seed
        self._rng = random.Random(seed)
        self.host = host
        self.port = port
        self.log_path = _check_log_path(log_path)
        self._upstream_timeout = upstream_timeout
        self._on_record = on_record
        self._lock = threading.Lock()
        self._seq = 0
        self._by_fault = dict.fromkeys(Fault, 0)
        self._by_outcome: dict[str, int] = {}
        self._latency_added = 0
        self._upstream_errors = 0
        self._records: deque[dict[str, Any]] = deque(maxlen=_MAX_RECORDS)
        self._server: asyncio.Server | None = None
        self._engine: AiohttpEngine | None = None
        self._log: IO[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # Background-thread mode.
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    # -- configuration at runtime -------------------------------------------------------------

    @property
    def rates(self) -> FaultRates:
        """The rates in force now."""
        return self._rates

    def set_rates(self, rates: FaultRates | None = None, **changes: Any) -> FaultRates:
        """Change the rates for the requests that arrive from now on; thread-safe.

        Args:
            rates: new rates, replacing the current ones entirely.
            **changes: fields of :class:`FaultRates` to change on the current (or given) rates.

        Returns:
            The rates now in force.

        Raises:
            ConfigurationError: the new rates are invalid (the old ones stay in force).
        """
        new = rates if rates is not None else self._rates
        if changes:
            new = new.replace(**changes)
        self._rates = new
        return new

    def heal(self) -> FaultRates:
        """Set every rate to 0: from now on the link is healthy (e.g. before reconciling)."""
        return self.set_rates(self._rates.healed())

    @property
    def url(self) -> str:
        """``http://host:port`` the proxy listens on. Valid once started."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stats(self) -> ProxyStats:
        """Counts per fault and outcome since start; thread-safe."""
        with self._lock:
            return ProxyStats(
                requests=self._seq,
                by_fault=dict(self._by_fault),
                latency_added=self._latency_added,
                upstream_errors=self._upstream_errors,
                by_outcome=dict(self._by_outcome),
            )

    def records(self) -> list[dict[str, Any]]:
        """The log records of the last 100 000 requests, in order; thread-safe."""
        with self._lock:
            return list(self._records)

    def _upstream_port(self) -> int:
        return self.upstream.port or (443 if self.upstream.scheme == "https" else 80)

    def _upstream_is_self(self) -> bool:
        """Would forwarding to the upstream reach this proxy's own socket (a loop)?"""
        return reaches_listener(
            self.upstream.host, self._upstream_port(), listen_host=self.host, listen_port=self.port
        )

    def probe_upstream(self, timeout: float = 2.0) -> str | None:
        """Try a TCP connection to the upstream. Returns None if it answers, else the reason."""
        port = self._upstream_port()
        try:
            with socket.create_connection((self.upstream.host, port), timeout=timeout):
                return None
        except OSError as exc:
            return f"cannot connect to upstream {self.upstream.host}:{port}: {exc}"

    # -- async lifecycle ----------------------------------------------------------------------

    async def start(self) -> ChaosProxy:
        """Listen and serve in the running event loop. Returns self.

        Raises:
            ConfigurationError: the address cannot be bound (in use, not local, no permission)
                (``option="listen"``), or the upstream is the proxy's own address, so every
                request would be forwarded to itself (``option="upstream"``).
        """
        if self._server is not None:
            raise RuntimeError("the chaos proxy is already running")
        try:
            server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            reason = (
                "the port is already in use"
                if exc.errno == errno.EADDRINUSE
                else (exc.strerror or str(exc))
            )
            raise ConfigurationError(
                f"cannot listen on {self.host}:{self.port}: {reason}", option="listen"
            ) from exc
        self._server = server
        self.port = server.sockets[0].getsockname()[1]
        if self._upstream_is_self():
            await self.aclose()
            raise ConfigurationError(
                f"upstream {self.upstream} is this proxy's own address ({self.host}:{self.port}):"
                " every request would be forwarded to the proxy itself, without end",
                option="upstream",
            )
        self._engine = AiohttpEngine(
            connect_timeout=self._upstream_timeout,
            read_timeout=self._upstream_timeout,
            max_connections=_MAX_UPSTREAM_CONNECTIONS,
            attempt_timeout=self._upstream_timeout,  # every send runs under total_timeout
        )
        if self.log_path is not None:
            try:
                self._log = self.log_path.open("a", encoding="utf-8")
            except OSError as exc:
                await self.aclose()
                raise ConfigurationError(
                    f"cannot open the log file {self.log_path}: {exc}", option="log"
                ) from exc
        return self

    async def aclose(self) -> None:
        """Stop listening, drop open connections (held answers included) and close the log."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(Exception):
                async with total_timeout(2):
                    await server.wait_closed()
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.aclose()
        log, self._log = self._log, None
        if log is not None:
            log.close()

    async def __aenter__(self) -> ChaosProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- background-thread lifecycle ----------------------------------------------------------

    def start_in_thread(self, *, timeout: float = 10.0) -> ChaosProxy:
        """Run the proxy in a daemon thread with its own event loop. Returns self once listening.

        Raises:
            ConfigurationError: the address cannot be bound; no thread is left running.
        """
        if self._thread is not None:
            raise RuntimeError("the chaos proxy is already running")
        ready = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.start()
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            try:
                await self._stop.wait()
            finally:
                await self.aclose()

        thread = threading.Thread(
            target=asyncio.run, args=(main(),), name=f"chaos-proxy:{self.port}", daemon=True
        )
        self._thread = thread
        thread.start()
        if not ready.wait(timeout):
            self.close()
            raise ConfigurationError(
                f"the chaos proxy did not start within {timeout} s", option="listen"
            )
        if errors:
            thread.join()
            self._thread = None
            raise errors[0]
        return self

    def close(self, *, timeout: float = 10.0) -> None:
        """Stop a proxy started with :meth:`start_in_thread` and wait for its thread, at most
        ``timeout`` seconds (it is a daemon thread: a process that exits never waits for it)."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=timeout)
        self._thread = self._loop = self._stop = None

    def __enter__(self) -> ChaosProxy:
        return self.start_in_thread()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- per connection -----------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Conn(reader, writer)
        try:
            while await self._one_exchange(conn):
                conn.h11.start_next_cycle()
        except asyncio.CancelledError:
            # aclose() (or the loop shutting down) drops the connection. This task is the
            # connection's whole life, so it ends here, quietly: on Python 3.11 asyncio's own
            # done-callback for a cancelled connection task logs "Exception in callback".
            conn.abort()
        except (OSError, h11.LocalProtocolError):
            conn.abort()
        except Exception:
            log.exception("chaos proxy: unexpected error on a client connection")
            conn.abort()
        finally:
            self._tasks.discard(task)
            if not writer.transport.is_closing():
                writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _one_exchange(self, conn: _Conn) -> bool:
        """Serve one request on ``conn``. Returns whether the connection can carry another."""
        try:
            event = await conn.next_event()
            if not isinstance(event, h11.Request):
                return False  # ConnectionClosed, or a stray event
            request = event
            if conn.h11.they_are_waiting_for_100_continue:
                # curl sends "Expect: 100-continue" for larger bodies; don't make it wait.
                conn.writer.write(
                    conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
                )
            chunks: list[bytes] = []
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return False
        except h11.RemoteProtocolError as exc:
            if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                problem = Problem(
                    "bad-request",
                    400,
                    f"malformed HTTP request: {exc}",
                    extra={"title": "Malformed HTTP request"},
                )
                body = problem.body()
                hdrs = [(k.encode(), v.encode()) for k, v in problem.headers(len(body))]
                with contextlib.suppress(Exception):
                    await conn.send(exc.error_status_hint, hdrs, body)
            conn.abort()
            return False

        with self._lock:
            self._seq += 1
            seq = self._seq
            choice = choose_fault(self._rates, self._rng)
            hold_seconds = self._rates.hold_seconds
            self._by_fault[choice.fault] += 1
            self._latency_added += choice.latency > 0
        record: dict[str, Any] = {
            "ts": dt.datetime.now(dt.timezone.utc).isoformat(),
            "seq": seq,
            "method": request.method.decode("ascii", "replace"),
            "path": request.target.decode("ascii", "replace"),
            "idempotency_key": _header(request.headers, b"idempotency-key"),
            "fault": choice.fault.value,
            "latency_s": round(choice.latency, 6),
            "upstream_status": None,
            "upstream_s": None,
            "outcome": None,
            "client_status": None,
        }
        try:
            keep_alive = await self._apply(
                conn, request, b"".join(chunks), choice, hold_seconds, record
            )
        except (OSError, h11.LocalProtocolError):
            record["outcome"] = Outcome.CLIENT_GONE
            record["client_status"] = None
            conn.abort()
            keep_alive = False
        finally:
            if record["outcome"] is None:  # cancelled by aclose()
                record["outcome"] = Outcome.CLIENT_GONE
            self._write_record(record)
        return keep_alive and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE

    async def _apply(
        self,
        conn: _Conn,
        request: h11.Request,
        body: bytes,
        choice: FaultChoice,
        hold_seconds: float,
        record: dict[str, Any],
    ) -> bool:
        if choice.latency > 0:
            await asyncio.sleep(choice.latency)
        fault = choice.fault
        if fault is Fault.RESET_BEFORE_FORWARD:
            record["outcome"] = Outcome.RESET
            conn.abort(reset=True)
            return False
        if fault is Fault.ERROR_BEFORE_FORWARD:
            await self._send_problem(conn, record, "chaos-proxy fault: error_before_forward")
            return True

        upstream = await self._forward(request, body, record)
        if upstream is None:
            await self._send_problem(
                conn, record, record.pop("_error"), status=502, slug="bad-gateway"
            )
            return True
        status, reason, headers, content = upstream
        # The upstream has answered in full: whatever it does is committed.
        if fault is Fault.LOSE_AFTER_COMMIT:
            record["outcome"] = Outcome.CLOSED
            conn.abort()
            return False
        if fault is Fault.ERROR_AFTER_COMMIT:
            await self._send_problem(conn, record, "chaos-proxy fault: error_after_commit")
            return True
        if fault is Fault.HOLD_AFTER_COMMIT:
            if not await self._hold(conn, hold_seconds):
                record["outcome"] = Outcome.CLIENT_GONE
                conn.abort()
                return False
            record["outcome"] = Outcome.HELD_ANSWERED
        else:
            record["outcome"] = Outcome.ANSWERED
        if request.method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
            content = b""
        else:
            headers.append((b"content-length", str(len(content)).encode()))
        record["client_status"] = status
        await conn.send(status, headers, content, reason)
        return True

    async def _forward(
        self, request: h11.Request, body: bytes, record: dict[str, Any]
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes] | None:
        assert self._engine is not None
        target = request.target.decode("ascii", "replace")
        url = str(self.upstream).rstrip("/") + (target if target.startswith("/") else "/" + target)
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers
            if k.lower() not in _HOP_BY_HOP
        ]
        started = time.perf_counter()
        try:
            async with total_timeout(self._upstream_timeout):
                answer = await self._engine.send(
                    request.method.decode("ascii"),
                    url,
                    headers=headers,
                    body=body or None,
                    keep=_MAX_UPSTREAM_BODY + 1,
                )
            if answer.size > _MAX_UPSTREAM_BODY:
                raise WireError(
                    "AnswerTooLarge",
                    f"the upstream's answer has more than {_MAX_UPSTREAM_BODY} bytes",
                    sent=True,
                )
        except (WireError, asyncio.TimeoutError) as exc:
            if isinstance(exc, WireError):
                error = f"{exc.kind}: {exc}"
            else:
                error = f"ReadTimeout: no complete answer within {self._upstream_timeout:g} s"
            record["upstream_s"] = round(time.perf_counter() - started, 6)
            record["upstream_error"] = error
            record["_error"] = f"upstream {self.upstream} failed: {error}"
            with self._lock:
                self._upstream_errors += 1
            log.warning(
                "upstream failed; answering 502",
                extra={"upstream": str(self.upstream), "error": record["upstream_error"]},
            )
            return None
        record["upstream_s"] = round(time.perf_counter() - started, 6)
        record["upstream_status"] = answer.status
        out_headers = [(k, v) for k, v in answer.raw_headers if k.lower() not in _HOP_BY_HOP]
        reason = answer.reason.encode("ascii", "replace")
        return answer.status, reason, out_headers, answer.body

    async def _hold(self, conn: _Conn, seconds: float) -> bool:
        """Wait ``seconds``; False as soon as the client closes its side."""
        deadline = asyncio.get_running_loop().time() + seconds
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return True
            try:  # not asyncio.wait_for: on 3.11 it can drop a cancellation (client/_worker.py)
                async with total_timeout(remaining):
                    data = await conn.reader.read(_READ_SIZE)
            except asyncio.TimeoutError:
                return True
            if not data:
                return False
            conn.h11.receive_data(data)  # pipelined bytes: keep them for the next cycle

    async def _send_problem(
        self,
        conn: _Conn,
        record: dict[str, Any],
        detail: str,
        *,
        status: int = 503,
        slug: str = "chaos-fault",
    ) -> None:
        title = "Upstream unavailable" if status == 502 else "Fault injected by the chaos proxy"
        problem = Problem(slug, status, detail, extra={"title": title})
        body = problem.body()
        headers = [(k.encode(), v.encode()) for k, v in problem.headers(len(body))]
        record["outcome"] = Outcome.BAD_GATEWAY if status == 502 else Outcome.ERROR_503
        record["client_status"] = status
        await conn.send(status, headers, body)

    def _write_record(self, record: dict[str, Any]) -> None:
        record.pop("_error", None)
        with self._lock:
            self._records.append(record)
            outcome = str(record["outcome"])
            self._by_outcome[outcome] = self._by_outcome.get(outcome, 0) + 1
        if self._log is not None:
            self._log.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._log.flush()
        log.debug("chaos request", extra=record)
        if self._on_record is not None:
            try:
                self._on_record(record)
            except Exception:
                log.exception("on_record callback failed", extra={"seq": record["seq"]})


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
