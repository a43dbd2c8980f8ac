"""``retrysafe proof``: the chaos matrix, naive beside protected, written as a table and a chart."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from retrysafe._exceptions import RetrysafeError
from retrysafe.cli._common import ProgressStream, epilog, errors, fail, progress_console
from retrysafe.cli._signals import SHUTDOWN_SECONDS, Signals, hang_up_as_sigterm
from retrysafe.proof._run import _plural

if TYPE_CHECKING:
    from retrysafe.proof import ProofResult

__all__ = ["proof"]

# Mirrors retrysafe.proof's limits (not imported here: `retrysafe --help` stays fast).
_MAX_JOBS = 1_000_000
_MAX_SEED = 2**32 - 1
_FLAGS = {
    name: f"--{name}"
    for name in ("jobs", "store", "scenarios", "out", "concurrency", "restart-command")
}
# Children get this long to stop after a signal before the process kills them and exits.
_STOP_GRACE = SHUTDOWN_SECONDS + 5.0
_POLL = 0.05
# Held (flock) in --out while a proof writes there.
_LOCK = ".retrysafe-proof.lock"


def _scenario_help() -> str:
    from retrysafe.proof._scenarios import SCENARIOS

    return ", ".join(s.name for s in SCENARIOS)


@click.command(epilog=epilog("(a scenario failed or was not proven);"))
@click.option(
    "--jobs",
    type=click.IntRange(min=1, max=_MAX_JOBS),
    default=1000,
    show_default=True,
    help="Operations per scenario, for each client.",
)
@click.option(
    "--store",
    default="sqlite",
    show_default=True,
    metavar="sqlite|URL",
    help=(
        "sqlite (files in a temporary directory) or postgresql://user@host/db (each pass "
        "gets its own schema, dropped after it; needs retrysafe[postgres])."
    ),
)
@click.option(
    "--scenarios",
    default="all",
    show_default=True,
    metavar="NAMES",
    help="Comma-separated scenarios to run (see --list), or all.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default="retrysafe-proof",
    show_default=True,
    help="Directory for proof.json, proof.md and the chart; refused if it holds files.",
)
@click.option("--force", is_flag=True, help="Write into --out even if it holds files.")
@click.option(
    "--chart",
    type=click.Choice(["svg", "png", "none"]),
    default="svg",
    show_default=True,
    help="Chart format (needs pip install 'retrysafe[proof]').",
)
@click.option(
    "--seed",
    type=click.IntRange(0, _MAX_SEED),
    default=7,
    show_default=True,
    help="Seed of the faults (same seed, same faults).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=1024),
    default=32,
    show_default=True,
    help="Requests in flight per pass, over all its client processes.",
)
@click.option(
    "--restart-command",
    default=None,
    metavar="CMD",
    help=(
        "PostgreSQL only: a command that restarts the server (e.g. 'pg_ctlcluster "
        "--skip-systemctl-redirect 15 main restart'); the store-outage scenario's second "
        "outage runs it. Default: backends "
        "are terminated, the server is never restarted."
    ),
)
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print proof.json on stdout too (progress still goes to stderr).",
)
def proof(
    jobs: int,
    store: str,
    scenarios: str,
    out: str,
    force: bool,
    chart: str,
    seed: int,
    concurrency: int,
    restart_command: str | None,
    list_only: bool,
    as_json: bool,
) -> None:
    """Run the chaos matrix: every scenario with the naive client beside retrysafe.

    Scenarios: lost answers after commit at 2.5, 10 and 30 %; client processes SIGKILLed
    over and over; the service SIGKILLed and restarted; the store locked or its
    PostgreSQL backends terminated; a retry storm; handlers that outlive their lease.
    Each runs on loopback against a fresh store with the same jobs and the same seeded
    faults for both clients; UNKNOWN jobs are reconciled with their same keys after.

    Writes proof.json, proof.md and proof.svg to --out. See docs/proof.md.

    \b
    Exit status:
      0    every retrysafe row: 0 duplicated, 0 lost, every UNKNOWN recovered
      1    a retrysafe row failed or proved nothing (the verdict says which and
           why), a pass could not run (finished scenarios are written), or the
           PostgreSQL server cannot be reached (nothing ran)
      2    bad options, a non-empty --out, --out in use by another proof
           (nothing ran)
      130  interrupted (SIGINT): children stopped, partial results written
      143  terminated (SIGTERM or SIGHUP): likewise
    """
    from retrysafe._exceptions import ConfigurationError
    from retrysafe.proof import ProofOptions, select_scenarios
    from retrysafe.proof._backend import check_store
    from retrysafe.proof._scenarios import SCENARIOS

    if list_only:
        _list(SCENARIOS, as_json)
        return
    # Attempt and proxy log lines would drown the progress bars; errors still show.
    for name in ("retrysafe", "psycopg", "psycopg.pool"):
        logging.getLogger(name).setLevel(logging.ERROR)
    command = _command_line()
    # A closed terminal (SIGHUP) stops the run like SIGTERM: children stopped, results kept.
    hang_up_as_sigterm()
    with Signals() as signals, contextlib.ExitStack() as stack:
        with errors(flags=_FLAGS):
            options = ProofOptions(
                jobs=jobs,
                store=store,
                scenarios=tuple(select_scenarios(scenarios)),
                seed=seed,
                concurrency=concurrency,
                command=command.strip(),
                restart_command=restart_command,
            )
            check_store(store)  # an unreachable PostgreSQL: refused before --out is touched
            if not out.strip():  # Path("") would quietly be the current directory
                raise ConfigurationError("the output directory must not be empty", option="out")
            out_dir = _prepare_out(Path(out), force=force, stack=stack)
        workdir = Path(tempfile.mkdtemp(prefix="retrysafe-proof-"))
        try:
            result, error = _supervise(options, signals, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if result is None:
            assert error is not None
            fail(str(error), code=2 if _is_usage(error) else 1)
        # Still inside the signal guard: a Ctrl-C now cannot cut the files half-written.
        _report(result, out_dir, chart=chart, as_json=as_json, signals=signals, error=error)


def _report(
    result: ProofResult,
    out_dir: Path,
    *,
    chart: str,
    as_json: bool,
    signals: Signals,
    error: BaseException | None,
) -> NoReturn:
    """Write the files, print the table (or the JSON) and the verdict, and exit."""
    from retrysafe.proof import write_outputs

    doc = result.to_dict()
    written = write_outputs(doc, out_dir, chart=None if chart == "none" else chart)  # type: ignore[arg-type]
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_table(doc)
    for path in written.files:
        _tell(f"retrysafe: wrote {path}")
    if written.chart_missing:
        _tell(f"retrysafe: no chart: {written.chart_missing}")
    if signals.received is not None:
        what = (
            "children stopped, partial results written"
            if result.partial
            else "the run had finished; its results are written"
        )
        fail(f"{signals.describe()}; {what} to {out_dir}", code=signals.exit_code or 1)
    if error is not None:
        fail(f"{error}; the scenarios that finished are written to {out_dir}")
    _tell(_verdict(result))
    sys.exit(0 if result.ok else 1)


def _tell(message: str) -> None:
    """One line on stderr, dropped when stderr cannot be written (a closed pipe): the results
    are in the files and the exit status says the verdict."""
    stderr = ProgressStream(sys.stderr)
    stderr.write(message + "\n")
    stderr.flush()


def _command_line() -> str:
    """This command as typed, any password in a store URL redacted (it is published)."""
    from retrysafe.stores._url_check import redact_url

    def redact(word: str) -> str:
        flag, eq, value = word.partition("=")
        if eq and flag.startswith("--"):
            return flag + eq + redact_url(value)
        return redact_url(word)

    words = [redact(a) if "://" in a else a for a in sys.argv[1:]]
    if words and words[0] == "proof":
        words = words[1:]
    return " ".join(["retrysafe", "proof", *map(shlex.quote, words)])


def _is_usage(error: BaseException) -> bool:
    from retrysafe._exceptions import ConfigurationError

    return isinstance(error, ConfigurationError)


def _prepare_out(out: Path, *, force: bool, stack: contextlib.ExitStack) -> Path:
    """Create ``out`` (and its parents), or check it is an empty directory (or ``force``),
    that files can be written there, and that no other proof writes there (a lock held
    until the command ends): before anything runs."""
    from retrysafe._exceptions import ConfigurationError

    if not str(out).strip():
        raise ConfigurationError("the output directory must not be empty", option="out")
    try:
        if out.exists() and not out.is_dir():
            raise ConfigurationError(f"{out} exists and is not a directory", option="out")
        if out.is_dir() and any(p.name != _LOCK for p in out.iterdir()) and not force:
            raise ConfigurationError(
                f"{out} is not empty; choose another --out, or pass --force to write into it",
                option="out",
            )
        out.mkdir(parents=True, exist_ok=True)
        lock = stack.enter_context((out / _LOCK).open("a"))
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write to {out}: {exc.strerror or exc}", option="out"
        ) from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigurationError(
            f"another retrysafe proof is writing to {out}; wait for it or choose another --out",
            option="out",
        ) from None
    stack.callback(lambda: (out / _LOCK).unlink(missing_ok=True))
    return out


def _supervise(
    options: Any, signals: Signals, workdir: Path
) -> tuple[ProofResult | None, BaseException | None]:
    """Run the proof in a thread; on a signal set its stop event, and if it has not stopped
    in time (or a second signal comes), kill every child and return what finished.

    Returns:
        ``(result, None)`` when it finished; ``(partial result, error)`` when it was stopped
        or a pass failed after others had finished; ``(None, error)`` when nothing ran.
    """
    from retrysafe.proof import ProofError, ProofStoppedError, run_proof
    from retrysafe.proof._backend import kill_children

    err = progress_console()
    stop = threading.Event()
    outcome: list[Any] = []
    progress = _progress(err)

    def target() -> None:
        try:
            outcome.append(run_proof(options, progress, workdir=workdir, stop=stop))
        except BaseException as exc:  # handed to the main thread below
            outcome.append(exc)

    err.print(
        f"[bold]retrysafe proof[/bold]: {_plural(len(options.scenarios), 'scenario')} × 2 "
        f"clients, {_plural(options.jobs, 'operation')} each, "
        f"store {_store_name(options.store)}, "
        f"seed {options.seed}, concurrency {options.concurrency}",
        highlight=False,
    )
    thread = threading.Thread(target=target, name="retrysafe-proof", daemon=True)
    with progress.bars:
        thread.start()
        deadline: float | None = None
        while thread.is_alive():
            thread.join(_POLL)
            if signals.received is None or not thread.is_alive():
                continue
            if deadline is None:
                progress.note("stopping: children first, then the partial results")
                stop.set()
                deadline = time.monotonic() + _STOP_GRACE
            elif signals.count > 1 or time.monotonic() > deadline:
                kill_children()
                thread.join(2.0)
                break
    if not outcome:  # forced: the runner did not return; nothing it held can be trusted
        return None, RetrysafeError("the proof did not stop in time; its children were killed")
    value = outcome[0]
    if isinstance(value, ProofStoppedError):
        return value.result, None if signals.received is not None else value
    if isinstance(value, ProofError) and value.result is not None:
        return value.result, value  # a pass could not run: what finished is written
    if isinstance(value, BaseException):
        if isinstance(value, RetrysafeError):
            return None, value
        raise value
    return value, None


class _Progress:
    """Progress bars on a terminal. Otherwise (a log file, CI) plain lines: a pass's count
    every :data:`PLAIN_EVERY` seconds while it runs, moving or not (a stalled pass still
    shows it is alive, and where it stands), and its time when it ends."""

    #: Seconds between two plain progress lines of one pass.
    PLAIN_EVERY = 30.0

    def __init__(self, console: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bars

        self.console = console
        self.clock = clock
        self.bars = Bars(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}
        self.totals: dict[str, int] = {}
        self.printed: dict[str, tuple[float, int]] = {}  # plain mode: last line's time, count

    def start(self, label: str, total: int) -> None:
        now = self.clock()
        self.started[label] = now
        self.totals[label] = total
        self.printed[label] = (now, 0)
        self.tasks[label] = self.bars.add_task(label, total=total)

    def advance(self, label: str, done: int) -> None:
        self.bars.update(self.tasks[label], completed=done)
        if self.console.is_terminal:
            return
        now = self.clock()
        at, _ = self.printed[label]
        if now - at >= self.PLAIN_EVERY:
            self.printed[label] = (now, done)
            total = self.totals[label]
            share = f" ({done / total:.0%})" if total else ""
            self.console.print(
                f"{label}: {done:,}/{total:,}{share} after {now - self.started[label]:.0f} s",
                highlight=False,
            )

    def finish(self, label: str) -> None:
        task = self.tasks[label]
        total = next(t.total for t in self.bars.tasks if t.id == task)
        self.bars.update(task, completed=total)
        if not self.console.is_terminal:
            seconds = self.clock() - self.started[label]
            self.console.print(f"{label}: done in {seconds:.1f} s", highlight=False)

    def note(self, message: str) -> None:
        self.console.print(f"[dim]{message}[/dim]", highlight=False)


def _progress(console: Any, clock: Callable[[], float] = time.monotonic) -> Any:
    from retrysafe.proof import ProofProgress

    class Progress(_Progress, ProofProgress):
        pass

    return Progress(console, clock)


def _store_name(store: str) -> str:
    from retrysafe.stores._url_check import redact_url

    return "sqlite" if store.startswith("sqlite") else redact_url(store)


def _print_table(doc: dict[str, Any]) -> None:
    from rich.table import Table

    from retrysafe.cli._common import print_table

    table = Table(
        title=f"retrysafe proof: {doc['store']}, {_plural(doc['jobs'], 'operation')} each"
    )
    for column in (
        "scenario",
        "client",
        "attempted",
        "acked",
        "effects",
        "duplicated",
        "lost",
        "unknown",
        "recovered",
        "failed",
        "p95",
        "ops/s",
    ):
        table.add_column(column, justify="left" if column in ("scenario", "client") else "right")
    for scenario in doc["scenarios"]:
        for client, row in scenario["rows"].items():
            if row is None:
                continue

            def cell(name: str, *, red: bool = False, row: Any = row, client: str = client) -> str:
                value = row.get(name)
                if value is None:
                    return "–"
                text = f"{value:,}" if isinstance(value, int) else f"{value:.2f}"
                return f"[bold red]{text}[/]" if red and value and client != "naive" else text

            table.add_row(
                scenario["name"] + (" (partial)" if scenario.get("partial") else ""),
                client,
                cell("attempted"),
                cell("acknowledged"),
                cell("effects"),
                cell("duplicated", red=True),
                cell("lost", red=True),
                cell("unknown"),
                cell("recovered"),
                cell("failed"),
                cell("p95_seconds"),
                f"{row['ops_per_second']:,.0f}" if row.get("ops_per_second") else "–",
            )
    print_table(table)
    missing = [s["name"] for s in doc["scenarios"] if not s["rows"]]
    if missing:
        click.echo(f"not measured: {', '.join(missing)}")


def _verdict(result: ProofResult) -> str:
    broken = [f"{s['name']}: {why}" for s in result.scenarios for why in s["failures"]]
    unproven = [f"{s['name']}: {why}" for s in result.scenarios for why in s["inconclusive"]]
    if broken:
        return "verdict: FAILED: the guarantee broke: " + "; ".join(broken)
    if unproven:
        return "verdict: not proven (nothing broke, a fault never came): " + "; ".join(unproven)
    if result.ok:
        return "verdict: every retrysafe row held: 0 duplicated, 0 lost, every UNKNOWN recovered"
    return "verdict: the run did not finish"


def _list(scenarios: Any, as_json: bool) -> None:
    if as_json:
        click.echo(
            json.dumps(
                [
                    {"name": s.name, "title": s.title, "description": s.description}
                    for s in scenarios
                ],
                indent=2,
            )
        )
        return
    width = max(len(s.name) for s in scenarios)
    for s in scenarios:
        click.echo(f"{s.name:<{width}}  {s.title}")
