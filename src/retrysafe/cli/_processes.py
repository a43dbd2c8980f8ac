"""``--processes N`` for the workers (``retrysafe worker``, ``retrysafe webhooks worker``): N
worker processes from one command, forked once the command has loaded.

A worker process started on its own pays for its start-up: the interpreter, click, aiohttp and
the store's driver take about 0.3 s of CPU here before the first job is claimed, and four of
them on two cores start the first attempt 0.8 s into the run (``benchmarks/outbox_bench.py
--workers 4``, docs/performance.md). Forked after the command has loaded, each child starts
with all of that done and opens only its own store connection and event loop. Nothing is
forked while a connection, a thread or an event loop is open: the parent opens the store once
beforehand (one error line, not N, when it cannot be used) and closes it again.

How the processes behave together (docs/cli.md):

- each child is one worker with the command's options (``--concurrency`` attempts in flight
  each); they share the store's queue as separately started workers do (claims, leases);
- signals go to the command: SIGINT and SIGTERM are passed to every child, once each, so
  Ctrl-C once, twice and three times means what it means for one worker. The children are
  in the command's process group (a terminal's Ctrl-Z stops them all, ``stty tostop``
  applies to them as to the command), so a terminal's Ctrl-C reaches them too: they ignore
  SIGINT and take the command's SIGUSR1 as their Ctrl-C, counted once. A SIGTERM that
  reaches them twice (the group's and the command's) stops them as one does. On Linux a
  child whose parent dies (SIGKILL) receives SIGTERM (``PR_SET_PDEATHSIG``); a child still
  running once its stop's time is up (the grace plus 5 s after SIGTERM or Ctrl-C, 1 s
  after a third Ctrl-C) is killed, so a stopped or wedged process cannot hold the command;
- a child that fails (an error line, a crash, killed) or has stopped on a signal of its own
  stops the others the same way (SIGTERM, or Ctrl-C); with ``--until-idle`` each child
  exits once it finds nothing left to claim;
- each child writes its JSON lines to the command's stdout, one ``write`` per line; the
  parent prints the one summary (the totals of every child that returned one) and exits with
  the convention's code for all of them: 130 / 143 after a signal, else the first failed
  child's status, else 1 when ``--until-idle`` left work UNKNOWN, else 0.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from retrysafe.cli._common import EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE, fail
from retrysafe.cli._signals import SHUTDOWN_SECONDS, Signals

if TYPE_CHECKING:
    from retrysafe.cli._client import Served

__all__ = ["MAX_PROCESSES", "again_line", "in_processes", "processes_option"]

#: The most ``--processes`` takes.
MAX_PROCESSES = 256

_F = TypeVar("_F", bound=Callable[..., Any])
#: A child takes SIGTERM as a worker does; Ctrl-C comes as SIGUSR1, from the command only.
_AS_SENT: dict[int, int] = {signal.SIGINT: signal.SIGUSR1}
#: Blocked around fork, so that none arrives before the child has its handlers.
_CHILD_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
#: Seconds between two looks at the children (and at the signals the command received).
_POLL = 0.02
#: Seconds the children get to exit after a third Ctrl-C.
_FORCED_LIMIT = 1.0
#: Linux's ``prctl`` option that sends the child a signal when its parent dies.
_PR_SET_PDEATHSIG = 1


def processes_option(fn: _F) -> _F:
    """``--processes N`` (default 1)."""
    return click.option(
        "--processes",
        type=click.IntRange(min=1, max=MAX_PROCESSES),
        default=1,
        show_default=True,
        help="Worker processes, each with --concurrency attempts in flight, forked once the "
        "command has loaded (POSIX). More than one helps where one process's CPU is the "
        "limit and the store takes writers in parallel (PostgreSQL, several cores).",
    )(fn)


def in_processes(
    processes: int,
    run: Callable[[int | None], Served],
    *,
    check: Callable[[], float],
    what: str,
) -> Served:
    """Run a worker: ``run(None)`` in this process when ``processes`` is 1, else
    ``run(index)`` in each of ``processes`` forked children (``index`` 0, 1, …; a child
    prints no terminal display and no summary: it returns its :class:`Served`), and their
    results merged (:meth:`Served.merged`; ``failed``: the first failed child's status).

    ``check`` runs first in this process when it forks (open the store and close it again),
    so that what it fails on is reported once; it returns the workers' grace (seconds a
    SIGTERM lets in-flight attempts finish). A child still running :data:`SHUTDOWN_SECONDS`
    after its grace once stopped (SIGTERM, Ctrl-C), or one second after a third Ctrl-C (a
    stopped or wedged process), is killed (SIGKILL; the result is then ``forced``: its jobs
    were not all given back); ``what`` names the work in the lines said (jobs,
    deliveries)."""
    if processes == 1:
        return run(None)
    if not hasattr(os, "fork"):
        fail("--processes: more than one process needs fork (a POSIX system)", EXIT_USAGE)
    grace = check()
    children: dict[int, int] = {}  # pid -> the read end of its result pipe
    sent: list[int] = []  # the stop signals the children were sent, in order

    def forward(signum: int, count: int = 0) -> None:
        # From a signal handler too: kill(2) only, no lock, no I/O.
        sent.append(signum)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _AS_SENT.get(signum, signum))

    results: list[Served] = []
    failed: int | None = None
    with Signals(forward) as signals:
        for index in range(processes):
            if signals.received is not None:
                break
            read, write = _pipe()
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_STOPS)
            try:
                pid = os.fork()
                if pid == 0:
                    _child(index, run, write, [read, *children.values()], blocked)
                children[pid] = read
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                os.close(write)
        deadline, seen, said_again, killed = math.inf, 0, False, False
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                while seen < len(sent):  # a stop sent since: when the children must be gone
                    deadline = min(deadline, time.monotonic() + _limit(sent[: seen + 1], grace))
                    seen += 1
                if sent.count(signal.SIGINT) >= 2 and not said_again:
                    said_again = True
                    click.echo(again_line(what), err=True)
                if time.monotonic() > deadline and not killed:
                    killed = True
                    click.echo(
                        f"retrysafe: error: {len(children)} worker process(es) still running "
                        f"after the stop's limit ({', '.join(map(str, children))}): killed; "
                        f"their in-flight {what} wait out their lease, then go again with the "
                        "same key",
                        err=True,
                    )
                    for child in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child, signal.SIGKILL)
                time.sleep(_POLL)
                continue
            if pid not in children:
                continue
            read = children.pop(pid)
            served = _result(read)
            code = os.waitstatus_to_exitcode(status)
            if code < 0 and sent and -code == _AS_SENT.get(sent[-1], sent[-1]):
                continue  # the stop it was sent ended it before it could take it: stopped
            if served is None or code != 0:
                if code < 0:  # killed by a signal: it said nothing itself
                    code = 128 - code
                    if not killed:
                        click.echo(
                            f"retrysafe: error: worker process {pid} was killed "
                            f"({signal.Signals(code - 128).name}); the others are stopped",
                            err=True,
                        )
                failed = failed or code or 1
                stop = signal.SIGINT if code == EXIT_SIGINT else signal.SIGTERM
            else:
                results.append(served)
                if served.error is not None:  # its stdout failed: it stopped, so do all
                    failed = failed or 1
                elif served.code is None:
                    continue
                stop = signal.SIGINT if served.code == EXIT_SIGINT else signal.SIGTERM
            if not sent:  # the first child to stop stops the others, once
                forward(stop)
        if sent:  # the command is exiting after a stop: a later Ctrl-C is ignored
            signals.ignore_after(signal.SIGINT)
    from retrysafe.cli._client import Served

    merged = Served.merged(results)
    if signals.received is not None:  # the command was stopped: as the children say, or so
        merged.code = merged.code or signals.exit_code
    elif failed is not None:  # the others stopped because one failed: its status
        merged.code = None
    merged.failed = failed
    merged.forced = merged.forced or killed  # their jobs were not all given back
    return merged


def again_line(what: str) -> str:
    """What a second Ctrl-C says while in-flight ``what`` (jobs, deliveries) are given back."""
    return (
        f"retrysafe: interrupted: giving back the in-flight {what}; interrupt again to exit at once"
    )


def _limit(sent: list[int], grace: float) -> float:
    """Seconds the children get to exit after the last of the stop signals ``sent``: one
    second after a third Ctrl-C (one worker exits at once then), else the grace plus
    :data:`SHUTDOWN_SECONDS` -- after Ctrl-C too, where giving jobs back waits for a locked
    store as long as one worker would (about 10 s on PostgreSQL)."""
    if sent.count(signal.SIGINT) >= 3:
        return _FORCED_LIMIT
    return grace + SHUTDOWN_SECONDS


def _pipe() -> tuple[int, int]:
    """A pipe for a child's result whose ends are not descriptors 0-2: started with stdout
    closed (``>&-``), ``pipe(2)`` would hand out 1, which the child's output would then use."""
    ends = []
    for fd in os.pipe():
        if fd < 3:
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            os.close(fd)
            fd = moved
        ends.append(fd)
    return ends[0], ends[1]


def _result(read: int) -> Served | None:
    """A child's :class:`Served` from its pipe, or None when it wrote none (it failed)."""
    from retrysafe.cli._client import Served

    chunks = []
    with contextlib.suppress(OSError):
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
    os.close(read)
    if not chunks:
        return None
    try:
        return Served.from_dict(json.loads(b"".join(chunks)))
    except (ValueError, TypeError, KeyError):
        return None


def _child(
    index: int,
    run: Callable[[int | None], Served],
    write: int,
    close: list[int],
    blocked: Iterable[int],
) -> NoReturn:
    """The forked child: run the worker, write its result, exit; it never returns into the
    parent's stack (click's ``main`` and the ``with`` blocks the parent is in)."""
    from retrysafe.cli import _client

    code = 1
    try:
        for fd in close:
            os.close(fd)
        # The terminal's Ctrl-C reaches the whole process group, the command included,
        # which passes each one on as SIGUSR1: taking SIGINT too would count it twice.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.default_int_handler)  # until the loop takes it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _client.INTERRUPT, _client.SAY_AGAIN = signal.SIGUSR1, False
        parent = os.getppid()
        _die_with(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if os.getppid() != parent:  # the parent died before the child could watch it
            os._exit(EXIT_SIGTERM)
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        served = run(index)
        with contextlib.suppress(OSError):  # the command was killed: nobody reads it
            os.write(write, json.dumps(served.to_dict()).encode())
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except KeyboardInterrupt:  # the command's Ctrl-C before the loop took it: it says so
        code = EXIT_SIGINT
    except click.ClickException as exc:
        with contextlib.suppress(OSError, ValueError):
            exc.show()
        code = exc.exit_code
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):  # the lines still to write (no atexit here)
            _client.drain_stdout()
        for stream in (sys.stdout, sys.stderr):  # None: started with the descriptor closed
            with contextlib.suppress(Exception):  # nothing may keep os._exit from running
                if stream is not None:
                    stream.flush()
        os._exit(code)


def _die_with(parent: int) -> None:
    """On Linux, have the kernel send this process SIGTERM when its parent dies, so a killed
    parent leaves no worker running on its own (elsewhere nothing watches)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
