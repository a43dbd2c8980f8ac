"""``retrysafe worker | jobs | reconcile | dlq``: the outbox from the command line.

Human tables (rich) by default, ``--json`` for scripts; errors are one line on stderr
(``retrysafe: error: …``) and the exit codes of docs/cli.md (:mod:`retrysafe.cli._common`):
0 done, 1 failed or work left undone (jobs still UNKNOWN), 2 usage or bad input, 130 / 143
stopped by SIGINT / SIGTERM. No command here creates a store (``retrysafe migrate`` does): reading
commands open a SQLite store read-only, and every command refuses a store that does not exist.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from retrysafe._exceptions import ConfigurationError, StoreUnavailableError
from retrysafe.cli._common import (
    EXIT_FAILED,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    LAST_LINES_WAIT,
    LINES_BACKLOG,
    SQL_STORES,
    Number,
    StrParamType,
    check_can_ask,
    driver_lines_to,
    epilog,
    errors,
    fail,
    json_option,
    limit_hint,
    metrics_option,
    opened_store,
    plain_table,
    print_table,
    read_json_argument,
    rerun_with,
    serving_metrics,
    shown_value,
    stdout_may_close,
    stdout_to_null,
    store_option,
    visible_text,
    warning_lines,
)
from retrysafe.cli._processes import again_line, in_processes, processes_option
from retrysafe.client import (
    DEAD_LETTER_STATES,
    Attempt,
    Job,
    JobState,
    Outbox,
    ReconcileReport,
    RetryPolicy,
)
from retrysafe.client._jobs import shown_url
from retrysafe.client._outbox import DEFAULT_MAX_BODY, MAX_BODY_HINT
from retrysafe.client._policy import MAX_CONCURRENCY
from retrysafe.client._worker import DEFAULT_LEASE, GRACE_MARGIN, Worker, WorkerStats
from retrysafe.core import lease_timing

__all__ = ["dlq", "jobs", "reconcile_command", "worker"]

_STATES = [s.value for s in JobState]
_LIMIT = click.IntRange(min=1, max=1_000_000)
_CONCURRENCY = click.IntRange(min=1, max=MAX_CONCURRENCY)
_ATTEMPTS = click.IntRange(min=1, max=1000)
_SECONDS = Number()
_F = TypeVar("_F", bound=Callable[..., Any])
_AGE = Number(zero=True)
_SUBMIT_FLAGS = {
    "url": "URL",
    "method": "--method",
    "headers": "-H/--header",
    "deadline": "--deadline",
    "payload": "--data",
    "key": "--key",
}


class JobId(StrParamType):
    """A job id or the start of one: 1–32 hex digits (ids are 32, from ``build_job``); a
    webhook delivery's id is its job's."""

    name = "job_id"
    _HEX = re.compile(r"[0-9a-fA-F]{1,32}")

    def __init__(self, what: str = "job", listing: str = "jobs list") -> None:
        self.what, self.listing = what, listing

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or self._HEX.fullmatch(value) is None:
            self.fail(
                f"{shown_value(value, 60)} is not a {self.what} id (1–32 hex digits, e.g. the "
                f"first 12 that `{self.listing}` shows)",
                param,
                ctx,
            )
        return value.lower()


JOB_ID = JobId()
#: A webhook delivery's id (its job's), as ``webhooks dlq`` lists them.
DELIVERY_ID = JobId("delivery", "webhooks dlq list")


class Method(StrParamType):
    """An HTTP method for a job: a letter, then letters, digits, ``-`` or ``_`` (32 at most;
    ``POST``, ``PUT``, ``PATCH``, ``DELETE``, extension methods such as ``M-SEARCH``)."""

    name = "method"
    _METHOD = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or self._METHOD.fullmatch(value) is None:
            self.fail(f"{shown_value(value, 60)} is not an HTTP method (e.g. POST)", param, ctx)
        return value.upper()


@contextmanager
def _outbox(
    store: str,
    policy: RetryPolicy | None = None,
    *,
    write: bool = True,
    flags: Mapping[str, str] | None = None,
    max_body: int | None = DEFAULT_MAX_BODY,
) -> Iterator[Outbox]:
    """The outbox of an existing store (a reader opens SQLite read-only); retrysafe errors
    inside become one error line and the convention's exit code."""
    with (
        errors(store, flags),
        opened_store(store, write=write) as opened,
        Outbox(opened, policy=policy, max_body=max_body) as outbox,
    ):
        yield outbox


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=True))


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _url(url: str) -> str:
    """A job URL as the CLI prints it: a ``user:password@`` part (possible in stores written
    before submit refused them) is never shown."""
    return shown_url(url, limit=sys.maxsize)


def _job_dict(job: Job, *, body: bool = False) -> dict[str, Any]:
    data = job.to_dict(body=body)
    data["url"] = _url(job.url)
    return data


def _jobs_table(jobs: list[Job], title: str) -> Any:
    table = plain_table(title=title)
    table.add_column("id", no_wrap=True, min_width=12)
    table.add_column("state", no_wrap=True)
    for col in ("attempts", "last", "method", "url", "created", "key"):
        table.add_column(col, overflow="fold")
    for j in jobs:
        last = f"{j.last_status or ''} {j.last_outcome or ''}".strip()
        table.add_row(
            j.id[:12],
            j.state.value,
            str(j.attempts),
            last,
            j.method,
            _url(j.url),
            _when(j.created_at),
            j.key,
        )
    return table


def _attempts_table(
    attempts: list[Attempt], *, title: str = "attempts", jobs: list[str] | None = None
) -> Any:
    """The attempts, one row each; ``jobs`` (the job id of each attempt) adds a job column."""
    table = plain_table(title=title)
    columns = ["#", "started", "duration", "outcome", "status", "error", "replayed", "counted"]
    for col in ["job", *columns] if jobs is not None else columns:
        table.add_column(col)
    for i, a in enumerate(attempts):
        cells = [
            str(a.number),
            _when(a.started_at),
            f"{a.duration:.3f}s",
            a.outcome,
            "" if a.status is None else str(a.status),
            a.error_type or "",
            "yes" if a.replayed else "",
            "yes" if a.counted else "no",
        ]
        table.add_row(*([jobs[i][:12], *cells] if jobs is not None else cells))
    return table


def _policy(attempts: int, timeout: float, wait_initial: float, wait_max: float) -> RetryPolicy:
    """The retry policy from the command's flags; a bad value is bad input (exit 2, nothing
    changed), named by its flag."""
    try:
        return RetryPolicy(
            attempts=attempts, timeout=timeout, wait_initial=wait_initial, wait_max=wait_max
        )
    except ConfigurationError as exc:
        option = (exc.option or "timeout").replace("_", "-")
        fail(f"--{option}: {exc}", code=2)


# ---------------------------------------------------------------------- worker
def lease_options(what: str) -> Callable[[_F], _F]:
    """``--lease``, ``--heartbeat`` and ``--max-run-time`` of a worker command that sends
    ``what`` (``"jobs"``, ``"deliveries"``): the Worker's lease options, checked by
    :func:`check_lease_timing` before the store is opened."""

    def decorate(f: _F) -> _F:
        for option in reversed(
            (
                click.option(
                    "--lease",
                    type=_SECONDS,
                    default=None,
                    help=f"Seconds a dead worker's {what} wait before another worker sends "
                    "them (default 10; a live worker renews the lease, so it may be shorter "
                    "than the attempt's timeout).",
                ),
                click.option(
                    "--heartbeat",
                    type=_SECONDS,
                    default=None,
                    help="Seconds between lease renewals (default lease / 3; must be shorter "
                    "than --lease).",
                ),
                click.option(
                    "--max-run-time",
                    type=_SECONDS,
                    default=None,
                    help="Seconds after which an attempt's lease is no longer renewed "
                    "(default 3600, at least 2 × timeout).",
                ),
            )
        ):
            f = option(f)
        return f

    return decorate


def check_lease_timing(
    lease: float | None, heartbeat: float | None, max_run_time: float | None
) -> None:
    """Exit 2 on lease options the worker would refuse (too large, a heartbeat not shorter
    than the lease), before the store is opened: a bad flag never opens a store. Warnings are
    left to the worker, which prints each once."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lease_timing(
                DEFAULT_LEASE if lease is None else lease,
                heartbeat=heartbeat,
                max_run_time=3600.0 if max_run_time is None else max_run_time,
            )
    except ConfigurationError as exc:
        option = (exc.option or "lease").replace("_", "-")
        fail(f"--{option}: {exc}", code=2)


def outage_bound(until_idle: bool) -> dict[str, Any]:
    """The Worker options that bound how long ``--until-idle`` waits out a store it cannot
    reach before it gives up (the worker raises StoreUnavailableError, and the command exits 1
    with its message). The place for a ``--store-outage-limit SECONDS`` flag: the Worker's
    ``store_outage_limit`` (issue 11) applies its own default meanwhile. Without
    ``--until-idle`` a worker waits out any outage, as a service should."""
    return {}


@contextlib.contextmanager
def _on_signal(sig: signal.Signals, callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` on the running event loop when ``sig`` arrives while inside (no
    exception raised from a signal handler); where the loop takes no signal handlers (not
    the main thread, Windows), ``sig`` keeps its action. On the way out the handler from
    before is put back: asyncio's own removal leaves SIGINT raising KeyboardInterrupt, and a
    Ctrl-C while ``asyncio.run`` was still closing the loop then ended it with "Event loop
    stopped before Future completed" (a fresh user's check, Ctrl-C six times, 3 ms apart)."""
    loop = asyncio.get_running_loop()
    installed = False
    previous = signal.getsignal(sig)
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(sig, callback)
        installed = True
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(sig)
            if previous is not None:  # None: set outside Python, left as asyncio leaves it
                signal.signal(sig, previous)


#: The signal that is Ctrl-C to a worker: SIGINT, except in a ``--processes`` child, which
#: ignores SIGINT and is passed each Ctrl-C by the command as SIGUSR1 (retrysafe.cli.
#: _processes); there the command says the second press's line, once (``SAY_AGAIN``).
INTERRUPT: int = signal.SIGINT
SAY_AGAIN = True


class _Interrupts:
    """Ctrl-C for a command that runs an event loop (the worker, the webhook worker,
    ``reconcile``): the first cancels the work, whose in-flight jobs (``what``) are then
    given back; a second while they are says so and is otherwise ignored (users press it
    twice: asyncio's own handler cut the giving back short, leaving jobs in flight until
    their lease ended, and one landing as the process exited printed a traceback); a third
    exits at once (``forced``). Handled on the event loop, or only counted while no loop
    runs: no exception is raised from a signal handler. Once the command was stopped by a
    signal, SIGINT is ignored until the process exits.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self.forced = False
        self._task: asyncio.Task[Any] | None = None

    def _record(self, signum: int, frame: object) -> None:
        self.count += 1

    def exception_handler(
        self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]
    ) -> None:
        """The event loop's handler of errors nobody retrieved: after a third Ctrl-C it drops
        them (the store driver's work cut short as the loop closes printed some 55 lines of
        traceback: a fresh user's check, PostgreSQL refusing connections); before, asyncio's
        own."""
        if self.forced:
            message = context.get("message")
            logging.getLogger("retrysafe.cli").debug("after a forced exit: %s", message)
            return
        loop.default_exception_handler(context)

    def _on_loop(self) -> None:
        self.count += 1
        if self.count == 2:
            if SAY_AGAIN:
                click.echo(again_line(self.what), err=True)
            return
        self.forced = self.count > 2
        if self._task is not None:
            self._task.cancel()

    @contextlib.contextmanager
    def in_loop(self) -> Iterator[None]:
        """Inside the running task: Ctrl-C cancels it (see the class). After a Ctrl-C counted
        before the loop took SIGINT the work does not start (CancelledError): cancelled at
        its first await, a reconcile's claim landed all the same and its jobs stayed
        IN_FLIGHT (a fresh user's check: 6 of 15 runs)."""
        self._task = asyncio.current_task()
        with _on_signal(signal.Signals(INTERRUPT), self._on_loop):
            if self.count:
                raise asyncio.CancelledError
            yield

    @contextlib.contextmanager
    def around_loop(self, stopped: Callable[[], bool]) -> Iterator[None]:
        """Around ``asyncio.run``: count Ctrl-C while no loop takes it; afterwards ignore it
        if ``stopped()`` or a Ctrl-C came (the process is exiting), else put the previous
        handler back. A KeyboardInterrupt or the cancelled task's CancelledError from
        inside counts as a Ctrl-C and is not raised."""
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(INTERRUPT, self._record) if main_thread else None
        try:
            yield
        except KeyboardInterrupt:
            self.count = max(self.count, 1)
        except asyncio.CancelledError:
            if not self.count:
                raise
        finally:
            if main_thread:  # closing the loop put back Python's KeyboardInterrupt
                ignore = self.count or stopped()
                signal.signal(INTERRUPT, signal.SIG_IGN if ignore else previous)


@dataclass
class Served:
    """How :func:`serve` ended: the worker's stats; the exit code a signal asks for (143
    SIGTERM, 130 SIGINT) or None; ``forced``: a third Ctrl-C cut the giving back of in-flight
    jobs short (those not given back wait out their lease, then go again, same key)."""

    stats: WorkerStats
    code: int | None
    forced: bool = False
    #: ``--processes``: the exit status of the first child that failed (or was killed).
    failed: int | None = None
    #: The line the command exits 1 with, and no summary (its stdout failed).
    error: str | None = None
    #: The line the command exits 1 with after its summary: ``--until-idle`` gave up on a
    #: store unavailable for ``store_outage_limit``.
    gave_up: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "stats": self.stats.to_dict(),
            "code": self.code,
            "forced": self.forced,
            "error": self.error,
            "gave_up": self.gave_up,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Served:
        """The inverse of :meth:`to_dict` (a ``--processes`` child's result)."""
        return cls(
            WorkerStats(**data["stats"]),
            data["code"],
            bool(data["forced"]),
            error=data.get("error"),
            gave_up=data.get("gave_up"),
        )

    @classmethod
    def merged(cls, parts: Sequence[Served]) -> Served:
        """Several workers' ends as one (``--processes``): the counters summed; stopped by
        SIGINT if one was, else by SIGTERM if one was; ``forced`` if one was."""
        total = WorkerStats()
        for part in parts:
            for name, value in vars(part.stats).items():
                if isinstance(value, dict):
                    into = getattr(total, name)
                    for key, n in value.items():
                        into[key] = into.get(key, 0) + n
                else:
                    setattr(total, name, getattr(total, name) + value)
        codes = {part.code for part in parts}
        code = next((c for c in (EXIT_SIGINT, EXIT_SIGTERM) if c in codes), None)
        error = next((part.error for part in parts if part.error is not None), None)
        gave_up = next((part.gave_up for part in parts if part.gave_up is not None), None)
        forced = any(part.forced for part in parts)
        return cls(total, code, forced, error=error, gave_up=gave_up)


def serve(w: Worker, *, until_idle: bool, what: str = "jobs") -> Served:
    """Run ``w`` in this thread until idle (``until_idle``) or stopped.

    SIGTERM stops it gracefully (no new claims; in-flight attempts finish within the grace,
    by default the attempt timeout plus 5 s, and are recorded); Ctrl-C cancels in-flight
    attempts and releases their jobs (``what``; twice and three times: :class:`_Interrupts`).
    Both are handled on the event loop (no exception raised from a signal handler).
    """
    terminated = False
    interrupts = _Interrupts(what)

    async def main() -> WorkerStats:
        def on_sigterm() -> None:
            nonlocal terminated
            terminated = True
            w.stop()

        loop = asyncio.get_running_loop()
        loop.set_exception_handler(interrupts.exception_handler)
        with _on_signal(signal.SIGTERM, on_sigterm), interrupts.in_loop():
            return await w.serve(until_idle=until_idle)

    stats = w.stats
    with interrupts.around_loop(lambda: terminated):
        try:
            stats = asyncio.run(main())
        except StoreUnavailableError as exc:  # --until-idle past store_outage_limit
            return Served(w.stats, None, gave_up=str(exc))
    if interrupts.count:
        return Served(w.stats, EXIT_SIGINT, interrupts.forced)
    return Served(stats, EXIT_SIGTERM if terminated else None)


def finish(served: Served, *, until_idle: bool, what: str) -> None:
    """Exit as the convention says once a worker returned: 130 / 143 after a signal, the
    status of a ``--processes`` child that failed, 1 when ``--until-idle`` left ``what``
    (jobs, deliveries) UNKNOWN, else 0."""
    stats, code = served.stats, served.code
    if served.gave_up is not None:
        fail(served.gave_up)
    if code == EXIT_SIGINT:
        if served.forced:
            click.echo(
                f"retrysafe: interrupted: in-flight {what} not yet released wait out their "
                "lease, then are sent again with the same key",
                err=True,
            )
        elif stats.unreleased:
            click.echo(
                f"retrysafe: interrupted: in-flight {what} released (pending, same key), "
                f"except {stats.unreleased} the store could not take back (locked or "
                "unavailable): those wait out their lease, then are sent again with the same "
                "key",
                err=True,
            )
        else:
            click.echo(
                f"retrysafe: interrupted: in-flight {what} released (pending, same key)",
                err=True,
            )
        raise SystemExit(code)
    if code == EXIT_SIGTERM:
        click.echo(
            f"retrysafe: stopped by SIGTERM: in-flight {what} finished or released (pending, "
            "same key)"
            + (
                f"; {stats.lease_lost} not recorded under their lease (the store could not be "
                "written, the lease was taken over, or the job was deleted meanwhile): a job "
                "still stored is sent again with the same key once its lease ends"
                if stats.lease_lost
                else ""
            )
            + (
                f"; except {stats.unreleased} the store could not take back (locked or "
                "unavailable): those wait out their lease, then are sent again with the same key"
                if stats.unreleased
                else ""
            )
            + (
                "; those of a worker process killed at the stop's limit were not: they wait "
                "out their lease, then are sent again with the same key"
                if served.forced
                else ""
            ),
            err=True,
        )
        raise SystemExit(code)
    if served.failed is not None:  # a --processes child failed: its line was said
        raise SystemExit(served.failed)
    if until_idle and stats.unknown:
        # Deliveries are sent again with their hooks (signature, schedule) by a replay from
        # the dead-letter queue; the outbox's reconcile would send them unsigned.
        again = (
            "`retrysafe webhooks dlq replay --all` sends them again with the same webhook-id"
            if what == "deliveries"
            else "`retrysafe reconcile` re-sends them with the same key"
        )
        fail(
            f"{what} left UNKNOWN: {stats.unknown} (their effect may or may not have "
            f"happened; {again})",
            EXIT_FAILED,
        )


class _Stdout:
    """A worker's stdout, written by a thread of its own so that the event loop never waits
    for its reader: a log shipper that stalls, ``| less``, Ctrl-S left the loop blocked in
    ``write``, answers that had arrived unread until their attempts timed out and leases
    unrenewed until another worker took the jobs over -- a request sent again after its 200
    (a fresh user's check: 15 of 1,500 jobs with a reader 25 s late), and SIGTERM or Ctrl-C
    ignored until the reader came back.

    Up to :data:`LINES_BACKLOG` lines wait; while that many do, later ones are dropped and counted
    (``dropped``). A reader that left (EPIPE) drops the rest, as for every command's
    results; a stdout that fails otherwise (a full disk, an I/O error) sets ``failed`` and
    calls ``on_failure`` (the worker's thread-safe ``stop``). One per process
    (:func:`stdout_lines`), so a summary follows the attempt lines in order."""

    def __init__(self) -> None:
        self.failed: OSError | None = None
        self.on_failure: Callable[[], None] | None = None
        self.dropped = 0
        self._gone = False
        self._closed = False
        #: Lines not yet written. Appended under the lock and taken whole by the writing
        #: thread every :data:`_EVERY` seconds: no wake-up per line (one per line, with its
        #: GIL hand-over, cost the worker 7 % of its jobs a second).
        self._pending: list[bytes] = []
        self._writing = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        #: The stream this writes to (None: started with descriptor 1 closed, nowhere to
        #: write), and its descriptor, written directly so that no lock of the stream is held
        #: while a reader is behind; a stream without one (click's test runner) is written.
        self.stream: Any = sys.stdout
        self._fd: int | None = None
        if self.stream is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.stream.flush()
                self._fd = self.stream.fileno()
        threading.Thread(target=self._drain, name="retrysafe-stdout", daemon=True).start()
        atexit.register(self.wait, LAST_LINES_WAIT)  # what is pending when the command exits

    def close(self) -> None:
        """Let the writing thread end once it has written what is pending."""
        self._closed = True
        self._wake.set()

    def put(self, line: str) -> None:
        """Add ``line`` (no newline) without waiting; dropped (counted) when
        :data:`LINES_BACKLOG` lines are pending."""
        if self.stream is None or self._gone:
            return
        data = line.encode("utf-8", "replace") + b"\n"
        with self._lock:
            if len(self._pending) >= LINES_BACKLOG:
                self.dropped += 1
                return
            self._pending.append(data)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every pending line to be written; False when
        the reader has not taken them by then (they are dropped with the process)."""
        deadline = time.monotonic() + timeout
        self._wake.set()
        while (self._pending or self._writing) and not self._gone:
            if time.monotonic() >= deadline:  # the reader is away: give up on the rest
                with self._lock:
                    self.dropped += len(self._pending)
                    self._pending = []
                    self._gone = True
                return False
            time.sleep(0.005)
            self._wake.set()
        return True

    def _drain(self) -> None:
        while True:
            self._wake.wait(_EVERY)
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, []
                self._writing = bool(batch)
            try:
                for chunk in _chunks(batch):
                    if self._gone:
                        break
                    self._write(chunk)
            finally:
                self._writing = False
            if self._closed and not self._pending:
                return

    def _write(self, line: bytes) -> None:
        try:
            if self._fd is None:
                self.stream.write(line.decode("utf-8"))
                self.stream.flush()
                return
            while line:
                line = line[os.write(self._fd, line) :]
        except BrokenPipeError:  # the reader left (`| head -1`): the rest goes nowhere
            self._gone = True
            stdout_to_null()
        except (OSError, ValueError) as exc:  # ValueError: a stream closed under it
            self._gone = True
            self.failed = exc if isinstance(exc, OSError) else OSError(str(exc))
            stdout_to_null()
            if self.on_failure is not None:
                self.on_failure()


#: Seconds between two writes of what is pending (and the longest a line waits for one).
_EVERY = 0.05
def _chunks(lines: list[bytes]) -> Iterator[bytes]:
    """``lines`` joined into writes of at most ``PIPE_BUF`` bytes (4 KiB on Linux), cut
    between lines: a pipe takes such a write whole, so the lines of ``--processes``
    workers sharing one never cut into one another (a longer line is written alone)."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        if chunk and size + len(line) > _PIPE_BUF:
            yield b"".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += len(line)
    if chunk:
        yield b"".join(chunk)


_PIPE_BUF = getattr(select, "PIPE_BUF", 512)
_STDOUT: list[tuple[int, _Stdout]] = []  # (pid, this process's), once made


def stdout_lines() -> _Stdout:
    """This process's :class:`_Stdout` for the current ``sys.stdout`` (made on first use;
    anew in a forked child, or when ``sys.stdout`` was replaced, as click's test runner
    does)."""
    if _STDOUT:
        pid, out = _STDOUT[0]
        if pid == os.getpid() and out.stream is sys.stdout:
            return out
        if pid == os.getpid():
            out.close()
    out = _Stdout()
    _STDOUT[:] = [(os.getpid(), out)]
    return out


def drain_stdout() -> None:
    """Write what this process's :class:`_Stdout` holds, within :data:`LAST_LINES_WAIT` (a
    ``--processes`` child before its ``os._exit``, which runs no ``atexit``)."""
    if _STDOUT and _STDOUT[0][0] == os.getpid():
        _STDOUT[0][1].wait(LAST_LINES_WAIT)


def emit_summary(summary: Mapping[str, Any]) -> None:
    """A worker's last line, after its attempt lines, written within :data:`LAST_LINES_WAIT` or
    dropped (a reader that does not read cannot hold the exit); a stdout that failed
    meanwhile exits 1 with one line."""
    out = stdout_lines()
    out.put(json.dumps(summary, indent=None, sort_keys=True))
    out.wait(LAST_LINES_WAIT)
    if out.failed is not None:
        fail(f"cannot write the results to stdout: {out.failed.strerror or out.failed}")
    if out.dropped and not _same_file(1, 2):
        with contextlib.suppress(OSError, ValueError):
            click.echo(
                f"retrysafe: warning: stdout was not read in time: {out.dropped} line(s) "
                "dropped",
                err=True,
            )


def _same_file(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` lead to one file or pipe (``2>&1``)."""
    try:
        one, two = os.fstat(a), os.fstat(b)
    except OSError:
        return True
    return (one.st_dev, one.st_ino) == (two.st_dev, two.st_ino)


class _JsonLines(logging.Handler):
    """The workers' stdout when it is not a terminal: one JSON object per line, an
    ``attempt`` event per recorded attempt, every other retrysafe line (warnings, the metrics
    address, store outages) as ``{"ts", "level", "logger", "message"}``; written by
    :class:`_Stdout`'s thread, never by the event loop."""

    def __init__(self, *, attempts_of: str = "retrysafe.client") -> None:
        super().__init__()
        self.attempts_of = attempts_of  # whose attempt lines are this command's events
        self.out = stdout_lines()

    @property
    def on_failure(self) -> Callable[[], None] | None:
        """Called (from the writing thread) once stdout fails: the worker's ``stop``."""
        return self.out.on_failure

    @on_failure.setter
    def on_failure(self, callback: Callable[[], None] | None) -> None:
        self.out.on_failure = callback

    def error(self, what: str) -> str | None:
        """The command's error line if stdout failed while the worker ran (it was stopped:
        the command exits 1 with this line and no summary), else None. The lines still
        waiting are written first (within :data:`LAST_LINES_WAIT`): a run shorter than one
        write's interval ended before the thread had tried, and the summary then failed
        with another line."""
        self.out.wait(LAST_LINES_WAIT)
        failed = self.out.failed
        if failed is None:
            return None
        return (
            f"cannot write to stdout: {failed.strerror or failed}; stopped (in-flight {what} "
            "finished or released, pending with the same key)"
        )

    def emit(self, record: logging.LogRecord) -> None:
        data = getattr(record, "retrysafe", None)
        if isinstance(data, dict) and record.name != self.attempts_of:
            return  # another layer's line for the same attempt (the webhook worker's outbox)
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if isinstance(data, dict):
            line = {"event": "attempt", **data}
        self.out.put(json.dumps(line, sort_keys=True, default=str))


@click.command(
    "worker",
    epilog=epilog("(--until-idle: some jobs ended UNKNOWN, or the store stayed unreachable);"),
)
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option(
    "--concurrency",
    "-c",
    type=_CONCURRENCY,
    default=8,
    show_default=True,
    help="Attempts in flight.",
)
@click.option(
    "--max-per-destination",
    type=_CONCURRENCY,
    default=None,
    help="Attempts in flight to one scheme://host:port at most (default: --concurrency; "
    "below it, a destination whose attempts time out gets fewer, and slow ones share half "
    "while others have jobs due).",
)
@click.option(
    "--attempts", type=_ATTEMPTS, default=5, show_default=True, help="Counted attempts per job."
)
@click.option(
    "--timeout", type=_SECONDS, default=10.0, show_default=True, help="Seconds per attempt."
)
@click.option(
    "--wait-initial", type=_SECONDS, default=1.0, show_default=True, help="Backoff base, seconds."
)
@click.option(
    "--wait-max", type=_SECONDS, default=30.0, show_default=True, help="Backoff cap, seconds."
)
@lease_options("jobs")
@click.option("--until-idle", is_flag=True, help="Exit once every job is terminal.")
@processes_option
@metrics_option
@json_option
def worker(
    store: str,
    concurrency: int,
    max_per_destination: int | None,
    attempts: int,
    timeout: float,
    wait_initial: float,
    wait_max: float,
    lease: float | None,
    heartbeat: float | None,
    max_run_time: float | None,
    until_idle: bool,
    processes: int,
    metrics_address: str | None,
    as_json: bool,
) -> None:
    """Deliver outbox jobs until stopped (SIGTERM: in-flight attempts finish, exit 143;
    Ctrl-C: in-flight jobs released, exit 130). A store that is unavailable for a while is
    waited out."""
    policy = _policy(attempts, timeout, wait_initial, wait_max)
    check_lease_timing(lease, heartbeat, max_run_time)
    no_metrics_with_processes(processes, metrics_address)
    tty = sys.stdout is not None and sys.stdout.isatty() and not as_json

    def run(index: int | None) -> Served:
        log = logging.getLogger("retrysafe")  # the worker's lines, its store's and metrics'
        live: Any = None
        handler: _JsonLines | None = None
        old_level = logging.NOTSET
        with (
            _outbox(store, policy) as outbox,
            serving_metrics(metrics_address, outbox.store) as metrics,
        ):
            w = outbox.worker(
                concurrency=concurrency,
                max_per_destination=max_per_destination,
                lease=lease,
                heartbeat=heartbeat,
                max_run_time=max_run_time,
                telemetry=metrics,
                **outage_bound(until_idle),
            )
            if tty and index is None:
                from rich.live import Live
                from rich.markup import escape
                from rich.text import Text

                shown_store = escape(store)  # a path may hold "[…]"

                def render() -> Text:  # markup parsed here: a warning printed above
                    s = w.stats  # (markup=False) redraws it too
                    return Text.from_markup(
                        f"[bold]retrysafe worker[/] {shown_store}  sent {s.attempts}  "
                        f"[green]succeeded {s.succeeded}[/]  [red]rejected {s.rejected}[/]  "
                        f"[yellow]unknown {s.unknown}[/]  retries {s.retries_scheduled}  "
                        f"polls {s.polls}  deferred {s.deferred}"
                    )

                # The line is drawn by rich's own thread, which reads the counts (the event
                # loop never waits for the terminal: Ctrl-S blocked it, see _Stdout), and the
                # warnings reach the terminal through a thread too (warning_lines).
                live = Live(get_renderable=render, refresh_per_second=4)
                live.start()
            else:
                handler = _JsonLines()
                handler.on_failure = w.stop
                log.addHandler(handler)
                old_level = log.level
                log.setLevel(logging.INFO)
            drivers = contextlib.ExitStack()
            if handler is not None:
                drivers.enter_context(driver_lines_to(handler))
            else:
                # On a terminal the worker's own warning says the store went away and when it
                # came back; the driver's line per reconnection attempt (psycopg's pool) would
                # scroll the counts away.
                drivers.enter_context(driver_lines_to(logging.NullHandler()))
                if sys.stderr is not None and sys.stderr.isatty():  # above the live counts
                    console = live.console
                    drivers.enter_context(
                        warning_lines(
                            lambda line: console.print(line, markup=False, highlight=False)
                        )
                    )
                else:
                    drivers.enter_context(warning_lines())
            try:
                with drivers:
                    served = serve(w, until_idle=until_idle)
            finally:
                if live is not None:
                    live.stop()
                if handler is not None:
                    log.removeHandler(handler)
                    log.setLevel(old_level)
            if handler is not None:
                served.error = handler.error("jobs")
            return served

    def check() -> float:
        with _outbox(store, policy):
            return policy.timeout_s + GRACE_MARGIN

    served = in_processes(processes, run, check=check, what="jobs")
    if served.error is not None:
        fail(served.error)
    stats = served.stats
    summary = {"event": "stopped", **stats.to_dict()}
    if as_json or not tty:
        emit_summary(summary)
    else:
        with stdout_may_close():  # a terminal's line, written here
            click.echo(
                f"stopped: {stats.succeeded} succeeded, {stats.rejected} rejected, "
                f"{stats.unknown} unknown, {stats.deferred} deferred"
            )
    finish(served, until_idle=until_idle, what="jobs")


def no_metrics_with_processes(processes: int, metrics_address: str | None) -> None:
    """``--metrics`` serves one process's counters: with ``--processes`` it is refused (exit
    2) before anything is opened."""
    if processes > 1 and metrics_address is not None:
        raise click.UsageError(
            "--metrics serves one process's counters; with --processes, run one worker "
            "command per process, each with its own --metrics address"
        )


# ---------------------------------------------------------------------- jobs
@click.group("jobs", epilog=epilog())
def jobs() -> None:
    """Submit, list, inspect, retry and cancel outbox jobs."""


def _parse_headers(header: tuple[str, ...]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for h in header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            fail(f"-H/--header: {shown_value(h, 100)} is not 'Name: value'", 2)
        if name.strip().lower() == "idempotency-key":
            fail("-H/--header: pass the idempotency key with --key, not as a header", 2)
        again = [n for n in headers if n.lower() == name.strip().lower()]
        if again:
            # A later -H would silently replace the earlier one (curl sends both).
            fail(
                f"-H/--header: {shown_value(name.strip(), 100)} is given twice (header names "
                "ignore letter case); give it once, a list field's values joined with ', '",
                2,
            )
        headers[name.strip()] = value.strip()
    return headers


@jobs.command("submit", epilog=epilog())
@store_option(schemes=SQL_STORES, with_schema=True)
@click.argument("url")
@click.option(
    "--data", "-d", default=None, help="JSON body: text, @file, or - for stdin (default {})."
)
@click.option("--method", "-X", type=Method(), default="POST", show_default=True)
@click.option(
    "--header",
    "-H",
    multiple=True,
    help="'Name: value', repeatable (not Content-Length, Host, Transfer-Encoding, "
    "Connection or Idempotency-Key: the client sets them).",
)
@click.option("--key", default=None, help="Your own idempotency key (default UUIDv4).")
@click.option("--deadline", type=_SECONDS, default=None, help="Seconds from now.")
@click.option(
    "--max-body",
    type=click.IntRange(min=1, max=2**31),
    default=DEFAULT_MAX_BODY,
    show_default=True,
    help="Largest body recorded, in bytes of JSON.",
)
@json_option
def jobs_submit(
    store: str,
    url: str,
    data: str | None,
    method: str,
    header: tuple[str, ...],
    key: str | None,
    deadline: float | None,
    max_body: int,
    as_json: bool,
) -> None:
    """Record a job for URL; a worker delivers it. The store must exist (`retrysafe
    migrate` creates it)."""
    payload = {} if data is None else read_json_argument(data, "--data")
    headers = _parse_headers(header)
    with (
        _outbox(store, flags=_SUBMIT_FLAGS, max_body=max_body) as outbox,
        limit_hint(MAX_BODY_HINT, "--max-body"),
        rerun_with("--key"),
    ):
        job = outbox.submit(
            url, json=payload, method=method, headers=headers, key=key, deadline=deadline
        )
    if as_json:
        _emit(_job_dict(job))
    else:
        click.echo(f"{job.id} {job.state.value} key={job.key}")


@jobs.command("list", epilog=epilog())
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option("--state", "states", multiple=True, type=click.Choice(_STATES))
@click.option("--limit", type=_LIMIT, default=100, show_default=True)
@json_option
def jobs_list(store: str, states: tuple[str, ...], limit: int, as_json: bool) -> None:
    """List jobs, oldest first."""
    with _outbox(store, write=False) as outbox:
        found = outbox.jobs(states=list(states) or None, limit=limit)
        counts = outbox.counts()
    if as_json:
        _emit(
            {
                "jobs": [_job_dict(j) for j in found],
                "counts": {s.value: n for s, n in counts.items()},
            }
        )
    else:
        title = "jobs  " + "  ".join(f"{s.value}={n}" for s, n in counts.items())
        print_table(_jobs_table(found, title))


@jobs.command("show", epilog=epilog("(no such job);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.argument("job_id", type=JOB_ID)
@json_option
def jobs_show(store: str, job_id: str, as_json: bool) -> None:
    """Show one job (id or unique prefix) and its attempts."""
    with _outbox(store, write=False) as outbox:
        job = outbox.get(job_id)
        attempts = outbox.attempts(job.id)
    if as_json:
        _emit({**_job_dict(job, body=True), "attempt_log": [a.to_dict() for a in attempts]})
        return
    print_table(_jobs_table([job], f"job {job.id}"))
    if job.last_error:  # a server's words, or a hand-made row's: no control characters
        click.echo(f"last error: {visible_text(job.last_error)}")
    print_table(_attempts_table(attempts))


def _change(store: str, job_id: str, as_json: bool, op: Callable[[Outbox, str], Job]) -> None:
    with _outbox(store) as outbox:
        job = op(outbox, job_id)
    if as_json:
        _emit(_job_dict(job))
    else:
        click.echo(f"{job.id} {job.state.value} key={job.key}")


@jobs.command("retry", epilog=epilog("(no such job, or not UNKNOWN, REJECTED or CANCELLED);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.argument("job_id", type=JOB_ID)
@json_option
def jobs_retry(store: str, job_id: str, as_json: bool) -> None:
    """Send an UNKNOWN, REJECTED or CANCELLED job again with the same key."""
    _change(store, job_id, as_json, lambda o, j: o.retry(j))


@jobs.command("cancel", epilog=epilog("(no such job, or not PENDING);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.argument("job_id", type=JOB_ID)
@json_option
def jobs_cancel(store: str, job_id: str, as_json: bool) -> None:
    """Cancel a PENDING job."""
    _change(store, job_id, as_json, lambda o, j: o.cancel(j))


# ---------------------------------------------------------------------- reconcile
def _reconcile_until_signal(outbox: Outbox, **options: Any) -> ReconcileReport:
    """``outbox``'s reconcile; SIGTERM (``timeout``, systemd, Kubernetes) stops it as Ctrl-C
    does, on the event loop: every claimed job goes back to UNKNOWN, then exit 143 (the
    default action killed the process and left them IN_FLIGHT until their leases ended,
    unseen by the next reconcile); Ctrl-C exits 130 (twice, three times:
    :class:`_Interrupts`)."""
    from retrysafe.client import areconcile

    terminated = False
    interrupts = _Interrupts("jobs")

    async def main() -> ReconcileReport:
        task = asyncio.current_task()

        def on_sigterm() -> None:
            nonlocal terminated
            terminated = True
            if task is not None:
                task.cancel()

        options.setdefault("policy", outbox.policy)
        options.setdefault("queue", outbox.queue)
        options.setdefault("telemetry", outbox.telemetry)
        with _on_signal(signal.SIGTERM, on_sigterm), interrupts.in_loop():
            return await areconcile(outbox.store, **options)

    with interrupts.around_loop(lambda: terminated):
        try:
            return asyncio.run(main())
        except asyncio.CancelledError:
            if not terminated:
                raise
    if interrupts.count:
        if interrupts.forced:
            said = (
                "jobs it had claimed and not given back wait out their lease, then a worker "
                "sends them again with the same key"
            )
        else:
            said = "every job it had claimed is UNKNOWN again"
        click.echo(f"retrysafe: interrupted: {said}", err=True)
        raise SystemExit(EXIT_SIGINT)
    click.echo("retrysafe: stopped by SIGTERM: every job it had claimed is UNKNOWN again", err=True)
    raise SystemExit(EXIT_SIGTERM)


@click.command("reconcile", epilog=epilog("(jobs are still UNKNOWN after it);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option(
    "--timeout", type=_SECONDS, default=10.0, show_default=True, help="Seconds per attempt."
)
@click.option("--limit", type=_LIMIT, default=1000, show_default=True, help="Most jobs.")
@click.option(
    "--concurrency",
    "-c",
    type=_CONCURRENCY,
    default=8,
    show_default=True,
    help="Attempts in flight.",
)
@click.argument("job_ids", nargs=-1, type=JOB_ID)
@json_option
def reconcile_command(
    store: str,
    timeout: float,
    limit: int,
    concurrency: int,
    job_ids: tuple[str, ...],
    as_json: bool,
) -> None:
    """Re-send UNKNOWN jobs with their same key; the server's replay settles them. Exits 1
    while any of them is still UNKNOWN."""
    policy = _policy(1, timeout, 1.0, 30.0)
    with _outbox(store, policy) as outbox, warning_lines():
        ids = [outbox.resolve(j) for j in job_ids] or None
        report = _reconcile_until_signal(outbox, ids=ids, limit=limit, concurrency=concurrency)
    if as_json:
        _emit({**report.to_dict(), "jobs": [_job_dict(j) for j in report.jobs]})
    else:
        click.echo(
            f"reconciled {len(report.jobs)}: {report.succeeded} succeeded, "
            f"{report.rejected} rejected, {report.unknown} still unknown"
        )
    if report.unknown:
        fail(
            f"jobs still UNKNOWN: {report.unknown} (run `retrysafe reconcile` again once "
            "their destination answers)",
            EXIT_FAILED,
        )


# ---------------------------------------------------------------------- dlq
@click.group("dlq", epilog=epilog())
def dlq() -> None:
    """The dead-letter queue: UNKNOWN and REJECTED jobs."""


@dlq.command("list", epilog=epilog())
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option("--limit", type=_LIMIT, default=100, show_default=True)
@json_option
def dlq_list(store: str, limit: int, as_json: bool) -> None:
    """List dead letters with their attempts."""
    with _outbox(store, write=False) as outbox:
        dead = outbox.dead_letters(limit=limit)
        attempts = {j.id: outbox.attempts(j.id) for j in dead}
    if as_json:
        _emit(
            [{**_job_dict(j), "attempt_log": [a.to_dict() for a in attempts[j.id]]} for j in dead]
        )
        return
    tried = [(j.id, a) for j in dead for a in attempts[j.id]]
    print_table(
        _jobs_table(dead, f"dead letters ({len(dead)})"),
        _attempts_table(
            [a for _, a in tried], title="their attempts", jobs=[job for job, _ in tried]
        ),
    )


@dlq.command("replay", epilog=epilog("(an unknown job id);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.argument("job_ids", nargs=-1, type=JOB_ID)
@click.option("--all", "replay_all", is_flag=True, help="Replay every dead letter.")
@json_option
def dlq_replay(store: str, job_ids: tuple[str, ...], replay_all: bool, as_json: bool) -> None:
    """Put dead letters back to PENDING (same key, fresh attempts)."""
    if not job_ids and not replay_all:
        raise click.UsageError("name job ids or pass --all")
    if job_ids and replay_all:  # which one was meant? Nothing is replayed.
        raise click.UsageError("name job ids or pass --all, not both")
    with _outbox(store) as outbox:
        ids = [j.id for j in outbox.dead_letters(limit=1_000_000)] if replay_all else job_ids
        replayed = [outbox.retry(j) for j in ids]
    if as_json:
        _emit([_job_dict(j) for j in replayed])
    else:
        click.echo(f"replayed {len(replayed)} job(s)")


@dlq.command("purge", epilog=epilog("(not confirmed);"))
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option("--older-than", type=_AGE, default=0.0, help="Seconds unchanged.")
@click.option(
    "--state", "states", multiple=True, type=click.Choice([s.value for s in DEAD_LETTER_STATES])
)
@click.option("--yes", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@json_option
def dlq_purge(
    store: str, older_than: float, states: tuple[str, ...], yes: bool, as_json: bool
) -> None:
    """Delete dead letters (and their attempts)."""
    check_can_ask(yes, "purge")
    with _outbox(store) as outbox:
        if not yes:
            click.confirm("Delete dead letters permanently?", abort=True, err=True)
        n = outbox.purge(states=list(states) or DEAD_LETTER_STATES, older_than=older_than)
    if as_json:
        _emit({"purged": n})
    else:
        click.echo(f"purged {n} job(s)")
