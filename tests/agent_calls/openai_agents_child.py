"""A scripted OpenAI Agents SDK model, and a child agent process for the kill/resume test.

As a module: :class:`ScriptedModel` implements the SDK's ``Model`` interface (no network, no
API key): each turn it calls a script with the turn number and the tool outputs it has seen,
and answers with the script's output items (:func:`tool_call`, :func:`say`).

As a script: ``openai_agents_child.py STORE_URL SERVICE_URL RUN_ID start|resume``. The agent
asks to create the ticket "kill me" (a new call id in every process); ``start`` opens the run,
``resume`` waits for a line on stdin (so it can be started, and import, while the first
process runs), then resumes it with ``retry_unknown=True``. Both run the request as step 1. Prints
the tool outputs the model saw as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import agents
import httpx
from agents import Agent, Model, ModelResponse, Usage
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from retrysafe.agents import instrument, resume_run, start_run, tool
from retrysafe.agents.openai_agents import function_tool, run_agent
from retrysafe.stores import open_store

#: A script: (turn number from 1, tool outputs seen so far) -> the model's output items.
Script = Callable[[int, list[str]], list[Any]]


def tool_call(name: str, arguments: dict[str, Any], call_id: str | None = None) -> Any:
    """A function-tool call item; a fresh call id unless one is given."""
    cid = call_id or f"call_{uuid.uuid4().hex[:12]}"
    return ResponseFunctionToolCall(
        id=f"fc_{cid}",
        call_id=cid,
        type="function_call",
        name=name,
        arguments=json.dumps(arguments),
    )


def say(text: str) -> Any:
    """An assistant message item (the run's final output)."""
    content: list[Any] = [ResponseOutputText(text=text, type="output_text", annotations=[])]
    return ResponseOutputMessage(
        id="msg", type="message", role="assistant", status="completed", content=content
    )


class ScriptedModel(Model):
    """The SDK's model interface, answered by a script; records what each turn saw."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.turns = 0
        self.outputs: list[str] = []  # every tool output the model was given, in order
        self.call_ids: list[str] = []  # every call id it emitted
        self.tools: list[Any] = []  # the tools of the last turn, as the SDK passed them

    def _next(self, input: str | list[Any], tools: list[Any]) -> list[Any]:
        self.turns += 1
        self.tools = list(tools)
        items = input if isinstance(input, list) else []
        self.outputs = [
            str(i["output"])
            for i in items
            if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        out = self.script(self.turns, self.outputs)
        self.call_ids += [o.call_id for o in out if isinstance(o, ResponseFunctionToolCall)]
        return out

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        **kwargs: Any,
    ) -> ModelResponse:
        return ModelResponse(output=self._next(input, tools), usage=Usage(), response_id=None)

    async def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[Any],
        model_settings: Any,
        tools: list[Any],
        output_schema: Any,
        handoffs: list[Any],
        tracing: Any,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        response = Response(
            id="resp",
            created_at=0,
            model="scripted",
            object="response",
            output=self._next(input, tools),
            tool_choice="auto",
            tools=[],
            parallel_tool_calls=True,
            status="completed",
        )
        yield ResponseCompletedEvent(
            type="response.completed", response=response, sequence_number=0
        )


def create_then_answer(title: str) -> Script:
    """Turn 1: create the ticket; then answer with the last tool output."""

    def script(turn: int, outputs: list[str]) -> list[Any]:
        if turn == 1:
            return [tool_call("create_ticket", {"title": title})]
        return [say(outputs[-1])]

    return script


def main() -> None:
    store_url, url, run_id, phase = sys.argv[1:5]
    agents.set_tracing_disabled(True)
    client = instrument(httpx.Client(timeout=5))

    @tool(kind="write", attempts=8, wait_initial=0.05, wait_max=0.2)
    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket."""
        r = client.post(f"{url}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    if phase == "resume":
        sys.stdin.readline()  # started early (the imports take seconds): wait for "go"
    store = open_store(store_url)
    if phase == "start":
        run = start_run(store, run_id)
    else:
        run = resume_run(store, run_id, retry_unknown=True)
    model = ScriptedModel(create_then_answer("kill me"))
    agent = Agent(name="support", model=model, tools=[function_tool(create_ticket)])
    asyncio.run(run_agent(agent, "my printer is on fire", run=run, step=1))
    print(json.dumps({"outputs": model.outputs, "call_ids": model.call_ids}), flush=True)


if __name__ == "__main__":
    main()
