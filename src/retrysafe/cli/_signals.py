"""SIGINT / SIGTERM for long-running commands, without raising from a signal handler.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
happens to be: inside an import, holding a lock, half-way through a ``finally``. Raising
``KeyboardInterrupt`` there can leave an import lock or a ``threading`` lock held forever
(``retrysafe demo`` hung on SIGTERM that way). So the handler here only records the signal
— an attribute assignment, no lock, no I/O — and the command's main flow polls
:meth:`Signals.wait`, stops its servers and threads in the ordinary way, removes its files and
exits with :attr:`Signals.exit_code` (130 for SIGINT, 143 for SIGTERM: 128 + the number, as a
shell reports it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

__all__ = [
    "GRACE",
    "SHUTDOWN_SECONDS",
    "Signals",
    "Stopper",
    "hang_up_as_sigterm",
    "quiet_server",
    "server_config",
]

#: Every long-running command exits within this many seconds of SIGINT or SIGTERM.
SHUTDOWN_SECONDS = 5.0

_HANDLED = (signal.SIGINT, signal.SIGTERM)


def hang_up_as_sigterm() -> None:
    """A closed terminal or a dropped SSH session (SIGHUP) stops the command as SIGTERM does
    (a worker finishes and records its in-flight attempts, a server closes its store; exit
    143) instead of killing it where it stands (a worker's in-flight jobs then waited out
    their lease). SIGHUP is forwarded as SIGTERM to this process, so each command's own
    SIGTERM handling applies, or SIGTERM's default where it has none.

    Left alone when SIGHUP is not at its default (``nohup`` ignores it; an embedding program
    may handle it), off the main thread, and where the platform has no SIGHUP."""
    hangup = getattr(signal, "SIGHUP", None)
    if (
        hangup is None
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(hangup) is not signal.SIG_DFL
    ):
        return
    signal.signal(hangup, _forward_as_sigterm)


def _forward_as_sigterm(signum: int, frame: FrameType | None) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class Signals:
    """Record SIGINT and SIGTERM while the block runs; never raise from the handler.

    Use as a context manager in the main thread (elsewhere it records nothing: only the main
    thread receives signals). The previous handlers are restored on exit.

    Args:
        on_signal: called from the handler with the signal number and how many signals
            arrived so far; it must not block, take locks or raise (set a flag).

    Attributes:
        received: the first signal's number, or None.
        count: how many SIGINT/SIGTERM arrived.
    """

    def __init__(self, on_signal: Callable[[int, int], None] | None = None) -> None:
        self.received: int | None = None
        self.count = 0
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum
        if self._on_signal is not None:
            self._on_signal(signum, self.count)

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in _HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def ignore_after(self, sig: int) -> None:
        """Leave ``sig`` ignored when the block ends (the process is exiting), instead of
        putting its previous handler back: no moment between the two where it is neither."""
        if sig in self._previous:
            self._previous[sig] = signal.SIG_IGN

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str | None:
        """``"SIGINT"`` or ``"SIGTERM"`` once one arrived, else None."""
        return None if self.received is None else signal.Signals(self.received).name

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number (130 for SIGINT, 143 for SIGTERM), or None."""
        return None if self.received is None else 128 + self.received

    def wait(self, timeout: float, *, step: float = 0.05) -> bool:
        """Sleep until a signal arrived or ``timeout`` seconds passed; True if one arrived.

        Polls every ``step`` seconds: the handler only sets an attribute, so nothing can
        wake a blocked wait, and polling a flag needs no lock the handler could contend for.
        """
        deadline = time.monotonic() + timeout
        while self.received is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(step, remaining))
        return True

    def describe(self) -> str:
        """``"interrupted (SIGINT)"`` or ``"terminated (SIGTERM)"``."""
        if self.received == signal.SIGTERM:
            return "terminated (SIGTERM)"
        return "interrupted (SIGINT)"


class Stopper:
    """The :class:`Signals` callback: stops uvicorn the way it stops itself, by flags its
    loop looks at every 0.1 s (the first signal gracefully, a second at once)."""

    def __init__(self) -> None:
        self.server: Any = None

    def __call__(self, signum: int, count: int) -> None:
        server = self.server
        if server is None:  # not yet created: the command checks signals before running it
            return
        if count > 1:
            server.force_exit = True
        server.should_exit = True


#: Seconds a served command's in-flight requests get after SIGINT/SIGTERM, within the
#: 5-second exit convention.
GRACE = int(SHUTDOWN_SECONDS) - 2


def server_config(app: Any, host: str, port: int, **options: Any) -> Any:
    """The uvicorn config of a served command (gateway, ui): uvicorn's own lines through the
    command's JSON logging, no access log, no ``Server`` header, in-flight requests given
    :data:`GRACE` seconds on shutdown; ``options`` add or override uvicorn's."""
    import uvicorn

    defaults: dict[str, Any] = {
        "log_level": "warning",
        "log_config": None,
        "access_log": False,
        "server_header": False,
        "timeout_graceful_shutdown": GRACE,
    }
    return uvicorn.Config(app, host=host, port=port, **{**defaults, **options})


def quiet_server(config: Any) -> Any:
    """A uvicorn server for ``config`` that leaves signals to the command: it neither
    installs handlers of its own nor re-raises the signal after shutting down (uvicorn
    does both), so the command exits 130 or 143 with its store closed. The requests its
    shutdown cancels are logged as warnings, not errors (:class:`~retrysafe._logging.
    ShutdownCancels`)."""
    import uvicorn

    from retrysafe._logging import quiet_shutdown_cancels

    quiet_shutdown_cancels()

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            import asyncio

            cut = asyncio.ensure_future(_cut_when_forced(self))
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return Server(config)


async def _cut_when_forced(server: Any) -> None:
    """A second signal (uvicorn's ``force_exit``) during the grace cancels the requests still
    running at once, as the grace's end would: uvicorn stops waiting for them but still waits
    for their connections to close, which lasted until the grace ended (2.9 s after the
    second signal on Python 3.12 and later, whose ``Server.wait_closed`` waits for every
    connection). A cancelled request's key stays claimed."""
    import asyncio

    # A plain flag a signal handler sets, which uvicorn itself polls every 0.1 s.
    while not server.force_exit:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    for task in list(server.server_state.tasks):
        task.cancel(msg="stopped at once by a second signal")
