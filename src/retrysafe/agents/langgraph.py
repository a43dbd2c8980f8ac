"""LangGraph adapter: side effects in nodes and tools that a resumed thread never repeats
(SPEC §7). Needs ``pip install 'retrysafe[langgraph]'`` (langgraph ``>=0.3,<2``).

LangGraph re-runs a node from its start when a thread resumes after ``interrupt()``, after a
crash, or when a ``RetryPolicy`` retries it (langchain-ai/langgraph#6577, #6208), so an
effect inside the node runs again. Wrap the function that has the effect::

    from retrysafe.agents.langgraph import ThreadRuns

    runs = ThreadRuns("sqlite:///agent.db")       # configured once

    @runs.effect                                  # a retrysafe write tool, keyed by the thread
    def create_ticket(title: str) -> dict: ...

    def file_ticket(state):                       # a node: no start_run, no step to pass
        ticket = create_ticket(state["title"])
        approved = interrupt("approve?")          # the resume re-runs the node: 1 ticket
        ...

    tools = ToolNode(runs.tools(create_ticket))   # or as ToolNode tools

Each call finds the thread's retrysafe run (``langgraph:<thread_id>``, created on first use)
and its place in the thread from the LangGraph config (``langgraph.config.get_config()``), and
runs as a retrysafe write tool there: recorded before its first attempt, the stored result
returned to every re-run. See ``retrysafe.agents._langgraph`` and ``docs/langgraph.md`` for
what names a call and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast, overload

from retrysafe._exceptions import ConfigurationError, NoActiveRunError, OutcomeUnknownError
from retrysafe.agents._budget import check_budget
from retrysafe.agents._keys import arguments_hash, bind_arguments, check_id
from retrysafe.agents._langgraph import (
    SUPPORTED,
    call_site,
    check_version,
    site_call_id,
    thread_run_id,
)
from retrysafe.agents._models import AgentCall, AgentStore
from retrysafe.agents._run import AgentRun, _call_id_var, current_run, derived_call_id
from retrysafe.agents._store import agent_store
from retrysafe.agents._tools import ToolSpec, is_retryable, tool

__all__ = ["SUPPORTED", "ThreadRuns"]


check_version()

from langgraph.config import get_config  # noqa: E402 - after the version check

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class _Plan:
    """How one call runs: in which run, at which step, under which call id (None: the key
    comes from the tool's own rule, e.g. ``dedupe="run"``, or the caller's ``call_id``)."""

    run_id: str
    step: int
    call_id: str | None


class ThreadRuns:
    """LangGraph threads as retrysafe agent runs: one run per thread, made active for every
    call of a wrapped tool from the LangGraph config, so nodes need no ``start_run``.

    A call's key (SPEC §7: run, step, canonical arguments) is derived from:

    - the run: ``{prefix}:{thread_id}`` (``configurable.thread_id``; a thread id that is not
      1–255 visible ASCII is hashed);
    - the step: ``metadata.langgraph_step``, the same when the node resumes after
      ``interrupt()``, is retried, or re-runs from the checkpointer after a crash, and higher in
      a later invocation of the thread (another user message); it is the step in the audit log;
    - the node (``langgraph_node``), and inside a subgraph or an ``@task`` the enclosing
      namespace with its task ids (a subgraph counts steps afresh per invocation) and the
      ``@task`` call's index;
    - the tool's name and the canonical JSON of its bound arguments.

    The site, tool and arguments are hashed into a call id (``langgraph-…``) passed to
    :func:`~retrysafe.agents.call_id`; the key is then retrysafe's own :func:`call_key`. So
    re-running a node returns the stored result; the same tool with the same arguments in a
    later turn is a new logical call (use ``dedupe="run"`` to make it the same one); two
    identical calls in one node execution are one call. A ``call_id(...)`` the node opens
    itself wins. The model's tool-call id is never used.

    Args:
        store: a :class:`~retrysafe.SQLiteStore`, a :class:`~retrysafe.stores.PostgresStore`
            or a store URL (``sqlite:///agent.db``, ``postgresql://…``; opened here and closed
            by :meth:`close`).
        prefix: the run ids' prefix (1–255 visible ASCII): give two applications that share
            a store and thread ids their own.
        max_steps: logical calls allowed per thread (None: unlimited), as for
            :func:`~retrysafe.agents.start_run`; fixed when the thread's run is created.
        max_attempts: attempts allowed per logical call over every process (None: unlimited).
        retry_unknown: re-send a call whose outcome is unknown with its same key (safe when
            the remote API dedupes by ``Idempotency-Key``); by default its repeats are
            reported unknown.
        telemetry: as for :func:`~retrysafe.agents.start_run`.

    Raises:
        ConfigurationError: a bad prefix or budget, or a store that cannot hold runs.
    """

    def __init__(
        self,
        store: Any,
        *,
        prefix: str = "langgraph",
        max_steps: int | None = None,
        max_attempts: int | None = None,
        retry_unknown: bool = False,
        telemetry: Any = None,
    ) -> None:
        check_budget("max_steps", max_steps)
        check_budget("max_attempts", max_attempts)
        check_id(prefix, "prefix")
        self._opened: Any = None
        if isinstance(store, str):
            from retrysafe.stores import open_store

            store = self._opened = open_store(store)
        self.store: AgentStore = agent_store(store)
        self.prefix = prefix
        self.max_steps = max_steps
        self.max_attempts = max_attempts
        self.retry_unknown = retry_unknown
        self.telemetry = telemetry

    def __repr__(self) -> str:
        return f"ThreadRuns({getattr(self.store, 'url', self.store)!r}, prefix={self.prefix!r})"

    def close(self) -> None:
        """Close the store if it was opened from a URL here."""
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    def __enter__(self) -> ThreadRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ runs
    def run_id(self, thread_id: object) -> str:
        """The retrysafe run id of a LangGraph thread."""
        return thread_run_id(self.prefix, thread_id)

    def run(self, thread_id: object) -> AgentRun:
        """The thread's agent run, created (with this object's budgets) if absent.

        Nothing is interrupted: calls another process is running stay RUNNING.
        """
        return self._run_for(self.run_id(thread_id))

    def resume(self, thread_id: object) -> AgentRun:
        """Declare the process that ran the thread stopped, before resuming the graph.

        Its calls still RUNNING become UNKNOWN at once (their effect may have happened), as
        :func:`~retrysafe.agents.resume_run` does, instead of blocking their re-run until
        their lease ends. Only call it when that process has stopped. Optional: without it a
        re-run takes a dead process's call over once its ``lease`` ran out.
        """
        run = self.run(thread_id)
        self.store.interrupt_agent_calls(run.id, now=time.time())
        return run

    def calls(self, thread_id: object) -> list[AgentCall]:
        """The thread's audit log: one row per logical call, in order (empty if none)."""
        return self.store.list_agent_calls(self.run_id(thread_id))

    # ------------------------------------------------------------------ wrappers
    @overload
    def effect(self, fn: _F, /) -> _F: ...

    @overload
    def effect(
        self,
        /,
        *,
        report_unknown: bool = ...,
        name: str | None = ...,
        attempts: int = ...,
        wait_initial: float = ...,
        wait_max: float = ...,
        retry_on: Callable[[BaseException], bool] = ...,
        dedupe: Literal["step", "run"] = ...,
        lease: float | timedelta = ...,
        heartbeat: float | timedelta | None = ...,
        max_run_time: float | timedelta = ...,
    ) -> Callable[[_F], _F]: ...

    def effect(
        self,
        fn: Any = None,
        /,
        *,
        report_unknown: bool = False,
        name: str | None = None,
        attempts: int = 3,
        wait_initial: float = 0.1,
        wait_max: float = 5.0,
        retry_on: Callable[[BaseException], bool] = is_retryable,
        dedupe: Literal["step", "run"] = "step",
        lease: float | timedelta = 30.0,
        heartbeat: float | timedelta | None = None,
        max_run_time: float | timedelta = 3600.0,
    ) -> Any:
        """Declare a function a write tool (``@tool(kind="write", …)``) keyed by the thread.

        ``@runs.effect`` or ``@runs.effect(attempts=5, lease=10)``; the options are
        :func:`~retrysafe.agents.tool`'s, plus ``report_unknown`` (see :meth:`keyed`).

        Raises:
            ConfigurationError: as :func:`~retrysafe.agents.tool` raises it.
        """
        declare = tool(
            kind="write",
            name=name,
            attempts=attempts,
            wait_initial=wait_initial,
            wait_max=wait_max,
            retry_on=retry_on,
            dedupe=dedupe,
            lease=lease,
            heartbeat=heartbeat,
            max_run_time=max_run_time,
        )

        def decorate(f: _F) -> _F:
            return self.keyed(declare(f), report_unknown=report_unknown)

        return decorate(fn) if fn is not None else decorate

    def tools(self, *fns: Callable[..., Any]) -> list[Callable[..., Any]]:
        """The tools for a ``ToolNode`` (or ``create_react_agent``): :meth:`keyed` with
        ``report_unknown=True``, so the model reads an unknown outcome, with its key, as the
        tool's answer instead of the graph failing."""
        return [self.keyed(fn, report_unknown=True) for fn in fns]

    def keyed(self, fn: _F, *, report_unknown: bool = False) -> _F:
        """Run a retrysafe tool in its LangGraph thread's run, at its place in the thread.

        Args:
            fn: a sync or async function declared with :func:`~retrysafe.agents.tool`
                (``kind="write"`` for an effect; a read tool just gets its audit row).
            report_unknown: return the :class:`~retrysafe.OutcomeUnknownError`'s text
                ("outcome unknown, key K: …") as the result instead of raising it: what a
                model should read (SPEC §7: unknown, with the key, not a failure). The
                default raises it, which suits a plain node: its return value is state.

        Returns:
            A function with ``fn``'s name, docstring and signature (LangChain builds the
            tool schema from them). Called outside a LangGraph run it is ``fn`` itself
            (a write tool then needs a ``start_run``).

        The wrapper raises what ``fn`` raises (SPEC §7, ``docs/agents.md``), and:

        Raises:
            NoActiveRunError: a write tool ran in a graph without a ``thread_id`` (compiled
                without a checkpointer), and no retrysafe run is active.
            PayloadError: an argument is not JSON-serialisable; the message names it and
                its path (``$.when``). Nothing is recorded or run.
            ConfigurationError: ``fn`` is not a retrysafe tool.
        """
        spec = getattr(fn, "__retrysafe_tool__", None)
        if not isinstance(spec, ToolSpec):
            raise ConfigurationError(
                f"{getattr(fn, '__qualname__', fn)!r} is not a retrysafe tool; declare it "
                "with @retrysafe.agents.tool(kind='write') or use ThreadRuns.effect",
                option="fn",
            )
        wrapper: Any
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    plan = self._plan(spec, args, kwargs)
                    if plan is None:
                        return await fn(*args, **kwargs)
                    run = await asyncio.to_thread(self._run_for, plan.run_id)
                    with run.step(plan.step), _named(plan.call_id):
                        return await fn(*args, **kwargs)
                except OutcomeUnknownError as exc:
                    if report_unknown:
                        return str(exc)
                    raise

            wrapper = async_wrapper
        else:

            @functools.wraps(fn)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    plan = self._plan(spec, args, kwargs)
                    if plan is None:
                        return fn(*args, **kwargs)
                    with self._run_for(plan.run_id).step(plan.step), _named(plan.call_id):
                        return fn(*args, **kwargs)
                except OutcomeUnknownError as exc:
                    if report_unknown:
                        return str(exc)
                    raise

            wrapper = sync_wrapper
        return cast(_F, wrapper)

    def _run_for(self, run_id: str) -> AgentRun:
        _, record = self.store.create_agent_run(
            run_id, max_steps=self.max_steps, max_attempts=self.max_attempts, now=time.time()
        )
        return AgentRun(
            self.store, record, retry_unknown=self.retry_unknown, telemetry=self.telemetry
        )

    def _plan(self, spec: ToolSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan | None:
        """Where this call runs, from the LangGraph config; None: run the tool as declared
        (outside LangGraph, or in a graph without a thread while a retrysafe run is active)."""
        try:
            config = get_config()
        except RuntimeError:
            return None
        site = call_site(config)
        if site is None:
            if spec.kind == "write" and current_run() is None:
                raise NoActiveRunError(
                    f"write tool {spec.name!r} ran in a LangGraph graph without a thread_id, "
                    "so nothing can name its call across a resume: compile the graph with a "
                    "checkpointer and invoke it with config={'configurable': {'thread_id': …}}",
                    tool=spec.name,
                )
            return None
        named: str | None = None
        if spec.dedupe == "step" and _call_id_var.get() is None:
            digest = arguments_hash(bind_arguments(spec.signature, spec.name, args, kwargs))
            named = site_call_id(site, spec.name, digest)
        return _Plan(thread_run_id(self.prefix, site.thread_id), site.step, named)


@contextlib.contextmanager
def _named(value: str | None) -> Iterator[None]:
    """``call_id(value)``, or nothing when the key comes from the tool's own rule."""
    if value is None:
        yield
        return
    with derived_call_id(value):
        yield
