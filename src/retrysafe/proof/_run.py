"""``retrysafe proof``: the chaos matrix, naive beside protected, on SQLite or PostgreSQL.

For each scenario (:mod:`retrysafe.proof._scenarios`) and each client, on a fresh store:

1. The publishing service runs in its own process (uvicorn, the idempotency middleware, a
   2 s lease), behind a :class:`~retrysafe.chaos.ChaosProxy` seeded with the run's seed.
2. The naive client (blind retries, no key; processes that resume their queue when
   restarted) or the outbox (every job and its key recorded before the first attempt, then
   worker processes until every job is terminal) sends the same operations.
3. Meanwhile the scenario's faults come on their schedule: client processes SIGKILLed, the
   service SIGKILLed and restarted, the store locked or its backends terminated, storms of
   lost answers.
4. The faults end; the UNKNOWN jobs are reconciled with their same keys.
5. What the client believes is compared with the effects the service recorded
   (:func:`~retrysafe.chaos.build_report`).

The result (:class:`ProofResult`) is the document ``proof.json`` holds. Setting the ``stop``
event stops every child within a few seconds; the result then has ``partial: true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from retrysafe._exceptions import ConfigurationError, StoreError
from retrysafe._serving import answers
from retrysafe.chaos import BeliefState, ChaosProxy, ClientBelief, FaultRates, build_report
from retrysafe.client import Outbox, RetryPolicy, areconcile
from retrysafe.client._models import JobState
from retrysafe.client._policy import concurrency_of, whole_number
from retrysafe.demo import DemoOptions, job_body, load_jobs
from retrysafe.demo._run import MAX_ATTEMPTS, MAX_SEED
from retrysafe.proof._backend import (
    _LIVE,
    Backend,
    ProofError,
    check_store,
    child_env,
    kill_children,
)
from retrysafe.proof._scenarios import SCENARIOS, Event, Scenario

__all__ = [
    "CLIENTS",
    "MAX_JOBS",
    "ProofOptions",
    "ProofProgress",
    "ProofResult",
    "ProofStoppedError",
    "kill_children",
    "run_proof",
]

_T = TypeVar("_T")

#: The most operations per scenario and client.
MAX_JOBS = 1_000_000

#: The two clients of every scenario, in table order.
CLIENTS = ("naive", "retrysafe")

# The service's lease (seconds): a killed service's keys are taken over this long after.
SERVICE_LEASE = 2.0
# The workers' lease (seconds): a killed worker's jobs are re-sent this long after.
WORKER_LEASE = 2.0
# How often the runner looks at progress, the schedule and its children (seconds).
_TICK = 0.1
# Seconds reconciliation keeps re-sending UNKNOWN jobs (the link healed) before one counts
# as unrecovered: a killed service's keys answer 409 until their lease ends and are then
# taken over; several leases' worth, as an operator would reconcile again later.
_RECONCILE_FOR = 6 * SERVICE_LEASE
# Seconds between two reconciliation rounds.
_RECONCILE_PAUSE = 0.5
# A child that keeps failing on its own (not killed by the run) stops the pass.
_MAX_UNEXPECTED_EXITS = 5
# Seconds a child gets to exit after SIGTERM before SIGKILL.
_TERM_GRACE = 2.0
# Seconds a --restart-command may take before it is killed and counted as failed.
_RESTART_TIMEOUT = 120.0
# Seconds between two counts of the outbox's jobs, in passes of at least _COUNT_EVERY_FROM.
_COUNT_EVERY = 0.5
_COUNT_EVERY_FROM = 20_000
# Seconds the runner's own reads wait for a store that is away.
_STORE_PATIENCE = 30.0
# Seconds the service gets to listen after (re)start.
_START_TIMEOUT = 30.0


class ProofStoppedError(ProofError):
    """The run's ``stop`` event was set; :attr:`result` holds what finished (``partial``)."""

    def __init__(self, message: str, result: ProofResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True, kw_only=True)
class ProofOptions:
    """What one proof run does.

    Attributes:
        jobs: operations per scenario and client (1 … 1,000,000; default 1,000).
        store: ``"sqlite"`` (files in a temporary directory) or a ``postgresql://…`` URL
            (each pass gets its own schema, dropped after it).
        scenarios: which scenarios to run, in order (default all).
        seed: seed of the proxy's faults, the schedule's choices and the slow handlers.
        concurrency: requests in flight at once per pass, over all its client processes.
        timeout: seconds each attempt waits for an answer (both clients).
        attempts: attempts per operation (both clients).
        command: the command line, recorded in the result.
        restart_command: PostgreSQL only: a command that restarts the database server
            (e.g. ``pg_ctlcluster 15 main restart``); the store-outage scenario's second
            outage runs it instead of terminating the run's backends. None: never restart.

    Raises:
        ConfigurationError: a value out of range (``option`` names it).
    """

    jobs: int = 1000
    store: str = "sqlite"
    scenarios: tuple[Scenario, ...] = SCENARIOS
    seed: int = 7
    concurrency: int = 32
    timeout: float = 2.0
    attempts: int = 5
    command: str = ""
    restart_command: str | None = None

    def __post_init__(self) -> None:
        whole_number(self.jobs, "jobs", high=MAX_JOBS)
        if not self.scenarios:
            raise ConfigurationError("no scenario to run", option="scenarios")
        if not isinstance(self.store, str) or not (
            self.store == "sqlite" or self.store.startswith(("postgresql://", "postgres://"))
        ):
            check_store(str(self.store))  # raises, naming what is expected
        if self.restart_command is not None:
            _check_restart_command(self.restart_command, self.store)
        # The demo's ranges for what both take.
        whole_number(self.seed, "seed", low=0, high=MAX_SEED)
        concurrency_of(self.concurrency)
        whole_number(self.attempts, "attempts", high=MAX_ATTEMPTS)
        DemoOptions(timeout=self.timeout)  # the demo's rule for timeouts


def _check_restart_command(command: str, store: str) -> None:
    """A restart command needs PostgreSQL, must split like a shell line, and must name a
    program that exists: checked before anything runs, not at the second outage."""
    if store == "sqlite":
        raise ConfigurationError(
            "a restart command restarts a PostgreSQL server: it needs a postgresql://… store",
            option="restart-command",
        )
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise ConfigurationError(
            f"{command!r} cannot be split like a shell line: {exc}", option="restart-command"
        ) from None
    if not argv:
        raise ConfigurationError("the restart command is empty", option="restart-command")
    if shutil.which(argv[0]) is None:
        raise ConfigurationError(
            f"{argv[0]!r} is not an executable program (on PATH or by its path)",
            option="restart-command",
        )


class ProofProgress:
    """Callbacks the run calls while it works (the CLI draws progress bars from them)."""

    def start(self, label: str, total: int) -> None:
        """A pass (``"loss-10 · naive"``) begins with ``total`` operations."""

    def advance(self, label: str, done: int) -> None:
        """``done`` operations of the pass have reached a terminal state."""

    def finish(self, label: str) -> None:
        """The pass ended."""

    def note(self, message: str) -> None:
        """What the run does next (reconciling, cleaning up, a fault)."""


@dataclass
class ProofResult:
    """The whole run: one entry per scenario, each with a row per client.

    :meth:`to_dict` is the ``proof.json`` document (see ``docs/proof.md`` for every field).
    """

    options: ProofOptions
    store: str
    started_at: float
    finished_at: float = 0.0
    partial: bool = False
    scenarios: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        """``"scenario: reason"`` for every protected row that failed; empty when all held."""
        return [
            f"{s['name']}: {why}"
            for s in self.scenarios
            for why in [*s["failures"], *s.get("inconclusive", [])]
        ]

    @property
    def ok(self) -> bool:
        """True when the run finished and every protected row held: 0 duplicated, 0 lost,
        every UNKNOWN recovered, nothing REJECTED or FAILED, no job over its attempts, and
        every scheduled fault actually happened."""
        return not self.partial and not self.failures and bool(self.scenarios)

    def to_dict(self) -> dict[str, Any]:
        from retrysafe import __version__

        opts = self.options
        return {
            "version": 1,
            "partial": self.partial,
            "ok": self.ok,
            "store": self.store,
            "jobs": opts.jobs,
            "seed": opts.seed,
            "concurrency": opts.concurrency,
            "timeout": opts.timeout,
            "attempts": opts.attempts,
            "command": opts.command,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at or time.time()),
            "seconds": round((self.finished_at or time.time()) - self.started_at, 1),
            "environment": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "retrysafe": __version__,
            },
            "failures": self.failures,
            "scenarios": self.scenarios,
        }


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_proof(
    options: ProofOptions,
    progress: ProofProgress | None = None,
    *,
    workdir: str | os.PathLike[str],
    stop: threading.Event | None = None,
) -> ProofResult:
    """Run the matrix and return its result.

    Args:
        options: what to run.
        progress: callbacks for progress bars and notes.
        workdir: an existing empty directory for the run's files (stores, logs); the
            caller removes it.
        stop: set it (any thread) to stop: children are stopped within a few seconds and
            :class:`ProofStoppedError` carries the partial result.

    Raises:
        ConfigurationError: bad options, or a store that cannot be reached (nothing ran).
        ProofError: a pass could not run (a child process kept failing; the message has its
            last error lines).
        ProofStoppedError: ``stop`` was set.
    """
    progress = progress or ProofProgress()
    backend = Backend(options.store, Path(workdir))
    result = ProofResult(options=options, store=backend.kind, started_at=time.time())
    stop = stop or threading.Event()
    job_list = load_jobs(None, options.jobs)
    # Every scenario asked for has its entry from the start, so a run stopped early still
    # names each one it did not measure (partial, no rows) besides the one it cut.
    entries: list[dict[str, Any]] = [
        {
            "name": scenario.name,
            "title": scenario.title,
            "description": scenario.description,
            "mode": scenario.mode,
            "partial": True,
            "ok": None,  # not measured until both passes ran
            "failures": [],
            "inconclusive": [],
            "rows": {},
        }
        for scenario in options.scenarios
    ]
    result.scenarios.extend(entries)
    try:
        for scenario, entry in zip(options.scenarios, entries, strict=True):
            for client in CLIENTS:
                run = _Pass(scenario, client, options, backend, job_list, progress, stop)
                entry["rows"][client] = run.run()
            entry["partial"] = False
            protected = entry["rows"]["retrysafe"]
            entry["failures"] = _failures(protected, options)
            entry["inconclusive"] = _unproven(scenario, entry["rows"], options)
            entry["ok"] = not entry["failures"] and not entry["inconclusive"]
    except _Stopped:
        result.partial = True
        result.finished_at = time.time()
        raise ProofStoppedError("the proof was stopped", result) from None
    except ProofError as exc:  # a pass could not run: what finished is kept
        result.partial = True
        result.finished_at = time.time()
        exc.result = result
        raise
    result.finished_at = time.time()
    return result


def _failures(row: dict[str, Any], options: ProofOptions) -> list[str]:
    """How the protected row broke the guarantee, one phrase per reason; empty when it held
    (see :attr:`ProofResult.ok`)."""
    reasons = []
    for name, what in (
        ("duplicated", "duplicated effects"),
        ("lost", "lost operations"),
        ("still_unknown", "jobs still UNKNOWN after reconciliation"),
        ("rejected", "jobs REJECTED"),
        ("failed", "jobs FAILED"),
    ):
        if row[name]:
            reasons.append(f"{row[name]:,} {what}")
    if row.get("unrecovered_last_answer"):
        seen = ", ".join(f"{n} × {a}" for a, n in row["unrecovered_last_answer"].items())
        reasons.append(f"the unrecovered jobs' last answers: {seen}")
    if row["max_attempts"] is not None and row["max_attempts"] > options.attempts:
        reasons.append(f"a job made {row['max_attempts']} attempts (limit {options.attempts})")
    return reasons


def _unproven(
    scenario: Scenario, rows: dict[str, dict[str, Any]], options: ProofOptions
) -> list[str]:
    """Why the scenario proves nothing although nothing broke: its scheduled fault never
    reached a pass (a run too short for its schedule), or ``--restart-command`` did not
    restart the server."""
    reasons = []
    if scenario.loss_rate:
        for client, row in rows.items():
            if not row["faults"].get("lose_after_commit"):
                reasons.append(
                    f"the {client} pass lost no answer (too few operations for a "
                    f"{scenario.loss_rate:.1%} rate); run more --jobs"
                )
    if scenario.event is not Event.NONE:
        for client, row in rows.items():
            if not row["faults"].get(scenario.event.value):
                reasons.append(
                    f"the {client} pass ended before its scheduled fault "
                    f"({scenario.event.value.replace('_', ' ')}) came; run more --jobs"
                )
    if scenario.event is Event.STORE_OUTAGE and options.restart_command:
        for client, row in rows.items():
            failed = row["faults"].get("store_restart_failed", 0)
            if failed or not row["faults"].get("store_restart"):
                reasons.append(
                    f"the {client} pass's --restart-command "
                    + ("failed" if failed else "never ran")
                )
    return reasons


class _Stopped(Exception):
    """Internal: the stop event was set."""


class _Child:
    """One child process of a pass, restartable, with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env or {}
        self.fds = fds  #: descriptors the child inherits (the service's listening socket)
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False  # by the run's schedule: its exit is expected
        self.unexpected = 0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "retrysafe.proof._child", *self.argv],
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env={**child_env(), **self.env},
                start_new_session=True,  # the terminal's Ctrl-C reaches the run, not them
                pass_fds=self.fds,
            )
        _LIVE.add(self.proc)
        self.killed = False

    @property
    def alive(self) -> bool:
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return True
        _LIVE.discard(self.proc)
        return False

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.killed = True
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def exited(self) -> int | None:
        """The exit code once it exited on its own (or was killed), else None."""
        if self.proc is None:
            return None
        return self.proc.poll()

    def check(self) -> None:
        """Count an exit the run did not cause; raise after too many."""
        code = self.exited()
        if code not in (None, 0) and not self.killed:
            self.unexpected += 1
            if self.unexpected >= _MAX_UNEXPECTED_EXITS:
                raise ProofError(
                    f"the proof's {self.name} process kept failing (exit {code}): {self.tail()}"
                )

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no output)"
        return " | ".join(text[-lines:]) or "(no output)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period."""
        if not self.alive:
            return
        assert self.proc is not None
        self.killed = True
        self.proc.terminate()
        try:
            self.proc.wait(_TERM_GRACE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Schedule:
    """When the next scheduled fault is due: every ``period`` s or ``fraction`` of the work."""

    def __init__(self, scenario: Scenario, total: int, now: float) -> None:
        self.scenario = scenario
        self.step = max(1, int(scenario.fraction * total)) if scenario.fraction else 0
        self.last_at = now
        self.last_done = 0

    def due(self, now: float, done: int, total: int) -> bool:
        if self.scenario.event is Event.NONE or done >= total:
            return False
        if now - self.last_at >= self.scenario.period or (
            self.step and done - self.last_done >= self.step
        ):
            self.last_at, self.last_done = now, done
            return True
        return False


class _Pass:
    """One scenario, one client: start, drive, fault, reconcile, report."""

    def __init__(
        self,
        scenario: Scenario,
        client: str,
        options: ProofOptions,
        backend: Backend,
        jobs: Sequence[dict[str, Any]],
        progress: ProofProgress,
        stop: threading.Event,
    ) -> None:
        self.scenario = scenario
        self.client = client
        self.options = options
        self.backend = backend
        self.progress = progress
        self.stop = stop
        self.label = f"{scenario.name} · {client}"
        self.rng = random.Random(f"{options.seed}:{scenario.name}")
        self.bodies = _bodies(jobs, client, scenario, options.seed)
        self.faults: Counter[str] = Counter()
        self.holders: list[subprocess.Popen[bytes]] = []
        self.service_down_until: float | None = None
        self.storm_until: float | None = None
        self.restarts: list[tuple[subprocess.Popen[bytes], float]] = []

    # ------------------------------------------------------------------ whole pass
    def run(self) -> dict[str, Any]:
        self._check_stop()
        space = self.backend.space(f"{self.scenario.name}-{self.client}")
        self.space = space
        # The pass holds the service's listening socket: each service process (a restart
        # too) serves it, so the proxy's upstream is this pass's service and nothing else's.
        self.listener = listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port = port = listener.getsockname()[1]
        service_argv = [
            "service",
            *space.keys_args,
            "--lease",
            str(SERVICE_LEASE),
            "--fd",
            str(listener.fileno()),
            "--effects",
            str(space.dir / "effects.log"),
        ]
        if self.scenario.transactional:
            service_argv.append("--transactional")
        self.service = _Child(
            "service", service_argv, space.dir / "service.log", space.env, fds=(listener.fileno(),)
        )
        self.rates = _rates(self.scenario, self.options)
        self.children: list[_Child] = []
        try:
            self.service.start()
            self._wait_serving()
            with ChaosProxy(
                f"http://127.0.0.1:{port}", rates=self.rates, seed=self.options.seed
            ) as proxy:
                self.proxy = proxy
                if self.client == "naive":
                    row = self._naive(proxy.url + "/posts")
                else:
                    row = self._protected(proxy.url + "/posts")
        finally:
            for child in self.children:
                child.stop()
            self.service.stop()
            listener.close()
            self._end_outage(wait=True)
            with contextlib.suppress(Exception):
                space.close()
        return row

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise _Stopped

    def _wait_serving(self) -> None:
        """Until the service answers a request (a ``GET``, no effect). A connection alone
        proves nothing: the held socket accepts into its backlog while no process serves."""
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            self._check_stop()
            if answers("127.0.0.1", self.port, "/ready"):
                return
            if not self.service.alive:
                raise ProofError(f"the proof's service did not start: {self.service.tail()}")
            if time.monotonic() > deadline:
                raise ProofError(f"the proof's service did not answer within {_START_TIMEOUT} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------ the drive loop
    def _drive(self, done: Any, total: int) -> None:
        """Until ``done()`` reaches ``total`` with no client left running: progress, the
        schedule, restarts of exited clients, the end of outages and storms."""
        schedule = _Schedule(self.scenario, total, time.monotonic())
        self.progress.start(self.label, total)
        finished_at: float | None = None
        while True:
            self._check_stop()
            now = time.monotonic()
            count = done()
            if count is not None:
                self.progress.advance(self.label, count)
            complete = count is not None and count >= total
            self._tick(now)
            if not complete and schedule.due(now, count or 0, total):
                self._inject(now)
            for child in self.children:
                child.check()
                if not child.alive and not complete and not self._child_done(child):
                    child.start()
            if complete:
                if not any(child.alive for child in self.children):
                    break
                finished_at = finished_at or now
                if now - finished_at > 10:  # a client idling on nothing: stop it
                    for child in self.children:
                        child.stop()
            time.sleep(_TICK)
        self.progress.finish(self.label)

    def _child_done(self, child: _Child) -> bool:
        """A naive shard whose queue is empty is done; a worker never is while work remains."""
        return child.exited() == 0 and self.client == "naive"

    def _tick(self, now: float) -> None:
        if self.service_down_until is not None and now >= self.service_down_until:
            self.service_down_until = None
            self.service.start()
        elif self.service_down_until is None and not self.service.alive:
            self.service.check()  # died on its own: counted, the pass stops after too many
            self.service.start()
        if self.storm_until is not None and now >= self.storm_until:
            self.storm_until = None
            self.proxy.set_rates(self.rates)
        self._check_restarts(now)
        self.holders = [h for h in self.holders if h.poll() is None]

    def _check_restarts(self, now: float, *, wait: bool = False) -> None:
        """A restart command that exited non-zero, or ran past its timeout (then killed),
        counts as ``store_restart_failed``: the scenario then proves nothing about it."""
        pending = []
        for proc, started in self.restarts:
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, started + _RESTART_TIMEOUT - time.monotonic()))
            code = proc.poll()
            if code is None and (wait or now - started > _RESTART_TIMEOUT):
                proc.kill()
                proc.wait()
                code = -1
            if code is None:
                pending.append((proc, started))
            elif code != 0:
                self.faults["store_restart_failed"] += 1
        self.restarts = pending

    def _inject(self, now: float) -> None:
        event = self.scenario.event
        if event is Event.WORKER_KILL:
            alive = [c for c in self.children if c.alive]
            if alive:
                self.rng.choice(alive).kill()
                self.faults[event.value] += 1
        elif event is Event.SERVICE_KILL:
            if self.service_down_until is None and self.service.alive:
                self.service.kill()
                self.service_down_until = now + self.scenario.down
                self.faults[event.value] += 1
        elif event is Event.STORE_OUTAGE and not self.holders:
            command = self.options.restart_command
            if command and self.faults[event.value] == 1:  # the second outage: a restart
                self.holders = self.space.restart(command)
                self.restarts.extend((proc, now) for proc in self.holders)
                self.faults["store_restart"] += 1
            else:
                try:
                    self.holders = self.space.outage(self.scenario.down)
                except StoreError:
                    return
            self.faults[event.value] += 1
        elif event is Event.STORM and self.storm_until is None:
            self.proxy.set_rates(_storm(self.rates))
            self.storm_until = now + self.scenario.down
            self.faults[event.value] += 1

    def _end_outage(self, *, wait: bool) -> None:
        """Every fault over: the service up, the locks released, the storm ended."""
        self._check_restarts(time.monotonic(), wait=True)
        for holder in self.holders:
            if wait:
                holder.wait()
            else:
                holder.kill()
                holder.wait()
        self.holders = []
        self.storm_until = None

    def _heal(self) -> None:
        """End every fault and heal the link before reconciliation; the service listens."""
        self._end_outage(wait=True)
        self.proxy.heal()
        if self.service_down_until is not None or not self.service.alive:
            self.service_down_until = None
            self.service.start()
        self._wait_serving()

    # ------------------------------------------------------------------ naive
    def _naive(self, url: str) -> dict[str, Any]:
        shards = self.scenario.clients
        done_files = []
        for i in range(shards):
            jobs_file = self.space.dir / f"naive-{i}.jsonl"
            done_file = self.space.dir / f"naive-{i}.done"
            with jobs_file.open("w") as out:
                for body in self.bodies[i::shards]:
                    out.write(json.dumps(body) + "\n")
            done_files.append(done_file)
            self.children.append(
                _Child(
                    f"naive client {i + 1}",
                    [
                        "naive",
                        "--url",
                        url,
                        "--jobs",
                        str(jobs_file),
                        "--done",
                        str(done_file),
                        "--concurrency",
                        str(_share(self.options.concurrency, shards, i)),
                        "--attempts",
                        str(self.options.attempts),
                        "--timeout",
                        str(self.options.timeout),
                    ],
                    self.space.dir / f"naive-{i}.log",
                )
            )
        started = time.time()
        for child in self.children:
            child.start()

        counters = [_LineCounter(f) for f in done_files]

        def done() -> int:
            return sum(c.count() for c in counters)

        self._drive(done, len(self.bodies))
        self._end_outage(wait=True)
        seconds = time.time() - started
        beliefs: dict[str, ClientBelief] = {}
        for f in done_files:
            for line in _read_lines(f):
                beliefs[line["op"]] = ClientBelief(
                    operation_id=line["op"],
                    state=BeliefState(line["state"]),
                    seconds_to_terminal=line["at"] - started,
                )
        report = build_report(beliefs.values(), _retrying(self.space.effects))
        return self._row(report, seconds, unknown=report.unknown, max_attempts=None, deferred=None)

    # ------------------------------------------------------------------ protected
    def _protected(self, url: str) -> dict[str, Any]:
        opts = self.options
        policy = RetryPolicy(
            attempts=opts.attempts, wait_initial=0.05, wait_max=1.0, timeout=opts.timeout
        )
        store = self.space.open_outbox()
        outbox = Outbox(store, policy=policy)
        started = time.time()
        self.progress.note(
            f"{self.label}: recording {_plural(len(self.bodies), 'job')} and their keys"
        )
        # Each job and its key are recorded before any attempt (SPEC §2); one transaction.
        with store.transaction() as conn:
            for body in self.bodies:
                outbox.submit(url, json=body, connection=conn)
        workers = self.scenario.clients
        stats_files = []
        for i in range(workers):
            stats = self.space.dir / f"worker-{i}.json"
            stats_files.append(stats)
            self.children.append(
                _Child(
                    f"worker {i + 1}",
                    [
                        "worker",
                        *self.space.outbox_args,
                        "--lease",
                        str(WORKER_LEASE),
                        "--concurrency",
                        str(_share(opts.concurrency, workers, i)),
                        "--attempts",
                        str(opts.attempts),
                        "--timeout",
                        str(opts.timeout),
                        "--stats",
                        str(stats),
                    ],
                    self.space.dir / f"worker-{i}.log",
                    self.space.env,
                )
            )
        for child in self.children:
            child.start()
        terminal = (JobState.SUCCEEDED, JobState.REJECTED, JobState.UNKNOWN, JobState.CANCELLED)

        counted_at, counted = 0.0, 0

        def done() -> int | None:
            nonlocal counted_at, counted
            # A count over every job costs ~10 ms at 100,000 jobs: twice a second is plenty.
            # A small pass is over in a second or two: every tick, or its schedule is missed.
            every = _COUNT_EVERY if len(self.bodies) >= _COUNT_EVERY_FROM else 0.0
            if time.monotonic() - counted_at < every:
                return counted
            try:
                counts = outbox.counts()
            except StoreError:  # the store is away (the outage scenario): look again later
                return None
            counted_at, counted = time.monotonic(), sum(counts.get(s, 0) for s in terminal)
            return counted

        self._drive(done, len(self.bodies))

        # Every fault ends and the link heals; UNKNOWN jobs are re-sent with the same key.
        self._heal()
        delivered = _all_jobs(outbox, None, len(self.bodies))
        unknown = [j.id for j in delivered if j.state is JobState.UNKNOWN]
        # Delivery's attempts; reconciliation adds one per round to the jobs it re-sends.
        max_attempts = max((j.attempts for j in delivered), default=0)
        del delivered
        if unknown:
            self.progress.note(
                f"{self.label}: link healed, reconciling {_plural(len(unknown), 'UNKNOWN job')} "
                "with their same keys"
            )
        remaining = list(unknown)
        self.reconcile_rounds = 0
        give_up = time.monotonic() + _RECONCILE_FOR
        while remaining and (not self.reconcile_rounds or time.monotonic() < give_up):
            self._check_stop()
            if self.reconcile_rounds:
                time.sleep(_RECONCILE_PAUSE)
            self.reconcile_rounds += 1
            asyncio.run(
                areconcile(
                    store,
                    policy=policy,
                    ids=remaining,
                    limit=len(remaining),
                    concurrency=opts.concurrency,
                )
            )
            remaining = [j.id for j in _all_jobs(outbox, [JobState.UNKNOWN], len(self.bodies))]
        seconds = time.time() - started

        reconciled = set(unknown)
        beliefs = []
        unrecovered: Counter[str] = Counter()
        for job in _all_jobs(outbox, None, len(self.bodies)):
            if job.state is JobState.UNKNOWN:
                unrecovered[str(job.last_status or job.last_outcome)] += 1
            operation = json.loads(job.body)["operation"]
            state = _BELIEF.get(job.state, BeliefState.PENDING)
            beliefs.append(
                ClientBelief(
                    operation_id=operation,
                    state=state,
                    reconciled=job.id in reconciled and state is not BeliefState.UNKNOWN,
                    seconds_to_terminal=None
                    if job.finished_at is None
                    else job.finished_at - job.created_at,
                )
            )
        deferred = 0
        for stats in stats_files:
            with contextlib.suppress(OSError, ValueError):
                deferred += int(json.loads(stats.read_text()).get("deferred", 0))
        if self.backend.kind == "sqlite":
            store.close()
        report = build_report(beliefs, _retrying(self.space.effects))
        row = self._row(
            report, seconds, unknown=len(unknown), max_attempts=max_attempts, deferred=deferred
        )
        row["reconcile_rounds"] = self.reconcile_rounds
        # What the last re-send saw, for the failure's reason ({} when nothing stayed UNKNOWN:
        # every protected row has the same fields, for scripts).
        row["unrecovered_last_answer"] = dict(unrecovered)
        return row

    # ------------------------------------------------------------------ the row
    def _row(
        self,
        report: Any,
        seconds: float,
        *,
        unknown: int,
        max_attempts: int | None,
        deferred: int | None,
    ) -> dict[str, Any]:
        stats = self.proxy.stats()
        faults = dict(self.faults)
        for fault, n in stats.by_fault.items():
            if n and fault.value != "none":
                faults[fault.value] = n
        return {
            "operations": report.operations,
            "attempted": stats.requests,
            "acknowledged": report.succeeded,
            "effects": report.effects,
            "duplicated": report.duplicates,
            "duplicated_operations": report.duplicated_operations,
            "lost": report.lost,
            "unknown": unknown,
            "recovered": report.reconciled,
            "still_unknown": report.unknown,
            "rejected": report.rejected,
            "failed": report.failed,
            "failed_with_effect": report.failed_with_effect,
            "p50_seconds": _round(report.p50_seconds),
            "p95_seconds": _round(report.p95_seconds),
            "wall_seconds": round(seconds, 2),
            "ops_per_second": round(report.operations / seconds, 1) if seconds > 0 else None,
            "faults": faults,
            "max_attempts": max_attempts,
            "deferred": deferred,
        }


_BELIEF = {
    JobState.SUCCEEDED: BeliefState.SUCCEEDED,
    JobState.REJECTED: BeliefState.REJECTED,
    JobState.UNKNOWN: BeliefState.UNKNOWN,
}


def _plural(n: int, noun: str) -> str:
    """``1 job``, ``2 jobs``, ``100,000 jobs``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _share(total: int, parts: int, index: int) -> int:
    """Process ``index``'s part of ``total`` requests in flight (the parts add up to
    ``total``; at least one each, so 3 processes at ``--concurrency 1`` have 3)."""
    return max(1, total // parts + (1 if index < total % parts else 0))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _rates(scenario: Scenario, options: ProofOptions) -> FaultRates:
    """The scenario's loss rate plus the demo's background faults (SPEC §8)."""
    return DemoOptions(loss_rate=scenario.loss_rate, timeout=options.timeout).fault_rates()


def _storm(rates: FaultRates) -> FaultRates:
    """Every answer lost after commit (the other faults off meanwhile)."""
    healed = rates.healed()
    return healed.replace(lose_after_commit=1.0)


def _bodies(
    jobs: Sequence[dict[str, Any]], client: str, scenario: Scenario, seed: int
) -> list[dict[str, Any]]:
    """The pass's bodies: the same jobs for both clients, the same seeded slow handlers
    (``slow_share`` of them, at least one, so a small run has its slow handler too)."""
    bodies = [job_body(job, client) for job in jobs]
    if scenario.slow_share:
        count = max(1, round(scenario.slow_share * len(bodies)))
        for index in random.Random(f"{seed}:slow").sample(range(len(bodies)), count):
            bodies[index]["work_seconds"] = scenario.slow_seconds
    return bodies


def _retrying(read: Callable[[], _T]) -> _T:
    """``read()``, tried again while the store is away (a terminated backend's pooled
    connection fails once; an outage's lock ends): the runner's own reads must not fail a
    pass that the store's clients survived."""
    deadline = time.monotonic() + _STORE_PATIENCE
    while True:
        try:
            return read()
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _all_jobs(outbox: Outbox, states: list[JobState] | None, limit: int) -> list[Any]:
    return _retrying(lambda: outbox.jobs(states=states, limit=max(1, limit)))


class _LineCounter:
    """Lines in a file that only grows, reading only what was appended since last time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def count(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.lines
        self.offset += len(chunk)
        self.lines += chunk.count(b"\n")
        return self.lines


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)
