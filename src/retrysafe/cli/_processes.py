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
- signals go to the parent: SIGINT and SIGTERM are forwarded to every child, once each, so
  Ctrl-C once, twice and three times means what it means for one worker. The children have
  a process group of their own, so a terminal's Ctrl-C reaches them through the parent only;
  on Linux a child whose parent dies (SIGKILL) receives SIGTERM (``PR_SET_PDEATHSIG``);
- a child that fails (an error line, a crash, killed) or is stopped by a signal stops the
  others the same way (SIGTERM, or SIGINT); with ``--until-idle`` each child exits once it
  finds nothing left to claim;
- each child writes its JSON lines to the command's stdout, one ``write`` per line; the
  parent prints the one summary (the totals of every child) and exits with the convention's
  code for all of them: 130 / 143 after a signal, else the first failed child's status,
  else 1 when ``--until-idle`` left work UNKNOWN, else 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from retrysafe.cli._common import EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE, fail
from retrysafe.cli._signals import Signals

if TYPE_CHECKING:
    from retrysafe.cli._client import Served

__all__ = ["MAX_PROCESSES", "in_processes", "processes_option"]

#: The most ``--processes`` takes.
MAX_PROCESSES = 256

_F = TypeVar("_F", bound=Callable[..., Any])
_STOPS = (signal.SIGINT, signal.SIGTERM)
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
    processes: int, run: Callable[[int | None], Served], *, check: Callable[[], None]
) -> Served:
    """Run a worker: ``run(None)`` in this process when ``processes`` is 1, else
    ``run(index)`` in each of ``processes`` forked children (``index`` 0, 1, …; a child
    prints no terminal display and no summary: it returns its :class:`Served`), and their
    results merged (:meth:`Served.merged`).

    ``check`` runs first in this process when it forks (open the store and close it again):
    what it fails on is reported once. Exits (``SystemExit``) with the first failed child's
    status when one failed; the children's own error lines are on stderr already."""
    if processes == 1:
        return run(None)
    if not hasattr(os, "fork"):
        fail("--processes: more than one process needs fork (a POSIX system)", EXIT_USAGE)
    check()
    children: dict[int, int] = {}  # pid -> the read end of its result pipe
    forwarded: list[int] = []

    def forward(signum: int, count: int) -> None:
        # From a signal handler: kill(2) only, no lock, no I/O.
        forwarded.append(signum)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    results: list[Served] = []
    failed: int | None = None
    with Signals(forward) as signals:
        for index in range(processes):
            if signals.received is not None:
                break
            read, write = os.pipe()
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
            try:
                pid = os.fork()
                if pid == 0:
                    _child(index, run, write, [read, *children.values()], blocked)
                children[pid] = read
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                os.close(write)
        while children:
            pid, status = os.waitpid(-1, 0)  # a signal's handler runs, then it waits again
            if pid not in children:
                continue
            read = children.pop(pid)
            served = _result(read)
            code = os.waitstatus_to_exitcode(status)
            if served is None or code != 0:
                if code < 0:  # killed by a signal: it said nothing itself
                    code = 128 - code
                    click.echo(
                        f"retrysafe: error: worker process {pid} was killed "
                        f"({signal.Signals(code - 128).name}); the others are stopped",
                        err=True,
                    )
                failed = failed or code or 1
                stop = signal.SIGINT if code == EXIT_SIGINT else signal.SIGTERM
            elif served.code is None:
                results.append(served)
                continue
            else:
                results.append(served)
                stop = signal.SIGINT if served.code == EXIT_SIGINT else signal.SIGTERM
            if not forwarded:  # the first child to stop stops the others, once
                forward(stop, 1)
    from retrysafe.cli._client import Served

    merged = Served.merged(results)
    if signals.exit_code is not None:  # the command itself was stopped
        merged.code = signals.exit_code
    elif failed is not None:
        raise SystemExit(failed)
    return merged


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
    code = 1
    try:
        for fd in close:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)  # the terminal's Ctrl-C reaches the parent, which forwards it once
        parent = os.getppid()
        _die_with(parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if os.getppid() != parent:  # the parent died before the child could watch it
            os._exit(EXIT_SIGTERM)
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        served = run(index)
        os.write(write, json.dumps(served.to_dict()).encode())
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except KeyboardInterrupt:
        with contextlib.suppress(OSError, ValueError):
            click.echo("retrysafe: interrupted", err=True)
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
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
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
