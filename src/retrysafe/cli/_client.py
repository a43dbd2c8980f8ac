"""``retrysafe worker | jobs | reconcile | dlq``: the outbox from the command line.

Human tables (rich) by default, ``--json`` for scripts; errors are one line on stderr
(``retrysafe: error: …``, from :func:`~retrysafe.cli._common.fail`) and a non-zero exit code
(1: retrysafe error, 2: usage, 130: interrupted). Reading commands (``jobs list``, ``jobs
show``, ``dlq list``) open the store read-only and never create it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from retrysafe._exceptions import ConfigurationError, RetrysafeError, StoreUnavailableError
from retrysafe.cli._common import fail, store_option
from retrysafe.client import DEAD_LETTER_STATES, Attempt, Job, JobState, Outbox, RetryPolicy
from retrysafe.client._policy import Step
from retrysafe.client._worker import DEFAULT_LEASE
from retrysafe.core import lease_timing

__all__ = ["dlq", "jobs", "reconcile_command", "worker"]

_F = TypeVar("_F", bound=Callable[..., Any])
_STATES = [s.value for s in JobState]
_COUNT = click.IntRange(min=1)
_SECONDS = click.FloatRange(min=0, min_open=True)
_READERS = "`jobs list`, `jobs show` and `dlq list`"


def _json_option(fn: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def _sqlite_path(store: str) -> str | None:
    """The file of a ``sqlite://`` URL (None for other schemes or a malformed URL)."""
    if not store.lower().startswith("sqlite://"):
        return None
    from retrysafe.stores._sqlite import sqlite_path_from_url

    try:
        return sqlite_path_from_url(store)
    except RetrysafeError:
        return None


def _is_read_only(store: str, exc: StoreUnavailableError) -> bool:
    """Did a write fail because the store can be read but not written?"""
    low = str(exc).lower()
    if "readonly" in low or "read-only" in low:
        return True
    path = _sqlite_path(store)
    if path is None or "unable to open" not in low or not Path(path).expanduser().is_file():
        return False
    from retrysafe.stores import SQLiteStore

    try:
        SQLiteStore(path, readonly=True).close()
    except RetrysafeError:
        return False
    return True


@contextmanager
def _errors(store: str | None = None) -> Iterator[None]:
    """Turn retrysafe errors into one ``retrysafe: error: …`` line and exit 1."""
    try:
        yield
    except StoreUnavailableError as exc:
        if store is not None and _is_read_only(store, exc):
            fail(
                f"the store {_sqlite_path(store) or store} is read-only: {_READERS} can read "
                "it, this command needs to write"
            )
        fail(str(exc))
    except RetrysafeError as exc:
        fail(str(exc))


@contextmanager
def _outbox(store: str, policy: RetryPolicy | None = None) -> Iterator[Outbox]:
    """The outbox for a command that writes (creates the SQLite file if missing)."""
    with _errors(store), Outbox(store, policy=policy) as outbox:
        yield outbox


@contextmanager
def _reader(store: str) -> Iterator[Outbox]:
    """The outbox for a command that only reads: a SQLite store is opened read-only, and a
    file that does not exist is an error (a typo must not create an empty store)."""
    path = _sqlite_path(store)
    if path is None:
        if store.split(":", 1)[0].lower() in ("postgresql", "postgres"):
            # Reading never creates tables: a database without them is a SchemaError
            # that names `retrysafe migrate`.
            from retrysafe.stores import open_store

            with _errors(store):
                opened = open_store(store, create=False)
                try:
                    with Outbox(opened) as outbox:
                        yield outbox
                finally:
                    opened.close()
            return
        with _outbox(store) as outbox:
            yield outbox
        return
    if not Path(path).expanduser().exists():
        fail(f"no store at {path} (create one by submitting a job or with a worker)")
    from retrysafe.stores import SQLiteStore

    with _errors(store):
        opened = SQLiteStore(path, readonly=True)
        try:
            with Outbox(opened) as outbox:
                yield outbox
        finally:
            opened.close()


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=None, sort_keys=True))


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _jobs_table(jobs: list[Job], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
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
            j.url,
            _when(j.created_at),
            j.key,
        )
    Console().print(table)


def _attempts_table(attempts: list[Attempt]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="attempts")
    for col in ("#", "started", "duration", "outcome", "status", "error", "replayed", "counted"):
        table.add_column(col)
    for a in attempts:
        table.add_row(
            str(a.number),
            _when(a.started_at),
            f"{a.duration:.3f}s",
            a.outcome,
            "" if a.status is None else str(a.status),
            a.error_type or "",
            "yes" if a.replayed else "",
            "yes" if a.counted else "no",
        )
    Console().print(table)


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
def _check_lease_timing(
    lease: float | None, heartbeat: float | None, max_run_time: float | None
) -> None:
    """Exit 2 on lease options the worker would refuse (NaN, inf, too large, a heartbeat not
    shorter than the lease), before the store is opened: a bad flag never creates a store.
    Warnings are left to the worker, which prints each once."""
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


class _JsonLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        data = getattr(record, "retrysafe", None)
        line = {"level": record.levelname.lower(), "message": record.getMessage()}
        if isinstance(data, dict):
            line = {"event": "attempt", **data}
        click.echo(json.dumps(line, sort_keys=True))


@click.command("worker")
@store_option
@click.option(
    "--concurrency", "-c", type=_COUNT, default=8, show_default=True, help="Attempts in flight."
)
@click.option(
    "--attempts", type=_COUNT, default=5, show_default=True, help="Counted attempts per job."
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
@click.option(
    "--lease",
    type=_SECONDS,
    default=None,
    help="Seconds a dead worker's jobs wait before another worker sends them (default 10; "
    "a live worker renews the lease, so it may be shorter than --timeout).",
)
@click.option(
    "--heartbeat",
    type=_SECONDS,
    default=None,
    help="Seconds between lease renewals (default lease / 3; must be shorter than --lease).",
)
@click.option(
    "--max-run-time",
    type=_SECONDS,
    default=None,
    help="Seconds after which a job's lease is no longer renewed (default 3600, at least "
    "2 × timeout).",
)
@click.option("--until-idle", is_flag=True, help="Exit once every job is terminal.")
@_json_option
def worker(
    store: str,
    concurrency: int,
    attempts: int,
    timeout: float,
    wait_initial: float,
    wait_max: float,
    lease: float | None,
    heartbeat: float | None,
    max_run_time: float | None,
    until_idle: bool,
    as_json: bool,
) -> None:
    """Deliver outbox jobs until stopped (SIGTERM: graceful, exit 0; Ctrl-C: release in-flight
    jobs, exit 130). A store that is unavailable for a while is waited out."""
    policy = _policy(attempts, timeout, wait_initial, wait_max)
    _check_lease_timing(lease, heartbeat, max_run_time)
    log = logging.getLogger("retrysafe.client")
    tty = sys.stdout.isatty() and not as_json
    live: Any = None
    handler: logging.Handler | None = None
    old_level = logging.NOTSET
    with _outbox(store, policy) as outbox:
        with _errors():
            w = outbox.worker(
                concurrency=concurrency,
                lease=lease,
                heartbeat=heartbeat,
                max_run_time=max_run_time,
            )
        if tty:
            from rich.live import Live

            def render() -> str:
                s = w.stats
                return (
                    f"[bold]retrysafe worker[/] {store}  sent {s.attempts}  "
                    f"[green]succeeded {s.succeeded}[/]  [red]rejected {s.rejected}[/]  "
                    f"[yellow]unknown {s.unknown}[/]  retries {s.retries_scheduled}  "
                    f"polls {s.polls}  deferred {s.deferred}"
                )

            live = Live(render(), refresh_per_second=4)

            def hook(job: Job, attempt: Attempt, step: Step) -> None:
                live.update(render())

            w._on_attempt = hook
            live.start()
        else:
            handler = _JsonLines()
            log.addHandler(handler)
            old_level = log.level
            log.setLevel(logging.INFO)
        interrupted = False
        try:
            with _errors(store):
                stats = w.run(until_idle=until_idle, handle_signals=True)
        except KeyboardInterrupt:
            stats = w.stats
            interrupted = True
            click.echo(
                "retrysafe: interrupted: in-flight jobs released (pending, same key)", err=True
            )
        finally:
            if live is not None:
                live.stop()
            if handler is not None:
                log.removeHandler(handler)
                log.setLevel(old_level)
        summary = {"event": "stopped", **stats.to_dict()}
        if as_json or not tty:
            _emit(summary)
        else:
            click.echo(
                f"stopped: {stats.succeeded} succeeded, {stats.rejected} rejected, "
                f"{stats.unknown} unknown, {stats.deferred} deferred"
            )
    if interrupted:
        raise SystemExit(130)  # 128 + SIGINT, as shells expect


# ---------------------------------------------------------------------- jobs
@click.group("jobs")
def jobs() -> None:
    """Submit, list, inspect, retry and cancel outbox jobs."""


@jobs.command("submit")
@store_option
@click.argument("url")
@click.option("--data", "-d", default=None, help="JSON body (default {}).")
@click.option("--method", "-X", default="POST", show_default=True)
@click.option("--header", "-H", multiple=True, help="'Name: value', repeatable.")
@click.option("--key", default=None, help="Your own idempotency key (default UUIDv4).")
@click.option("--deadline", type=_SECONDS, default=None, help="Seconds from now.")
@_json_option
def jobs_submit(
    store: str,
    url: str,
    data: str | None,
    method: str,
    header: tuple[str, ...],
    key: str | None,
    deadline: float | None,
    as_json: bool,
) -> None:
    """Record a job for URL; a worker delivers it."""
    try:
        payload = {} if data is None else json.loads(data)
    except ValueError as exc:
        raise click.UsageError(f"--data is not JSON: {exc}") from None
    headers: dict[str, str] = {}
    for h in header:
        name, sep, value = h.partition(":")
        if not sep:
            raise click.UsageError(f"--header {h!r} is not 'Name: value'")
        if name.strip().lower() == "idempotency-key":
            raise click.UsageError("pass the idempotency key with --key, not as a header")
        headers[name.strip()] = value.strip()
    with _outbox(store) as outbox:
        job = outbox.submit(
            url, json=payload, method=method, headers=headers, key=key, deadline=deadline
        )
    if as_json:
        _emit(job.to_dict())
    else:
        click.echo(f"{job.id} {job.state.value} key={job.key}")


@jobs.command("list")
@store_option
@click.option("--state", "states", multiple=True, type=click.Choice(_STATES))
@click.option("--limit", type=_COUNT, default=100, show_default=True)
@_json_option
def jobs_list(store: str, states: tuple[str, ...], limit: int, as_json: bool) -> None:
    """List jobs, oldest first."""
    with _reader(store) as outbox:
        found = outbox.jobs(states=list(states) or None, limit=limit)
        counts = outbox.counts()
    if as_json:
        _emit(
            {
                "jobs": [j.to_dict() for j in found],
                "counts": {s.value: n for s, n in counts.items()},
            }
        )
    else:
        _jobs_table(found, "jobs  " + "  ".join(f"{s.value}={n}" for s, n in counts.items()))


@jobs.command("show")
@store_option
@click.argument("job_id")
@_json_option
def jobs_show(store: str, job_id: str, as_json: bool) -> None:
    """Show one job (id or unique prefix) and its attempts."""
    with _reader(store) as outbox:
        job = outbox.get(job_id)
        attempts = outbox.attempts(job.id)
    if as_json:
        _emit({**job.to_dict(body=True), "attempt_log": [a.to_dict() for a in attempts]})
        return
    _jobs_table([job], f"job {job.id}")
    if job.last_error:
        click.echo(f"last error: {job.last_error}")
    _attempts_table(attempts)


def _change(store: str, job_id: str, as_json: bool, op: Callable[[Outbox, str], Job]) -> None:
    with _outbox(store) as outbox:
        job = op(outbox, job_id)
    if as_json:
        _emit(job.to_dict())
    else:
        click.echo(f"{job.id} {job.state.value} key={job.key}")


@jobs.command("retry")
@store_option
@click.argument("job_id")
@_json_option
def jobs_retry(store: str, job_id: str, as_json: bool) -> None:
    """Send an UNKNOWN, REJECTED or CANCELLED job again with the same key."""
    _change(store, job_id, as_json, lambda o, j: o.retry(j))


@jobs.command("cancel")
@store_option
@click.argument("job_id")
@_json_option
def jobs_cancel(store: str, job_id: str, as_json: bool) -> None:
    """Cancel a PENDING job."""
    _change(store, job_id, as_json, lambda o, j: o.cancel(j))


# ---------------------------------------------------------------------- reconcile
@click.command("reconcile")
@store_option
@click.option(
    "--timeout", type=_SECONDS, default=10.0, show_default=True, help="Seconds per attempt."
)
@click.option("--limit", type=_COUNT, default=1000, show_default=True, help="Most jobs.")
@click.option(
    "--concurrency", "-c", type=_COUNT, default=8, show_default=True, help="Attempts in flight."
)
@click.argument("job_ids", nargs=-1)
@_json_option
def reconcile_command(
    store: str,
    timeout: float,
    limit: int,
    concurrency: int,
    job_ids: tuple[str, ...],
    as_json: bool,
) -> None:
    """Re-send UNKNOWN jobs with their same key; the server's replay settles them."""
    policy = _policy(1, timeout, 1.0, 30.0)
    with _outbox(store, policy) as outbox:
        ids = [outbox.resolve(j) for j in job_ids] or None
        report = outbox.reconcile(ids=ids, limit=limit, concurrency=concurrency)
    if as_json:
        _emit(report.to_dict())
    else:
        click.echo(
            f"reconciled {len(report.jobs)}: {report.succeeded} succeeded, "
            f"{report.rejected} rejected, {report.unknown} still unknown"
        )


# ---------------------------------------------------------------------- dlq
@click.group("dlq")
def dlq() -> None:
    """The dead-letter queue: UNKNOWN and REJECTED jobs."""


@dlq.command("list")
@store_option
@click.option("--limit", type=_COUNT, default=100, show_default=True)
@_json_option
def dlq_list(store: str, limit: int, as_json: bool) -> None:
    """List dead letters with their attempts."""
    with _reader(store) as outbox:
        dead = outbox.dead_letters(limit=limit)
        attempts = {j.id: outbox.attempts(j.id) for j in dead}
    if as_json:
        _emit([{**j.to_dict(), "attempt_log": [a.to_dict() for a in attempts[j.id]]} for j in dead])
    else:
        _jobs_table(dead, f"dead letters ({len(dead)})")


@dlq.command("replay")
@store_option
@click.argument("job_ids", nargs=-1)
@click.option("--all", "replay_all", is_flag=True, help="Replay every dead letter.")
@_json_option
def dlq_replay(store: str, job_ids: tuple[str, ...], replay_all: bool, as_json: bool) -> None:
    """Put dead letters back to PENDING (same key, fresh attempts)."""
    if not job_ids and not replay_all:
        raise click.UsageError("name job ids or pass --all")
    with _outbox(store) as outbox:
        ids = [j.id for j in outbox.dead_letters(limit=1_000_000)] if replay_all else job_ids
        replayed = [outbox.retry(j) for j in ids]
    if as_json:
        _emit([j.to_dict() for j in replayed])
    else:
        click.echo(f"replayed {len(replayed)} job(s)")


@dlq.command("purge")
@store_option
@click.option("--older-than", type=click.FloatRange(min=0), default=0.0, help="Seconds unchanged.")
@click.option(
    "--state", "states", multiple=True, type=click.Choice([s.value for s in DEAD_LETTER_STATES])
)
@click.option("--yes", is_flag=True, help="Do not ask.")
@_json_option
def dlq_purge(
    store: str, older_than: float, states: tuple[str, ...], yes: bool, as_json: bool
) -> None:
    """Delete dead letters (and their attempts)."""
    if not yes and not as_json:
        click.confirm("Delete dead letters permanently?", abort=True)
    with _outbox(store) as outbox:
        n = outbox.purge(states=list(states) or DEAD_LETTER_STATES, older_than=older_than)
    if as_json:
        _emit({"purged": n})
    else:
        click.echo(f"purged {n} job(s)")
