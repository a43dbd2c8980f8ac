"""``retrysafe demo``: the lost-answer incident, reproduced end to end on loopback (SPEC §8).

1. A publishing service (each job publishes one post; an :class:`EffectLedger` counts posts)
   behind :class:`~retrysafe.IdempotencyMiddleware` on an embedded SQLite store, in a process
   of its own (as a real service runs apart from its clients: sharing one interpreter lock
   with them, its work would be charged to the pass it serves).
2. A :class:`~retrysafe.chaos.ChaosProxy` in front of it that loses ``loss_rate`` of the
   answers *after* the post was published, plus small rates of the other faults; in a
   process of its own too (as a network is no part of the client).
3. The same job set sent twice: by the naive client (blind retries, no key) and through the
   outbox worker (a key per job, minted before the first attempt). UNKNOWN jobs are
   reconciled with the same key once the link heals.
4. One report per pass, side by side.

The run succeeds (:attr:`DemoResult.ok`) only when retrysafe delivered: every protected job
SUCCEEDED, each with exactly one post. Setting the ``stop`` event (the CLI does on SIGINT or
SIGTERM) stops the worker, the proxy and the server within a few seconds and removes the
temporary directory; :func:`run_demo` then raises :class:`DemoStoppedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from retrysafe._exceptions import ConfigurationError, RetrysafeError
from retrysafe._serving import ServerProcess
from retrysafe.chaos import BeliefState, ClientBelief, EffectLedger, FaultRates, Report
from retrysafe.chaos import build_report as _build_report
from retrysafe.client import Outbox, RetryPolicy, Worker, areconcile
from retrysafe.client._models import JobState
from retrysafe.client._policy import concurrency_of, whole_number
from retrysafe.demo._jobs import MAX_BODY_SIZE, job_body, load_jobs
from retrysafe.demo._naive import run_naive
from retrysafe.demo._proxy import ProxyProcess
from retrysafe.stores import SQLiteStore

__all__ = ["MAX_JOBS", "DemoOptions", "DemoResult", "DemoStoppedError", "Progress", "run_demo"]

_T = TypeVar("_T")

#: The most jobs one pass may send (every job is held in memory).
MAX_JOBS = 100_000

#: The shortest and the longest attempt timeout, in seconds.
MIN_TIMEOUT = 0.05
MAX_TIMEOUT = 3600.0

#: The largest seed (the proxy's and the worker's random generators take 32 bits).
MAX_SEED = 2**32 - 1

#: The most attempts per job (the most requests in flight at once is the worker's,
#: :data:`~retrysafe.client._policy.MAX_CONCURRENCY`).
MAX_ATTEMPTS = 50

# How often a stop request is looked for while the demo waits on something.
_STOP_POLL = 0.05

# Small background rates of the other faults (SPEC §8), on top of the loss rate.
_BACKGROUND = {
    "error_after_commit": 0.005,
    "reset_before_forward": 0.005,
    "error_before_forward": 0.005,
    "hold_after_commit": 0.002,
}

_BELIEF = {
    JobState.SUCCEEDED: BeliefState.SUCCEEDED,
    JobState.REJECTED: BeliefState.REJECTED,
    JobState.UNKNOWN: BeliefState.UNKNOWN,
}


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What one demo run does.

    Attributes:
        jobs: how many jobs each pass sends (default 500).
        loss_rate: probability in [0, 1] that the proxy loses an answer after commit
            (default 0.025, the rate measured in the original incident).
        seed: seed of the proxy's fault choices and the worker's jitter.
        concurrency: requests in flight at once, for both passes.
        jobs_file: a JSONL file of jobs, or None for the bundled set.
        timeout: seconds each attempt waits for an answer (both clients).
        attempts: attempts per job (both clients; the naive one retries blindly).
        naive: run the naive pass too (default True).
    """

    jobs: int = 500
    loss_rate: float = 0.025
    seed: int = 7
    concurrency: int = 16
    jobs_file: str | None = None
    timeout: float = 2.0
    attempts: int = 5
    naive: bool = True

    def __post_init__(self) -> None:
        # The CLI's ranges (``retrysafe demo --help``), so the API refuses what it refuses.
        whole_number(self.jobs, "jobs", high=MAX_JOBS)
        rate = self.loss_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigurationError(  # not 0 <= NaN <= 1 either
                f"loss_rate must be a number from 0 to 1, got {rate!r}", option="loss-rate"
            )
        whole_number(self.seed, "seed", low=0, high=MAX_SEED)
        concurrency_of(self.concurrency)
        timeout = self.timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT
        ):
            raise ConfigurationError(
                f"timeout must be a number of seconds from {MIN_TIMEOUT:g} to "
                f"{MAX_TIMEOUT:g}, got {timeout!r}",
                option="timeout",
            )
        whole_number(self.attempts, "attempts", high=MAX_ATTEMPTS)
        if not isinstance(self.naive, bool):
            raise ConfigurationError(f"naive must be True or False, got {self.naive!r}")
        if self.jobs_file is not None and not isinstance(self.jobs_file, (str, os.PathLike)):
            raise ConfigurationError(
                f"jobs_file must be a path, got {self.jobs_file!r}", option="jobs-file"
            )

    def fault_rates(self) -> FaultRates:
        """The loss rate plus the background faults, scaled down so the sum stays ≤ 1."""
        room = max(0.0, 1.0 - self.loss_rate)
        scale = min(1.0, room / sum(_BACKGROUND.values()))
        return FaultRates(
            lose_after_commit=self.loss_rate,
            **{name: rate * scale for name, rate in _BACKGROUND.items()},
            hold_seconds=self.timeout + 1.0,
            latency=0.05,
            latency_seconds=(0.005, 0.03),
        )


@dataclass
class PassResult:
    """One pass: its report and how long it took."""

    report: Report
    seconds: float
    jobs_per_second: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "report": self.report.to_dict(),
            "seconds": round(self.seconds, 3),
            "jobs_per_second": round(self.jobs_per_second, 1),
            **self.extra,
        }


@dataclass
class DemoResult:
    """Both passes, the faults the proxy applied, and the verdict."""

    options: DemoOptions
    naive: PassResult | None
    protected: PassResult
    faults: dict[str, Any]

    @property
    def failures(self) -> list[str]:
        """Why the protected pass failed, one phrase per reason; empty when it succeeded.

        It fails on any duplicate post, any lost job, and any job that did not end SUCCEEDED
        (REJECTED, UNKNOWN after reconciliation, FAILED): a run in which retrysafe delivers
        nothing is no proof.
        """
        r = self.protected.report
        reasons = []
        if r.duplicates:
            reasons.append(f"{r.duplicates} duplicate posts")
        if r.lost:
            reasons.append(f"{r.lost} lost jobs")
        if r.rejected:
            reasons.append(f"{r.rejected} jobs REJECTED by the service (never published)")
        if r.unknown:
            reasons.append(f"{r.unknown} jobs still UNKNOWN after reconciliation")
        if r.failed:
            reasons.append(f"{r.failed} jobs FAILED")
        return reasons

    @property
    def ok(self) -> bool:
        """True when every job of the protected pass SUCCEEDED with exactly one post: zero
        duplicates, zero lost, and no job REJECTED, UNKNOWN or FAILED (see :attr:`failures`)."""
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        opts = self.options
        return {
            "ok": self.ok,
            "failures": self.failures,
            "options": {
                "jobs": opts.jobs,
                "loss_rate": opts.loss_rate,
                "seed": opts.seed,
                "concurrency": opts.concurrency,
                "timeout": opts.timeout,
                "attempts": opts.attempts,
                "jobs_file": opts.jobs_file,
            },
            "naive": None if self.naive is None else self.naive.to_dict(),
            "retrysafe": self.protected.to_dict(),
            "faults": self.faults,
        }


class DemoStoppedError(RetrysafeError):
    """The demo was asked to stop (its ``stop`` event was set) before it finished.

    By the time it is raised the worker, the proxy and the server are stopped and the
    temporary directory is removed.
    """


class _Halt:
    """What ends a run early, looked at every :data:`_STOP_POLL` seconds: the caller's
    ``stop`` event (:class:`DemoStoppedError`), or a child process exiting during the run (a
    :class:`~retrysafe.RetrysafeError` naming which, its status and last line: a dead
    service's held socket still accepts connections, so every request would wait out its
    whole timeout; without the proxy every request fails to connect)."""

    __slots__ = ("children", "stop")

    def __init__(
        self, stop: threading.Event | None, children: dict[str, ServerProcess | ProxyProcess]
    ) -> None:
        self.stop = stop
        self.children = children

    def error(self) -> RetrysafeError | None:
        if self.stop is not None and self.stop.is_set():
            return DemoStoppedError("the demo was stopped")
        for name, child in self.children.items():
            code = child.exited()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"status {code}"
                return RetrysafeError(
                    f"the demo's {name} exited ({how}) during the run{child.last_output()}"
                )
        return None

    def check(self) -> None:
        """Raise :meth:`error`, if any."""
        error = self.error()
        if error is not None:
            raise error


class Progress:
    """Callbacks the demo calls while it runs (the CLI draws progress bars from them)."""

    def start(self, phase: str, total: int) -> None:
        """A phase (``"naive"``, ``"retrysafe"``, ``"reconcile"``) begins with ``total`` jobs."""

    def advance(self, phase: str, done: int) -> None:
        """``done`` jobs of the phase have reached a terminal state."""

    def finish(self, phase: str) -> None:
        """The phase ended."""

    def note(self, message: str) -> None:
        """What the demo does next, between phases (e.g. ``"healing the link, …"``)."""


def run_demo(
    options: DemoOptions,
    progress: Progress | None = None,
    *,
    jobs: Sequence[dict[str, Any]] | None = None,
    stop: threading.Event | None = None,
    workdir: str | os.PathLike[str] | None = None,
    remove_workdir_if_killed: bool = False,
) -> DemoResult:
    """Run the whole demo and return both reports. Starts and stops everything it needs.

    Args:
        options: what to run.
        progress: callbacks for progress bars and notes.
        jobs: the jobs, already loaded (see :func:`load_jobs`); default: load
            ``options.jobs`` jobs from ``options.jobs_file``. Their ``job_id`` must differ.
        stop: set it (from any thread) to stop the demo: it is looked at every 50 ms, and
            what runs is stopped (in-flight attempts dropped) within a few seconds.
        workdir: an existing directory for the run's SQLite stores, left in place; default
            a new temporary directory, removed at the end.
        remove_workdir_if_killed: ``workdir`` is the caller's temporary directory: should
            this process be killed outright (SIGKILL, the OOM killer), the service process,
            which outlives it by at most 0.1 s, removes it. (A default temporary directory is
            always removed so.)

    Raises:
        ConfigurationError: bad options or jobs (nothing was started), or a server that
            could not start.
        DemoStoppedError: ``stop`` was set; everything was stopped and the temporary
            directory removed first.
        RetrysafeError: the service process exited during the run (its status and last line
            of output are named); everything else was stopped first.
    """
    progress = progress or Progress()
    job_list = list(jobs) if jobs is not None else load_jobs(options.jobs_file, options.jobs)
    _check_distinct(job_list)
    rates = options.fault_rates()
    with _workdir(workdir) as (work, temporary):
        ledger = EffectLedger(work / "effects.jsonl")  # the service's posts, read here
        # A demo killed outright cannot remove its temporary directory: its service, which
        # outlives it by at most 0.1 s, does (a caller's workdir only when asked to).
        disposable = temporary or remove_workdir_if_killed
        orphaned = ("--remove-when-orphaned", str(work)) if disposable else ()
        service = ServerProcess(
            "retrysafe.demo._child",
            [
                *("--keys", str(work / "keys.db"), "--ledger", str(ledger.path)),
                *("--lease", "30", "--max-body-size", str(MAX_BODY_SIZE)),
                *orphaned,
            ],
            log=work / "service.log",
        )
        children: dict[str, ServerProcess | ProxyProcess] = {"publishing service": service}
        halt = _Halt(stop, children)
        halt.check()
        progress.note("starting the publishing service and the chaos proxy on loopback")
        with contextlib.ExitStack() as running:
            running.callback(service.stop)  # first thing: a stop during start() kills it too
            service.start()
            halt.check()
            # The proxy runs apart from the clients as well (retrysafe.demo._proxy_child: why).
            proxy = ProxyProcess(
                service.url, rates=rates, seed=options.seed, log=work / "proxy.log"
            )
            running.callback(proxy.stop)  # stopped first: no request reaches a stopped service
            children["chaos proxy"] = proxy
            proxy.start()
            halt.check()
            url = proxy.url + "/posts"
            naive = None
            if options.naive:
                naive = _naive_pass(url, job_list, options, ledger, progress, halt)
            proxy.set_rates(rates)
            protected = _protected_pass(url, job_list, options, ledger, proxy, work, progress, halt)
            faults = proxy.stats()
            progress.note("stopping the service and the proxy")
    return DemoResult(options=options, naive=naive, protected=protected, faults=faults)


@contextlib.contextmanager
def _workdir(workdir: str | os.PathLike[str] | None) -> Iterator[tuple[Path, bool]]:
    """The run's directory, and whether it is the demo's own (a temporary one)."""
    if workdir is not None:
        if not Path(workdir).is_dir():  # its files went into a directory made for them
            raise ConfigurationError(
                f"workdir {str(workdir)[:300]!r} is not an existing directory", option="workdir"
            )
        yield Path(workdir), False
        return
    with tempfile.TemporaryDirectory(prefix="retrysafe-demo-") as tmp:
        yield Path(tmp), True


def _check_distinct(jobs: Sequence[dict[str, Any]]) -> None:
    """Every job has a ``job_id`` and no two share one (posts are counted per job)."""
    seen: set[str] = set()
    for index, job in enumerate(jobs):
        if "job_id" not in job:
            raise ConfigurationError(f"job {index} has no job_id", option="jobs")
        job_id = str(job["job_id"])
        if job_id in seen:
            raise ConfigurationError(f"job_id {job_id!r} is used twice", option="jobs")
        seen.add(job_id)


async def _unless_stopped(coro: Coroutine[Any, Any, _T], halt: _Halt) -> _T:
    """Await ``coro``; cancel it and raise once ``halt`` has an error."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        await asyncio.wait({task}, timeout=_STOP_POLL)
        error = halt.error()
        if error is not None and not task.done():
            task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
            raise error
    return task.result()


def _bodies(jobs: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    return [job_body(job, tag) for job in jobs]


def _report(beliefs: list[ClientBelief], ledger: EffectLedger, tag: str) -> Report:
    prefix = tag + ":"
    counts = {op: n for op, n in ledger.counts().items() if op.startswith(prefix)}
    return _build_report(beliefs, counts)


def _naive_pass(
    url: str,
    jobs: list[dict[str, Any]],
    options: DemoOptions,
    ledger: EffectLedger,
    progress: Progress,
    halt: _Halt,
) -> PassResult:
    bodies = _bodies(jobs, "naive")
    progress.start("naive", len(bodies))
    done = 0

    def on_done(_: ClientBelief) -> None:
        nonlocal done
        done += 1
        progress.advance("naive", done)

    started = time.monotonic()
    beliefs = asyncio.run(
        _unless_stopped(
            run_naive(
                url,
                bodies,
                concurrency=options.concurrency,
                timeout=options.timeout,
                attempts=options.attempts,
                on_done=on_done,
            ),
            halt,
        )
    )
    seconds = time.monotonic() - started
    progress.finish("naive")
    return PassResult(_report(beliefs, ledger, "naive"), seconds, len(jobs) / seconds)


def _protected_pass(
    url: str,
    jobs: list[dict[str, Any]],
    options: DemoOptions,
    ledger: EffectLedger,
    proxy: ProxyProcess,
    workdir: Path,
    progress: Progress,
    halt: _Halt,
) -> PassResult:
    bodies = _bodies(jobs, "retrysafe")
    policy = RetryPolicy(
        attempts=options.attempts,
        wait_initial=0.05,
        wait_max=1.0,
        timeout=options.timeout,
    )
    store = SQLiteStore(workdir / "outbox.db")
    try:
        with Outbox(store, policy=policy) as outbox:
            halt.check()
            progress.note(f"recording {len(bodies)} jobs and their keys in the outbox")
            started = time.monotonic()
            # Each job and its key are recorded before any attempt (SPEC §2); one transaction.
            with store.transaction() as conn:
                ids = [outbox.submit(url, json=body, connection=conn).id for body in bodies]
            operation = {
                job_id: body["operation"] for job_id, body in zip(ids, bodies, strict=True)
            }
            halt.check()
            progress.start("retrysafe", len(ids))
            # No grace on stop: a stopped demo drops its in-flight attempts at once.
            worker = outbox.worker(concurrency=options.concurrency, grace=0.0)
            _run_with_progress(worker, "retrysafe", len(ids), progress, halt)
            progress.finish("retrysafe")
            delivered = time.monotonic()

            # The link heals; UNKNOWN jobs are re-sent with the same key (SPEC §5).
            unknown = [j.id for j in outbox.jobs(states=[JobState.UNKNOWN], limit=len(ids))]
            if unknown:
                progress.note(
                    f"healing the link, reconciling {len(unknown)} UNKNOWN "
                    f"job{'s' if len(unknown) != 1 else ''} with their same keys"
                )
                proxy.heal()
                progress.start("reconcile", len(unknown))
                asyncio.run(
                    _unless_stopped(
                        areconcile(
                            store,
                            policy=policy,
                            ids=unknown,
                            limit=len(unknown),
                            concurrency=options.concurrency,
                        ),
                        halt,
                    )
                )
                progress.advance("reconcile", len(unknown))
                progress.finish("reconcile")
            seconds = time.monotonic() - started

            beliefs = []
            for job_id in ids:
                job = outbox.get(job_id)
                state = _BELIEF.get(job.state, BeliefState.PENDING)
                finished = job.finished_at
                beliefs.append(
                    ClientBelief(
                        operation_id=operation[job_id],
                        state=state,
                        reconciled=job_id in unknown and state is not BeliefState.UNKNOWN,
                        seconds_to_terminal=None if finished is None else finished - job.created_at,
                    )
                )
            halt.check()
    finally:
        store.close()
    return PassResult(
        _report(beliefs, ledger, "retrysafe"),
        seconds,
        len(jobs) / seconds,
        {"delivery_seconds": round(delivered - started, 3), "reconciled_jobs": len(unknown)},
    )


def _run_with_progress(
    worker: Worker,
    phase: str,
    total: int,
    progress: Progress,
    halt: _Halt,
) -> None:
    """Run ``worker`` until idle in a thread; the progress bar shows the jobs it ended.

    The count is the worker's own (its stats, read every 0.2 s), not the outbox's: counting
    the store's jobs by state reads its whole index (~10 ms at 100,000 jobs), which the
    progress bar made the measured pass pay five times a second. The demo's one worker
    ends every job of the pass, so the two counts agree.

    When ``halt`` has an error (or the caller's thread is interrupted), the worker is stopped
    and its thread joined before that error (or the exception) propagates, so nothing still
    writes to the store.
    """
    error: list[BaseException] = []

    def target() -> None:
        try:
            worker.run_until_idle()
        except BaseException as exc:  # re-raised below in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="retrysafe-demo-worker", daemon=True)
    thread.start()
    stats = worker.stats
    polled = 0.0
    try:
        while thread.is_alive():
            thread.join(timeout=_STOP_POLL)
            halt.check()
            if time.monotonic() - polled >= 0.2:
                polled = time.monotonic()
                progress.advance(phase, stats.succeeded + stats.rejected + stats.unknown)
    except BaseException:
        deadline = time.monotonic() + 3
        while thread.is_alive() and time.monotonic() < deadline:
            worker.stop()  # again each time: a worker not yet serving forgets an early stop
            thread.join(timeout=_STOP_POLL)
        raise
    if error:
        raise error[0]
