"""Run an ASGI app under uvicorn on a loopback port: in a background thread
(:class:`ServerThread`: the gateway's tests, the pytest plugin, applications' own tests
through :mod:`retrysafe.testing`) or in a child process (:class:`ServerProcess`: the demo's
service, which so never shares an interpreter lock with the clients it is measured against).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import uvicorn

from retrysafe._exceptions import ConfigurationError

__all__ = [
    "ServerProcess",
    "ServerThread",
    "answers",
    "free_port",
    "last_line",
    "reap",
    "serve_inherited",
    "spawn_child",
    "stop_processes",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``url`` is
    ``http://host:port`` once started.

    Args:
        app: an ASGI application.
        host: loopback address to bind (default ``127.0.0.1``).
        port: TCP port; 0 picks a free one.
        interface: ``"asgi3"`` (default) or ``"wsgi"``.
        startup_timeout: seconds to wait for the socket to listen.

    Raises:
        ConfigurationError: the server did not start (port in use, bad app).
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        interface: str = "asgi3",
        startup_timeout: float = 10.0,
        **uvicorn_options: Any,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._startup_timeout = startup_timeout
        options: dict[str, Any] = {
            "log_level": "warning",
            "access_log": False,
            "lifespan": "off",
            "interface": interface,
            "timeout_graceful_shutdown": 1,
        }
        options.update(uvicorn_options)
        config = uvicorn.Config(app, host=host, port=self.port, **options)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # reported by start()
            self._error = exc

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or self._error is not None:
                raise ConfigurationError(
                    f"server on {self.host}:{self.port} did not start "
                    f"(port in use?): {self._error!r}",
                    option="listen",
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigurationError(
                    f"server on {self.host}:{self.port} did not start within "
                    f"{self._startup_timeout} s",
                    option="listen",
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Seconds a :class:`ServerProcess` gets to shut down on SIGTERM before it is killed.
_STOP_WAIT = 1.5


class _Child(Protocol):
    def stop(self, wait: float = ...) -> None: ...


#: Every live child process of this process (see :func:`stop_processes`): each
#: :class:`ServerProcess` and :class:`~retrysafe.demo._proxy.ProxyProcess`.
_LIVE: set[_Child] = set()


def spawn_child(
    owner: _Child,
    argv: list[str],
    *,
    log: Path | None,
    pipes: bool = False,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` for ``owner`` (a :class:`ServerProcess` or the demo's proxy), which is
    live from now on (:func:`stop_processes`), in a session of its own (a terminal's Ctrl-C
    reaches this process, which stops it). Its output goes to ``log`` (appended; default
    discarded); with ``pipes``, stdin and stdout are pipes to this process (stderr alone to
    ``log``). A failure to start stops ``owner`` and is raised."""
    out = log.open("ab") if log is not None else None
    sink: Any = subprocess.DEVNULL if out is None else out
    try:
        _LIVE.add(owner)
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else sink,
            stderr=sink,
            pass_fds=pass_fds,
            start_new_session=True,
        )
    except BaseException:
        owner.stop()
        raise
    finally:
        if out is not None:
            out.close()


def reap(proc: subprocess.Popen[bytes], wait: float) -> None:
    """Wait ``wait`` seconds for a child asked to stop, then SIGKILL it; returns once it is
    gone."""
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def last_line(log: Path | None) -> str:
    """``": <the last line of output in log>"``, or ``""`` (no log, or nothing in it)."""
    if log is None:
        return ""
    with contextlib.suppress(OSError):
        lines = log.read_text(errors="replace").strip().splitlines()
        if lines:
            return ": " + lines[-1][:300]
    return ""


class ServerProcess:
    """``python -m MODULE ARGS --fd FD --parent PID``: a child process serving HTTP on a
    loopback socket that this process opened and holds (so the port is known before the child
    starts and no other process can take it).

    The child runs in a session of its own (a terminal's Ctrl-C reaches the parent, which
    stops it) and exits when its parent is gone (see :func:`serve_inherited`). Use as a
    context manager, or call :meth:`start` / :meth:`stop`; ``url`` is ``http://host:port``.

    Args:
        module: the child's module; its ``main`` serves with :func:`serve_inherited`.
        args: its arguments (``--fd`` and ``--parent`` are added).
        log: a file for the child's output (default: discarded).
        startup_timeout: seconds to wait for the child's first answer.

    Raises:
        ConfigurationError: (``start``) the child exited or did not answer in time; the
            message ends with its last output when ``log`` is given.
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        log: Path | None = None,
        startup_timeout: float = 20.0,
    ) -> None:
        self.module = module
        self.args = list(args)
        self.log = log
        self.startup_timeout = startup_timeout
        self.host = "127.0.0.1"
        self.port = 0
        self._listener: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        listener = self._listener = _above_stdio(
            socket.create_server((self.host, 0), backlog=1024)
        )
        self.port = listener.getsockname()[1]
        fd = listener.fileno()
        argv = [sys.executable, "-m", self.module, *self.args]
        argv += ["--fd", str(fd), "--parent", str(os.getpid())]
        self.proc = spawn_child(self, argv, log=self.log, pass_fds=(fd,))
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_serving(self) -> None:
        """Until the child answers a request (a ``GET /``, which publishes nothing): the held
        socket accepts connections into its backlog before any process serves it."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ConfigurationError(
                    f"the server process ({self.module}) exited with status {code} before it "
                    f"served{self.last_output()}",
                    option="listen",
                )
            if answers(self.host, self.port):
                return
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"the server process ({self.module}) did not answer within "
                    f"{self.startup_timeout:g} s{self.last_output()}",
                    option="listen",
                )
            time.sleep(0.02)

    def exited(self) -> int | None:
        """The child's exit status once it has exited (a negative signal number when a
        signal ended it), else None (running, or never started)."""
        return None if self.proc is None else self.proc.poll()

    def last_output(self) -> str:
        """``": <the child's last line of output>"``, or ``""`` (no log, or nothing in it)."""
        return last_line(self.log)

    def stop(self, wait: float = _STOP_WAIT) -> None:
        """SIGTERM, then SIGKILL after ``wait`` seconds; returns once the child is gone and
        the socket closed. Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            reap(proc, wait)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        _LIVE.discard(self)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _above_stdio(sock: socket.socket) -> socket.socket:
    """``sock`` on a descriptor above 2. A parent started with stdin or stdout closed gets
    descriptor 0 or 1 for a new socket, which the child's ``/dev/null`` stdin or its log then
    replaced (the child failed with "Socket operation on non-socket")."""
    if sock.fileno() > 2:
        return sock
    moved = socket.socket(fileno=fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 3))
    sock.close()
    return moved


def answers(host: str, port: int, path: str = "/") -> bool:
    """Whether an HTTP server on ``host:port`` answers one ``GET path`` within 0.5 s (any
    status). A connection alone proves nothing: a held socket accepts into its backlog while
    no process serves it."""
    probe = http.client.HTTPConnection(host, port, timeout=0.5)
    try:
        probe.request("GET", path)
        probe.getresponse().read()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        probe.close()


def stop_processes() -> None:
    """Kill every live child of this process at once (:class:`ServerProcess`, the demo's
    proxy; SIGKILL, waited for): for a process about to exit without unwinding (a forced exit
    on a second signal)."""
    for server in list(_LIVE):
        server.stop(wait=0.0)


def serve_inherited(
    app: Any, fd: int, parent: int, *, on_orphaned: Callable[[], None] | None = None
) -> None:
    """The child's side of :class:`ServerProcess`: serve ``app`` under uvicorn on the
    inherited listening socket ``fd`` until SIGTERM, or until process ``parent`` is gone (a
    parent killed outright cannot stop its child: the child then exits within 0.1 s, after
    ``on_orphaned``, whose errors are ignored: the parent's cleanup that never ran)."""

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.1)
        if on_orphaned is not None:
            with contextlib.suppress(Exception):
                on_orphaned()
        os._exit(0)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    config = uvicorn.Config(
        app, log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=1
    )
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd)])
