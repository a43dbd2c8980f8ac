"""``retrysafe demo``: the main job."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

import click

from retrysafe._exceptions import RetrysafeError
from retrysafe.cli._common import fail

if TYPE_CHECKING:
    from retrysafe.chaos import Fault

__all__ = ["demo"]

_PHASES = {
    "naive": "naive client (blind retries, no key)",
    "retrysafe": "retrysafe outbox worker",
    "reconcile": "reconciling UNKNOWN jobs (same keys)",
}


def _unit_rate(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise click.BadParameter(f"must be in [0, 1], got {value}")
    return value


@click.command()
@click.option(
    "--jobs",
    "jobs",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Jobs per pass.",
)
@click.option(
    "--loss-rate",
    type=float,
    default=0.025,
    show_default=True,
    callback=_unit_rate,
    help="Share of answers the proxy loses after the post was published.",
)
@click.option(
    "--seed",
    type=int,
    default=7,
    show_default=True,
    help="Seed of the proxy's faults (same seed, same faults).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=1024),
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
        "must fit the service's 1 MiB limit."
    ),
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.05),
    default=2.0,
    show_default=True,
    help="Seconds each attempt waits for an answer.",
)
@click.option(
    "--attempts",
    type=click.IntRange(min=1, max=50),
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
      130  interrupted (Ctrl-C)
      143  terminated (SIGTERM)

    Interrupted or terminated, it stops its service, proxy and worker and removes its
    temporary directory before exiting.
    """
    from rich.console import Console
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
    err = Console(stderr=True)
    try:
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
        # Load and check every job before announcing anything.
        base = read_jobs(jobs_file, copies=jobs)
        job_list = cycle_jobs(base, jobs)
    except RetrysafeError as exc:
        fail(str(exc), code=2)

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

    rates = options.fault_rates()
    with _sigterm_interrupts() as terminated:
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
                result = run_demo(options, _Bars(), jobs=job_list)
        except RetrysafeError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            if terminated.is_set():
                fail("terminated (SIGTERM); stopped the demo and removed its files", code=143)
            fail("interrupted", code=130)

    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        out = Console()
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
    sys.exit(0 if result.ok else 1)


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


@contextmanager
def _sigterm_interrupts() -> Iterator[threading.Event]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` like Ctrl-C (once; further
    SIGTERMs are ignored while shutting down), so the demo stops cleanly. Yields an event set
    when SIGTERM arrived."""
    terminated = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield terminated
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if terminated.is_set():
            return
        terminated.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def _other_faults() -> list[Fault]:
    from retrysafe.chaos import EXCLUSIVE_FAULTS, Fault

    return [f for f in EXCLUSIVE_FAULTS if f is not Fault.LOSE_AFTER_COMMIT]
