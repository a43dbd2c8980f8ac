"""Agent runs: the run context that write tools need (SPEC §7).

A run has a stable id and lives in a store; the current run, step and call sit in context
variables, so tools find them without being passed anything. asyncio tasks inherit them; a
plain ``threading.Thread`` does not (contextvars are not copied into new threads): open
``run.step(n)`` inside the thread, or start it with ``contextvars.copy_context().run``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

from retrysafe._exceptions import AgentError, ConfigurationError, RunNotFoundError
from retrysafe.agents._budget import check_budget
from retrysafe.agents._keys import check_id
from retrysafe.agents._models import AgentCall, AgentRunRecord, AgentStore
from retrysafe.agents._store import agent_store

__all__ = [
    "AgentRun",
    "call_id",
    "current_call_key",
    "current_run",
    "resume_run",
    "start_run",
]

_run_var: ContextVar[AgentRun | None] = ContextVar("retrysafe_agent_run", default=None)
_step_var: ContextVar[int | None] = ContextVar("retrysafe_agent_step", default=None)
_key_var: ContextVar[str | None] = ContextVar("retrysafe_agent_call_key", default=None)
_call_id_var: ContextVar[str | None] = ContextVar("retrysafe_agent_call_id", default=None)
#: The call id in ``_call_id_var`` was derived by a framework adapter from where the call was
#: made (LangGraph: thread, node, step and arguments), not named by the application: such a
#: call still joins an earlier UNKNOWN call of the same write and arguments.
_derived_var: ContextVar[bool] = ContextVar("retrysafe_agent_call_id_derived", default=False)


def current_run() -> AgentRun | None:
    """The agent run of the current context, or None outside one."""
    return _run_var.get()


def current_call_key() -> str | None:
    """The idempotency key of the write tool call running in this context, or None.

    This is what :func:`retrysafe.agents.instrument` sends as ``Idempotency-Key``.
    """
    return _key_var.get()


@contextmanager
def call_id(value: str) -> Iterator[None]:
    """Name the next tool call(s) in this block explicitly, by an id the application keeps.

    The call's key is then derived from the run and ``value`` alone: one id names one logical
    call. Repeating the id with the same tool and arguments returns the recorded result;
    with another tool or other arguments it raises
    :class:`~retrysafe.agents.CallIdReusedError` and nothing runs.

    Use an id that stays the same across retries and resumes, e.g. derived from the
    application's own domain object (an order id, a ticket's external reference), or use no
    ``call_id`` at all: the default key comes from the run, the step and the canonical
    arguments (SPEC §7). Never pass an id the model mints per turn (its tool-call id): some
    models issue a new one every turn, so a retried or resumed step would become a second
    logical call and repeat the effect.

    Raises:
        ConfigurationError: ``value`` is not 1–255 visible ASCII characters (SPEC §2).
    """
    check_id(value, "call_id")
    token = _call_id_var.set(value)
    derived = _derived_var.set(False)
    try:
        yield
    finally:
        _derived_var.reset(derived)
        _call_id_var.reset(token)


@contextmanager
def derived_call_id(value: str) -> Iterator[None]:
    """:func:`call_id` for an id a framework adapter derived from the call's site (not one
    the application keeps): the call still joins an earlier UNKNOWN call of the same write
    tool with the same arguments, as a default key does."""
    with call_id(value):
        token = _derived_var.set(True)
        try:
            yield
        finally:
            _derived_var.reset(token)


def _open(store: Any) -> AgentStore:
    """The agent store of a store, or of the store a URL names."""
    if isinstance(store, str):
        from retrysafe.stores import open_store

        store = open_store(store)
    return agent_store(store)


class AgentRun:
    """One agent run: its id, its store, its budgets and the current step.

    Use it as a (sync or async) context manager; inside, write tools record and dedupe their
    calls in this run. Create one with :func:`start_run` or :func:`resume_run`.

    Attributes:
        id: the run id. ``store``: where calls are recorded (the
            :func:`~retrysafe.agents.agent_store` of the store it was given).
        max_steps: logical calls allowed in the run (None: unlimited).
        max_attempts: attempts allowed per logical call over every process (None: unlimited).
        retry_unknown: re-send calls whose outcome is unknown, with their same key.
        owner: this process's claimant name (host:pid:random).
        telemetry: where write calls (executed, replayed, unknown, failed) and budget
            refusals are reported, or None.
    """

    def __init__(
        self,
        store: object,
        record: AgentRunRecord,
        *,
        retry_unknown: bool = False,
        clock: Callable[[], float] = time.time,
        telemetry: Any = None,
    ) -> None:
        from retrysafe.observability._telemetry import telemetry_of

        self.telemetry = telemetry_of(telemetry)
        self.store: AgentStore = agent_store(store)
        self.id = record.id
        self.max_steps = record.max_steps
        self.max_attempts = record.max_attempts
        self.retry_unknown = retry_unknown
        self.clock = clock
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._last_step = 0
        self._tokens: list[Token[AgentRun | None]] = []
        # Tool name -> the function that first made a write call under it in this process
        # (module:qualname): two tools sharing a name would share keys and results.
        self._origins: dict[str, str] = {}
        self._origins_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AgentRun({self.id!r})"

    def __enter__(self) -> AgentRun:
        self._tokens.append(_run_var.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _run_var.reset(self._tokens.pop())

    async def __aenter__(self) -> AgentRun:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    @contextmanager
    def step(self, number: int | None = None) -> Iterator[int]:
        """Mark the tool calls in this block as step ``number`` (default: the next one).

        The block also makes this run the current one, so ``with run.step(n):`` alone is
        enough where entering the run itself is not convenient (framework callbacks,
        concurrent tasks).

        Steps number from 1 in each process, so a resumed run that replays the same loop
        gets the same step numbers and therefore the same call keys.
        """
        if number is None:
            number = self._last_step + 1
        elif (
            isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 2**63
        ):
            raise ConfigurationError(
                f"step must be an integer from 0 to 2**63-1, not {number!r} (steps number "
                "from 1; 0 is the step of calls made outside any step)",
                option="step",
            )
        self._last_step = max(self._last_step, number)
        run_token = _run_var.set(self)
        token = _step_var.set(number)
        try:
            yield number
        finally:
            _step_var.reset(token)
            _run_var.reset(run_token)

    def check_tool(self, name: str, origin: str) -> None:
        """Refuse a second tool (``origin``: its ``module:qualname``) writing under a tool
        ``name`` another tool of this run uses: their calls would share keys, so one would
        get the other's recorded results and never run.

        Raises:
            ConfigurationError: naming both functions and the fix (``@tool(name=...)``).
        """
        with self._origins_lock:
            first = self._origins.setdefault(name, origin)
        if first != origin:
            raise ConfigurationError(
                f"two tools are named {name!r} in agent run {self.id!r}: {first} and "
                f"{origin}; their calls would share keys and one would get the other's "
                "results. Give each its own name: @tool(kind=..., name='...')",
                option="name",
            )

    def record(self) -> AgentRunRecord:
        """The run as stored now."""
        rec = self.store.get_agent_run(self.id)
        if rec is None:  # pragma: no cover - deleted under us
            raise RunNotFoundError(f"agent run {self.id!r} no longer exists", run_id=self.id)
        return rec

    def calls(self) -> list[AgentCall]:
        """The audit log of this run: one row per logical call, in order."""
        return self.store.list_agent_calls(self.id)


def start_run(
    store: Any,
    run_id: str | None = None,
    *,
    max_steps: int | None = None,
    max_attempts: int | None = None,
    telemetry: Any = None,
) -> AgentRun:
    """Start a new agent run and record it in ``store``.

    Args:
        store: a :class:`~retrysafe.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore`,
            or a store URL (``sqlite:///agent.db``, ``postgresql://user@host/db``).
        run_id: the run's id, 1–255 visible ASCII characters like an idempotency key
            (SPEC §2); None generates one (read it back from ``run.id``).
        max_steps: logical calls allowed in the run; the next one raises
            :class:`~retrysafe.BudgetExceededError` (``kind="steps"``). None: unlimited.
        max_attempts: attempts allowed per logical call, summed over every process
            (``kind="attempts"``). None: unlimited.
        telemetry: a :class:`~retrysafe.observability.Prometheus`, an
            :class:`~retrysafe.observability.OpenTelemetry` or a list of both (write calls
            by outcome, budget refusals, a span per write call).

    Raises:
        AgentError: ``run_id`` exists already (use :func:`resume_run`).
        ConfigurationError: ``run_id`` is not 1–255 visible ASCII characters, a budget is not
            a positive integer, or the store cannot hold runs.
    """
    check_budget("max_steps", max_steps)
    check_budget("max_attempts", max_attempts)
    s = _open(store)
    rid = check_id(run_id, "run_id") if run_id is not None else f"run_{uuid.uuid4().hex}"
    created, record = s.create_agent_run(
        rid, max_steps=max_steps, max_attempts=max_attempts, now=time.time()
    )
    if not created:
        raise AgentError(
            f"agent run {rid!r} exists already; resume it with resume_run()", run_id=rid
        )
    return AgentRun(s, record, telemetry=telemetry)


def resume_run(
    store: Any, run_id: str, *, retry_unknown: bool = False, telemetry: Any = None
) -> AgentRun:
    """Resume an agent run, e.g. in a new process after a crash.

    Calls the run recorded keep their keys and results: replaying the agent loop returns the
    stored results and never re-executes a completed write. Calls left RUNNING by the stopped
    process become UNKNOWN (their effect may have happened). Only resume a run whose previous
    process has stopped.

    Args:
        store: the store (or store URL) the run was started in.
        run_id: the run's id.
        retry_unknown: re-send UNKNOWN write calls when they are repeated, with their same key
            (safe when the remote API dedupes by ``Idempotency-Key``); by default a repeat
            raises :class:`~retrysafe.OutcomeUnknownError` instead.
        telemetry: as for :func:`start_run`.

    Raises:
        RunNotFoundError: no run with that id in the store.
    """
    s = _open(store)
    record = s.get_agent_run(run_id)
    if record is None:
        raise RunNotFoundError(
            f"no agent run {run_id!r} in {getattr(s, 'url', s)!r}; start it with start_run()",
            run_id=run_id,
        )
    s.interrupt_agent_calls(run_id, now=time.time())
    return AgentRun(s, record, retry_unknown=retry_unknown, telemetry=telemetry)
