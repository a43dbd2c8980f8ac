"""retrysafe tools for the OpenAI Agents SDK (``pip install 'retrysafe[openai-agents]'``).

SPEC §7 in the SDK's terms: :func:`function_tool` turns a ``@retrysafe.agents.tool``-declared
function into an SDK ``FunctionTool`` with the same name, description and parameter schema as
the SDK's own ``function_tool`` would give it; :func:`run_agent` runs ``Runner.run`` as one
retrysafe step of an agent run::

    from agents import Agent
    from retrysafe.agents import start_run, tool
    from retrysafe.agents.openai_agents import function_tool, run_agent

    @tool(kind="write")
    def create_ticket(title: str) -> dict[str, str]: ...

    agent = Agent(name="support", tools=[function_tool(create_ticket)])
    run = start_run("sqlite:///agent.db", "support-42")
    result = await run_agent(agent, "my printer is on fire", run=run, step=1)

**Keys.** A write call's key comes from the run id, the tool's retrysafe name, the step and the
canonical JSON of its arguments (:func:`retrysafe.agents.call_key`), never from the model's
tool-call id, which the model mints anew on every turn. The step is the whole
``Runner.run`` (one user-level request): every turn (model call) inside it shares it, so a
model that emits the same write with the same arguments again on a later turn, with a new call
id, because the first answer was lost or it did not trust it, makes the same logical call and
gets the recorded result (or the recorded "outcome unknown"). The step number is given by the
caller, so a run resumed in a new process (:func:`retrysafe.agents.resume_run`, same run id,
same step) gets the same keys and does not repeat an effect.

**Outcomes.** An unknown outcome (:class:`~retrysafe.OutcomeUnknownError`) is a result, not a
failure: the model gets the text ``"outcome unknown, key K: …"`` as the tool's output, so it
does not "fix" it by calling again with other arguments. Other exceptions follow the SDK's tool
error path (``failure_error_function``): by default the model gets the SDK's generic message
and the SDK logs the error, except that a repeated failed call
(:class:`~retrysafe.ToolCallFailedError`) and an argument that cannot be recorded
(:class:`~retrysafe.PayloadError`) reach the model as retrysafe's own message (the key, the
argument), and errors no model can act on (no active run, a changed tool signature, an
exhausted budget, a call taken over, a reused call id, an unreachable store) raise out of
``Runner.run``.

Supported: openai-agents ``>=0.2,<1`` (:data:`SUPPORTED_VERSIONS`), checked at import.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, overload

from retrysafe._exceptions import (
    ConfigurationError,
    OutcomeUnknownError,
    PayloadError,
    RetrysafeError,
    ToolCallFailedError,
)
from retrysafe._versions import require, specifier
from retrysafe.agents._run import AgentRun
from retrysafe.agents._tools import ToolSpec

__all__ = [
    "SUPPORTED_VERSIONS",
    "format_tool_error",
    "function_tool",
    "guard",
    "run_agent",
    "run_agent_streamed",
    "run_agent_sync",
]

#: The openai-agents releases this adapter supports (a PEP 440 specifier).
SUPPORTED_VERSIONS = specifier((0, 2), (1, 0))

log = logging.getLogger("retrysafe.agents")

require(
    "openai-agents",
    label="openai-agents",
    user="retrysafe.agents.openai_agents",
    lowest=(0, 2),
    beyond=(1, 0),
    extra="openai-agents",
)

import agents  # noqa: E402  (only once the installed version is known to be supported)
from agents import (  # noqa: E402
    FunctionTool,
    RunContextWrapper,
    Runner,
    RunResult,
    RunResultStreaming,
    default_tool_error_function,
)

#: retrysafe errors the model gets as their message: a call outcome it can act on.
_TOLD_TO_MODEL = (ToolCallFailedError, PayloadError)


def format_tool_error(ctx: RunContextWrapper[Any], error: Exception) -> str | None:
    """The default ``failure_error_function`` of :func:`function_tool`.

    Args:
        ctx: the SDK's run context (unused; the SDK's signature).
        error: what the tool invocation raised.

    Returns:
        retrysafe's own message for a :class:`~retrysafe.ToolCallFailedError` (a repeat of a
        call that failed definitively, or whose result cannot be replayed: it names the key
        and says it is not run again) or a :class:`~retrysafe.PayloadError` (an argument that
        cannot be recorded, named with its path: nothing ran); None for any other retrysafe
        error, so the SDK raises it out of ``Runner.run`` (no active run, a changed tool
        signature, an exhausted budget, a call taken over, a reused call id, an unreachable
        store: nothing the model can fix); and the SDK's own ``default_tool_error_function``
        text for every other exception. The two errors told to the model are also logged at WARNING
        (logger ``retrysafe.agents``), since the SDK logs handled tool errors at DEBUG
        unless tool data logging is on.
    """
    if isinstance(error, _TOLD_TO_MODEL):
        # The SDK logs handled tool errors at DEBUG only (unless tool data logging is on):
        # say it where the developer looks.
        log.warning("%s, reported to the model: %s", type(error).__name__, error)
        return str(error)
    if isinstance(error, RetrysafeError):
        return None
    return default_tool_error_function(ctx, error)


def _spec(fn: Callable[..., Any]) -> ToolSpec:
    spec = getattr(fn, "__retrysafe_tool__", None)
    if not isinstance(spec, ToolSpec):
        raise ConfigurationError(
            f"{getattr(fn, '__qualname__', fn)!r} is not a retrysafe tool; declare it with "
            '@retrysafe.agents.tool(kind="read") or @retrysafe.agents.tool(kind="write") '
            "before passing it to function_tool()",
            option="fn",
        )
    return spec


def _unknown(exc: OutcomeUnknownError) -> str:
    log.warning(
        "outcome unknown, key %s (run %r, tool %r): reported to the model as unknown",
        exc.key,
        exc.run_id,
        exc.tool,
        extra={"run_id": exc.run_id, "key": exc.key, "tool": exc.tool},
    )
    return str(exc)


def _reporting_unknown(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the same signature, returning an unknown outcome as text (SPEC §7)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_invoke(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except OutcomeUnknownError as exc:
                return _unknown(exc)

        return async_invoke

    @functools.wraps(fn)
    def invoke(*args: Any, **kwargs: Any) -> Any:
        # The SDK runs a sync tool with asyncio.to_thread, which copies the context: the
        # run and the step set by run_agent reach this thread.
        try:
            return fn(*args, **kwargs)
        except OutcomeUnknownError as exc:
            return _unknown(exc)

    return invoke


@overload
def function_tool(fn: Callable[..., Any], /, **options: Any) -> FunctionTool: ...


@overload
def function_tool(**options: Any) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def function_tool(fn: Any = None, /, **options: Any) -> Any:
    """An SDK ``FunctionTool`` for a ``@retrysafe.agents.tool``-declared function.

    Use it as a call (``function_tool(create_ticket, name_override="create")``) or as a
    decorator above ``@tool`` (``@function_tool`` / ``@function_tool(...)``).

    The SDK's ``agents.function_tool`` builds it from the function, so the model sees the
    same name, description and JSON schema as for the plain function. Write calls need an
    active agent run and get their keys from it (SPEC §7): run the agent with
    :func:`run_agent` (or inside ``with run.step(n):``). Read tools run on every call.

    Args:
        fn: a function declared with :func:`retrysafe.agents.tool` (sync or async). Its
            parameters must be JSON values (str, int, float, bool, None, lists, dicts,
            ``TypedDict``): a parameter the SDK turns into another object (a ``datetime``, a
            Pydantic model, a dataclass) cannot be recorded, and each call of it is refused
            with :class:`~retrysafe.PayloadError` naming the argument.
        options: keyword arguments of ``agents.function_tool`` (``name_override``,
            ``description_override``, ``strict_mode``, ``needs_approval``, ``timeout``, …).
            ``failure_error_function`` defaults to :func:`format_tool_error`; pass your own
            (it then receives every error but an unknown outcome) or None (every error
            raises out of ``Runner.run``).

    Returns:
        The ``FunctionTool`` (or, without ``fn``, a decorator making one).

    Raises:
        ConfigurationError: ``fn`` is not a retrysafe tool, or it takes the SDK's run
            context as its first parameter (the context is not an argument of the logical
            call; read what the tool needs from it before the call instead).
    """
    if fn is None:
        return lambda f: function_tool(f, **options)
    _spec(fn)
    if _takes_context(fn, strict=bool(options.get("strict_mode", True))):
        raise ConfigurationError(
            f"tool {fn.__qualname__!r} takes the SDK's run context; retrysafe tools take "
            "only JSON arguments (they make the call's key)",
            option="fn",
        )
    options.setdefault("failure_error_function", format_tool_error)
    built: FunctionTool = agents.function_tool(_reporting_unknown(fn), **options)
    return built


def _takes_context(fn: Callable[..., Any], *, strict: bool) -> bool:
    """Whether ``fn``'s first parameter is the SDK's context (read from the SDK's own schema
    of it, built as ``function_tool`` will build it: strict or not)."""
    from agents.function_schema import function_schema

    schema = function_schema(fn, use_docstring_info=False, strict_json_schema=strict)
    return bool(schema.takes_context)


def guard(*tools: Callable[..., Any]) -> list[FunctionTool]:
    """``[function_tool(t) for t in tools]``: SDK tools for retrysafe tools, with defaults.

    Raises:
        ConfigurationError: as :func:`function_tool`.
    """
    return [function_tool(t) for t in tools]


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigurationError(
            f"step must be an integer >= 1 (the request's number in the run), not {step!r}",
            option="step",
        )
    return step


def _check_run(run: object) -> AgentRun:
    if not isinstance(run, AgentRun):
        raise ConfigurationError(
            "run must be an AgentRun from retrysafe.agents.start_run() or resume_run(), "
            f"not {type(run).__name__}",
            option="run",
        )
    return run


@contextmanager
def _as_step(run: object, step: object) -> Iterator[None]:
    """Run the block as step ``step`` of ``run``; a retrysafe error the SDK wrapped (its
    ``UserError`` "Error running tool …", with the retrysafe error as ``__cause__``) is
    raised as itself, so ``except BudgetExceededError`` works."""
    with _check_run(run).step(_check_step(step)):
        try:
            yield
        except agents.exceptions.AgentsException as exc:
            cause = exc.__cause__
            if isinstance(cause, RetrysafeError):
                raise cause from None
            raise


async def run_agent(
    agent: agents.Agent[Any], input: Any, *, run: AgentRun, step: int, **options: Any
) -> RunResult:
    """``await Runner.run(agent, input, **options)`` as step ``step`` of ``run``.

    Every tool call of the run (every turn, every handoff) belongs to that step: a write
    with the same tool and arguments is one logical call however often the model emits it,
    whatever call ids it gives it. Give each user-level request its own step number, and the
    same number when it is run again (resumed in a new process after a crash, or retried):
    the same keys, so no effect is repeated.

    Args:
        agent: the SDK agent; its retrysafe tools made with :func:`function_tool`.
        input: what ``Runner.run`` takes (a string, input items, or a ``RunState`` to resume
            an interrupted SDK run).
        run: the agent run (``start_run`` / ``resume_run``).
        step: this request's number in the run, an integer >= 1.
        options: keyword arguments of ``Runner.run`` (``context``, ``max_turns``,
            ``run_config``, ``session``, ...).

    Returns:
        The SDK's ``RunResult``.

    Raises:
        ConfigurationError: ``run`` is not an :class:`~retrysafe.agents.AgentRun`, or ``step``
            is not an integer >= 1.
        RetrysafeError: an error no model can act on, raised as itself
            (:class:`~retrysafe.NoActiveRunError`, :class:`~retrysafe.ToolSignatureError`,
            :class:`~retrysafe.BudgetExceededError`, :class:`~retrysafe.CallIdReusedError`,
            :class:`~retrysafe.AgentError` for a call taken over; see
            :func:`format_tool_error`); and whatever else ``Runner.run`` raises.
    """
    with _as_step(run, step):
        return await Runner.run(agent, input, **options)


def run_agent_sync(
    agent: agents.Agent[Any], input: Any, *, run: AgentRun, step: int, **options: Any
) -> RunResult:
    """:func:`run_agent` through ``Runner.run_sync`` (for code without an event loop)."""
    with _as_step(run, step):
        return Runner.run_sync(agent, input, **options)


def run_agent_streamed(
    agent: agents.Agent[Any], input: Any, *, run: AgentRun, step: int, **options: Any
) -> RunResultStreaming:
    """:func:`run_agent` through ``Runner.run_streamed``.

    The streaming run's task is created here, in the step's context, so its tool calls
    belong to the step while you consume ``stream_events()`` after this returns. Errors
    surface there as the SDK raises them (a retrysafe error as the ``__cause__``).
    """
    with _check_run(run).step(_check_step(step)):
        return Runner.run_streamed(agent, input, **options)
