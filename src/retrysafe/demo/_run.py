"""``retrysafe demo``: the lost-answer incident, reproduced end to end on loopback (SPEC §8).

1. A publishing service (each job publishes one post; an :class:`EffectLedger` counts posts)
   behind :class:`~retrysafe.IdempotencyMiddleware` on an embedded SQLite store.
2. A :class:`~retrysafe.chaos.ChaosProxy` in front of it that loses ``loss_rate`` of the
   answers *after* the post was published, plus small rates of the other faults.
3. The same job set sent twice: by the naive client (blind retries, no key) and through the
   outbox worker (a key per job, minted before the first attempt). UNKNOWN jobs are
   reconciled with the same key once the link heals.
4. One report per pass, side by side.

The run succeeds (:attr:`DemoResult.ok`) only when retrysafe delivered: every protected job
SUCCEEDED, each with exactly one post. Interrupting it (Ctrl-C, or SIGTERM turned into
``KeyboardInterrupt`` by the CLI) stops the worker, the proxy and the server and removes the
temporary directory before the exception propagates.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe._serving import ServerThread
from retrysafe.chaos import BeliefState, ChaosProxy, ClientBelief, EffectLedger, FaultRates, Report
from retrysafe.chaos import build_report as _build_report
from retrysafe.client import Outbox, RetryPolicy, Worker
from retrysafe.client._models import JobState
from retrysafe.demo._jobs import MAX_BODY_SIZE, job_body, load_jobs
from retrysafe.demo._naive import run_naive
from retrysafe.demo._service import PublishingService
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore

__all__ = ["DemoOptions", "DemoResult", "Progress", "run_demo"]

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
        if not 0.0 <= self.loss_rate <= 1.0:
            raise ConfigurationError(
                f"--loss-rate must be in [0, 1], got {self.loss_rate}", option="loss-rate"
            )
        if self.jobs < 1:
            raise ConfigurationError("--jobs must be at least 1", option="jobs")
        if self.concurrency < 1:
            raise ConfigurationError("--concurrency must be at least 1", option="concurrency")
        if self.timeout <= 0:
            raise ConfigurationError("--timeout must be > 0 seconds", option="timeout")
        if self.attempts < 1:
            raise ConfigurationError("--attempts must be at least 1", option="attempts")

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
) -> DemoResult:
    """Run the whole demo and return both reports. Starts and stops everything it needs.

    Args:
        options: what to run.
        progress: callbacks for progress bars and notes.
        jobs: the jobs, already loaded (see :func:`load_jobs`); default: load
            ``options.jobs`` jobs from ``options.jobs_file``.

    Raises:
        ConfigurationError: bad options or jobs file, or a server that could not start.
        KeyboardInterrupt: interrupted; everything was stopped and the temporary directory
            removed first.
    """
    progress = progress or Progress()
    job_list = list(jobs) if jobs is not None else load_jobs(options.jobs_file, options.jobs)
    rates = options.fault_rates()
    with tempfile.TemporaryDirectory(prefix="retrysafe-demo-") as tmp:
        workdir = Path(tmp)
        ledger = EffectLedger()
        progress.note("starting the publishing service and the chaos proxy on loopback")
        keys = SQLiteStore(workdir / "keys.db")
        app = IdempotencyMiddleware(
            PublishingService(ledger), store=keys, lease=30.0, max_body_size=MAX_BODY_SIZE
        )
        try:
            with (
                ServerThread(app) as server,
                ChaosProxy(server.url, rates=rates, seed=options.seed) as proxy,
            ):
                url = proxy.url + "/posts"
                naive = None
                if options.naive:
                    naive = _naive_pass(url, job_list, options, ledger, progress)
                proxy.set_rates(rates)
                protected = _protected_pass(
                    url, job_list, options, ledger, proxy, workdir, progress
                )
                faults = proxy.stats().to_dict()
                progress.note("stopping the service and the proxy")
        finally:
            keys.close()
    return DemoResult(options=options, naive=naive, protected=protected, faults=faults)


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
        run_naive(
            url,
            bodies,
            concurrency=options.concurrency,
            timeout=options.timeout,
            attempts=options.attempts,
            on_done=on_done,
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
    proxy: ChaosProxy,
    workdir: Path,
    progress: Progress,
) -> PassResult:
    bodies = _bodies(jobs, "retrysafe")
    policy = RetryPolicy(
        attempts=options.attempts,
        wait_initial=0.05,
        wait_max=1.0,
        timeout=options.timeout,
    )
    store = SQLiteStore(workdir / "outbox.db")
    with Outbox(store, policy=policy) as outbox:
        progress.note(f"recording {len(bodies)} jobs and their keys in the outbox")
        started = time.monotonic()
        # Each job and its key are recorded before any attempt (SPEC §2); one transaction.
        with store.transaction() as conn:
            ids = [outbox.submit(url, json=body, connection=conn).id for body in bodies]
        operation = {job_id: body["operation"] for job_id, body in zip(ids, bodies, strict=True)}
        progress.start("retrysafe", len(ids))
        # No grace on stop: an interrupted demo drops its in-flight attempts at once.
        worker = outbox.worker(concurrency=options.concurrency, grace=0.0)
        _run_with_progress(worker, outbox, "retrysafe", len(ids), progress)
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
            outbox.reconcile(ids=unknown, limit=len(unknown), concurrency=options.concurrency)
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
    store.close()
    return PassResult(
        _report(beliefs, ledger, "retrysafe"),
        seconds,
        len(jobs) / seconds,
        {"delivery_seconds": round(delivered - started, 3), "reconciled_jobs": len(unknown)},
    )


def _run_with_progress(
    worker: Worker, outbox: Outbox, phase: str, total: int, progress: Progress
) -> None:
    """Run ``worker`` until idle in a thread; poll the outbox's counts for the progress bar.

    If the caller's thread is interrupted (``KeyboardInterrupt``), the worker is stopped and
    its thread joined before the exception propagates, so nothing still writes to the store.
    """
    error: list[BaseException] = []

    def target() -> None:
        try:
            worker.run_until_idle()
        except BaseException as exc:  # re-raised below in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="retrysafe-demo-worker", daemon=True)
    thread.start()
    terminal = (JobState.SUCCEEDED, JobState.REJECTED, JobState.UNKNOWN, JobState.CANCELLED)
    try:
        while thread.is_alive():
            thread.join(timeout=0.2)
            counts = outbox.counts()
            progress.advance(phase, sum(counts.get(s, 0) for s in terminal))
    except BaseException:
        deadline = time.monotonic() + 10
        while thread.is_alive() and time.monotonic() < deadline:
            worker.stop()  # again each time: a worker not yet serving forgets an early stop
            thread.join(timeout=0.1)
        raise
    if error:
        raise error[0]
