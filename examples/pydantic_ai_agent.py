"""A thin adapter for Pydantic AI (``pip install pydantic-ai-slim``): retrysafe tools as
Pydantic AI tools.

Pydantic AI takes plain Python callables as tools, so a ``@tool``-declared function already
works as one. The adapter adds what an agent framework needs around it:

- each model turn is a retrysafe step (``RunContext.run_step``), so the model emitting the
  same call twice in a turn, or a retried turn, runs the effect once;
- the agent run is activated inside every tool call (frameworks run tools in their own tasks
  or threads, where the caller's context may not reach);
- an unknown outcome is reported to the model as unknown, with the key, instead of an error
  (SPEC §7), so the model does not "fix" it by creating the ticket again.

    python examples/pydantic_ai_agent.py      # a scripted model (FunctionModel), no download
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, get_type_hints

from pydantic_ai import Agent, RunContext, Tool
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from retrysafe.agents import AgentRun, OutcomeUnknownError, start_run, tool

__all__ = ["guard"]


def guard(run: AgentRun, *tools: Callable[..., Any]) -> list[Tool[Any]]:
    """Pydantic AI tools for retrysafe tools, bound to ``run``.

    Args:
        run: the agent run (from ``start_run`` / ``resume_run``).
        tools: functions declared with ``@retrysafe.agents.tool``.

    Returns:
        One ``pydantic_ai.Tool`` per function, with the function's name, docstring and
        parameters (the model sees the same schema).
    """
    return [_guard_one(run, fn) for fn in tools]


def _guard_one(run: AgentRun, fn: Callable[..., Any]) -> Tool[Any]:
    is_async = inspect.iscoroutinefunction(fn)

    @functools.wraps(fn)
    async def call(ctx: RunContext[Any], /, **kwargs: Any) -> Any:
        with run.step(ctx.run_step):
            try:
                if is_async:
                    return await fn(**kwargs)
                return await asyncio.to_thread(fn, **kwargs)  # copies the context
            except OutcomeUnknownError as exc:
                return str(exc)  # "outcome unknown, key K: …" — unknown, not failed

    # The model sees the tool's own parameters, after Pydantic AI's context argument.
    hints = get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())
    ctx_param = inspect.Parameter(
        "ctx", inspect.Parameter.POSITIONAL_ONLY, annotation=RunContext[Any]
    )
    call.__signature__ = inspect.Signature([ctx_param, *params])  # type: ignore[attr-defined]
    call.__annotations__ = {**hints, "ctx": RunContext[Any]}
    del call.__wrapped__  # type: ignore[attr-defined]
    return Tool(call, takes_ctx=True, name=fn.__name__)


# ----------------------------------------------------------------------------- the demo
def scripted_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Turn 1: create the ticket, emitted twice. Turn 2: answer."""
    if len(messages) == 1:
        call = ToolCallPart("create_ticket", {"title": "printer on fire"})
        twice = ToolCallPart("create_ticket", {"title": "printer on fire"})
        return ModelResponse(parts=[call, twice])
    return ModelResponse(parts=[TextPart("ticket created")])


def main() -> int:
    import tempfile
    from pathlib import Path

    from retrysafe.stores import SQLiteStore

    created: list[str] = []

    @tool(kind="write")
    def create_ticket(title: str) -> dict[str, str]:
        """Create a support ticket."""
        created.append(title)
        return {"id": f"T-{len(created)}", "title": title}

    with tempfile.TemporaryDirectory() as tmp, SQLiteStore(Path(tmp) / "a.db") as store:
        run = start_run(store)
        agent = Agent(FunctionModel(scripted_model), tools=guard(run, create_ticket))
        print(agent.run_sync("my printer is on fire").output)
        for c in run.calls():
            print(c.step, c.tool, c.state.value, c.key, c.result_summary)
    print(f"{len(created)} ticket(s) created")
    return 0 if len(created) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
