"""``retrysafe demo``: the main job."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from retrysafe._exceptions import RetrysafeError
from retrysafe.cli._common import (
    Number,
    epilog,
    errors,
    fail,
    progress_console,
    results_console,
    stdout_may_close,
)
from retrysafe.cli._signals import SHUTDOWN_SECONDS, Signals

if TYPE_CHECKING:
    from retrysafe.chaos import Fault
    from retrysafe.demo import DemoResult

__all__ = ["demo"]

_PHASES = {
    "naive": "naive client (blind retries, no key)",
    "retrysafe": "retrysafe outbox worker",
    "reconcile": "reconciling UNKNOWN jobs (same keys)",
}

# Mirrors retrysafe.demo's limits (not imported here: `retrysafe --help` stays fast).
# tests/demo/test_demo.py holds both to the same ranges.
_MAX_JOBS = 100_000
_MIN_TIMEOUT = 0.05
_MAX_TIMEOUT = 3600.0
_MAX_SEED = 2**32 - 1
_MAX_CONCURRENCY = 1024  # the worker's (retrysafe.client._policy.MAX_CONCURRENCY)
_MAX_ATTEMPTS = 50
# ConfigurationError.option -> the flag to name in the error line.
_FLAGS = {
    name: f"--{name}"
    for name in ("jobs", "loss-rate", "seed", "concurrency", "jobs-file", "timeout", "attempts")
}


@click.command(
    epilog=epilog("(a protected job duplicated, lost, REJECTED or UNKNOWN, or the service died);")
)
@click.option(
    "--jobs",
    "jobs",
    type=click.IntRange(min=1, max=_MAX_JOBS),
    default=500,
    show_default=True,
    help="Jobs per pass.",
)
@click.option(
    "--loss-rate",
    type=Number(zero=True, high=1.0, unit="a probability"),
    default=0.025,
    show_default=True,
    help="Share of answers the proxy loses after the post was published.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, _MAX_SEED),
    default=7,
    show_default=True,
    help="Seed of the proxy's faults (same seed, same faults).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=_MAX_CONCURRENCY),
    default=16,
    show_default=True,
    help="Requests in flight at once.",
)
@click.option(
    "--jobs-file",
    type=click.Path(dir_okay=False),
    default=None,
    help=(
        "JSONL file of jobs instead of the bundled set: one JSON object per line, sent as "
        "the post's body; its optional job_id names the operation (default line-N). A file "
        "with fewer lines than --jobs is cycled, copies getting job_id~1, ~2, …; each body "
        "must fit the service's 1 MiB limit. Each job_id must be unique and must not end in "
        "~N. The whole file is checked before anything starts."
    ),
)
@click.option(
    "--timeout",
    type=Number(low=_MIN_TIMEOUT, high=_MAX_TIMEOUT),
    default=2.0,
    show_default=True,
    help="Seconds each attempt waits for an answer.",
)
@click.option(
    "--attempts",
    type=click.IntRange(min=1, max=_MAX_ATTEMPTS),
    default=5,
    show_default=True,
    help="Attempts per job, for both clients.",
)
@click.option(
    "--naive/--no-naive", default=True, show_default=True, help="Also run the naive pass."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as JSON on stdout (progress still goes to stderr).",
)
def demo(
    jobs: int,
    loss_rate: float,
    seed: int,
    concurrency: int,
    jobs_file: str | None,
    timeout: float,
    attempts: int,
    naive: bool,
    as_json: bool,
) -> None:
    """Reproduce the lost-answer incident: naive duplicates next to retrysafe's zero.

    Starts on loopback a publishing service behind the idempotency middleware, a chaos
    proxy that loses answers after the post was published, then sends the same jobs with a
    naive client and through the outbox worker, and prints both reports side by side.

    \b
    Exit status:
      0    every retrysafe job SUCCEEDED, each with exactly one post
      1    the retrysafe pass had duplicates, lost jobs, or jobs that ended
           REJECTED, UNKNOWN or FAILED (a run that delivers nothing is no proof)
      2    bad options or jobs file (nothing was started)
      130  interrupted (SIGINT, Ctrl-C)
      143  terminated (SIGTERM)

    Interrupted or terminated, it stops its service, proxy and worker and removes its
    temporary directory, within 5 seconds (a second signal stops it at once). Killed
    outright (SIGKILL) while its service runs, the service removes that directory within
    a second.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as Bars

    from retrysafe.chaos import render_reports
    from retrysafe.demo import DemoOptions, Progress, cycle_jobs, read_jobs, run_demo

    # Attempt log lines would drown the progress bars; warnings still show.
    logging.getLogger("retrysafe").setLevel(logging.WARNING)
    # Progress and notes are dropped once stderr is a closed pipe (`2>&1 | head`): the demo
    # runs on to its verdict.
    err = progress_console()
    with Signals() as signals:
        with errors(flags=_FLAGS):
            options = DemoOptions(
                jobs=jobs,
                loss_rate=loss_rate,
                seed=seed,
                concurrency=concurrency,
                jobs_file=jobs_file,
                timeout=timeout,
                attempts=attempts,
                naive=naive,
            )
            # Load and check every job before announcing or starting anything.
            base = read_jobs(jobs_file, copies=jobs)
            job_list = cycle_jobs(base, jobs)
            rates = options.fault_rates()
        if signals.received is not None:
            _stopped(signals, "nothing was started")

        bars = Bars(
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=False,
            disable=not err.is_terminal,
        )

        class _Bars(Progress):
            def __init__(self) -> None:
                self.tasks: dict[str, TaskID] = {}

            def start(self, phase: str, total: int) -> None:
                if not err.is_terminal:
                    err.print(f"{_PHASES[phase]}: {total} jobs …")
                self.tasks[phase] = bars.add_task(_PHASES[phase], total=total)

            def advance(self, phase: str, done: int) -> None:
                bars.update(self.tasks[phase], completed=done)

            def finish(self, phase: str) -> None:
                task = self.tasks[phase]
                total = next(t.total for t in bars.tasks if t.id == task)
                bars.update(task, completed=total)

            def note(self, message: str) -> None:
                err.print(f"[dim]{message} …[/dim]", highlight=False)

        workdir = Path(tempfile.mkdtemp(prefix="retrysafe-demo-"))
        try:
            err.print(
                f"[bold]retrysafe demo[/bold]: {jobs} post-publishing jobs per pass "
                f"({_source(jobs_file, len(base), jobs)}), "
                f"{loss_rate:.1%} of answers lost after commit "
                f"(+ resets, 503s, stalls: {sum(rates.rate(f) for f in _other_faults()):.1%}), "
                f"seed {seed}, concurrency {concurrency}",
                highlight=False,
            )
            with bars:
                outcome = _supervise(
                    lambda stop: run_demo(
                        options,
                        _Bars(),
                        jobs=job_list,
                        stop=stop,
                        workdir=workdir,
                        remove_workdir_if_killed=True,
                    ),
                    signals,
                    workdir,
                    before_forced_exit=bars.stop,
                )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if signals.received is not None:
            _stopped(signals, "stopped the demo and removed its files")
        if isinstance(outcome, RetrysafeError):
            fail(str(outcome))
        result = outcome

        with stdout_may_close():  # `| head -1`: the rest is dropped, the status is the verdict
            if as_json:
                click.echo(json.dumps(result.to_dict(), indent=2))
            else:
                out = results_console()
                reports = {}
                if result.naive is not None:
                    reports["naive client"] = result.naive.report
                reports["retrysafe"] = result.protected.report
                out.print(render_reports(reports, title="Effects vs beliefs"))
                timing = []
                if result.naive is not None:
                    timing.append(f"naive {result.naive.seconds:.1f} s")
                timing.append(f"retrysafe {result.protected.seconds:.1f} s")
                out.print("wall time: " + ", ".join(timing))
                out.print(_verdict(result.failures), highlight=False)
        if as_json:  # stdout stays pure JSON; the verdict goes to stderr
            err.print(_verdict(result.failures), highlight=False)
        if signals.received is not None:
            _stopped(signals, "the demo had finished")
    sys.exit(0 if result.ok else 1)


def _stopped(signals: Signals, what: str) -> NoReturn:
    """Exit 130 (SIGINT) or 143 (SIGTERM) with one line saying so."""
    fail(f"{signals.describe()}; {what}", code=signals.exit_code or 1)


# The demo thread gets this long to stop after a signal before the process exits anyway.
_STOP_GRACE = SHUTDOWN_SECONDS - 1.0
_POLL = 0.05


def _supervise(
    run: Callable[[threading.Event], DemoResult],
    signals: Signals,
    workdir: Path,
    *,
    before_forced_exit: Callable[[], None],
) -> DemoResult | RetrysafeError:
    """Run ``run(stop)`` in a thread while this (main) thread watches for signals.

    The signal handler only records the signal; here the main flow sets ``stop``, and the
    demo stops its worker, proxy and server. If it has not finished ``_STOP_GRACE`` seconds
    later, or a second signal arrives, the process removes ``workdir`` and exits at once:
    SIGTERM never leaves it hanging.

    Returns:
        The demo's result, or the :class:`RetrysafeError` it failed with (a stopped demo's
        :class:`~retrysafe.demo.DemoStoppedError` included).
    """
    stop = threading.Event()
    outcome: list[DemoResult | BaseException] = []

    def target() -> None:
        try:
            outcome.append(run(stop))
        except BaseException as exc:  # handed to the main thread below
            outcome.append(exc)

    thread = threading.Thread(target=target, name="retrysafe-demo", daemon=True)
    thread.start()
    deadline: float | None = None
    while thread.is_alive():
        thread.join(_POLL)
        if signals.received is None or not thread.is_alive():
            continue
        if deadline is None:
            stop.set()
            deadline = time.monotonic() + _STOP_GRACE
        elif signals.count > 1 or time.monotonic() > deadline:
            before_forced_exit()
            from retrysafe._serving import stop_processes  # loaded by now (the demo runs)

            stop_processes()  # the service process: it holds files in workdir
            shutil.rmtree(workdir, ignore_errors=True)
            click.echo(
                f"retrysafe: error: {signals.describe()}; the demo did not stop in time, "
                "exiting anyway (its files were removed)",
                err=True,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(signals.exit_code or 1)
    result = outcome[0]
    if isinstance(result, RetrysafeError):
        return result
    if isinstance(result, BaseException):
        raise result
    return result


def _verdict(failures: list[str]) -> str:
    if not failures:
        return (
            "verdict: [green]every job published exactly once with retrysafe "
            "(0 duplicates, 0 lost)[/green]"
        )
    return "verdict: [red]FAILED: retrysafe pass had " + ", ".join(failures) + "[/red]"


def _source(jobs_file: str | None, lines: int, jobs: int) -> str:
    """Where the jobs come from: ``N jobs from FILE (cycled to M)`` or ``first M of N …``."""
    name = "the bundled set" if jobs_file is None else jobs_file
    if jobs > lines:
        return f"{lines} jobs from {name}, cycled to {jobs}"
    if jobs < lines:
        return f"the first {jobs} of {lines} jobs from {name}"
    return f"{lines} jobs from {name}"


def _other_faults() -> list[Fault]:
    from retrysafe.chaos import EXCLUSIVE_FAULTS, Fault

    return [f for f in EXCLUSIVE_FAULTS if f is not Fault.LOSE_AFTER_COMMIT]
