"""The OpenAI Agents SDK with retrysafe tools (``pip install 'retrysafe[openai-agents]'``).

A ticket service, protected by retrysafe's idempotency middleware, sits behind a chaos proxy
that commits the first ticket and then loses the answer. The model is scripted (the SDK's
``Model`` interface, no network, no API key): it asks to create the ticket, and on the next
turn asks again with a new tool-call id, as models do when an answer went missing.

- naive: the plain ``agents.function_tool``: the lost answer is an error, the model asks
  again, and a second ticket is created;
- guarded: ``retrysafe.agents.openai_agents.function_tool`` over a ``@tool(kind="write")``
  function, run with ``run_agent(..., run=run, step=1)``: the lost answer is retried with the
  same key (the service replays it), and the second request, with another call id, is the
  same logical call (same run, step and arguments), so its recorded result is returned.

    python examples/openai_agents_tickets.py     # exits 0 when guarded created 1 ticket
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import agents
import httpx
from agents import Agent, Model, ModelResponse, Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from retrysafe._serving import ServerThread
from retrysafe.agents import instrument, start_run, tool
from retrysafe.agents.openai_agents import function_tool, run_agent
from retrysafe.chaos import ChaosProxy, EffectLedger, FaultRates
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore


class ScriptedModel(Model):
    """Turn 1 and 2: create the ticket (a new call id each time); turn 3: answer."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        outputs = [i["output"] for i in input if i.get("type") == "function_call_output"]
        if len(outputs) < 2:
            call_id = f"call_{uuid.uuid4().hex[:8]}"
            arguments = json.dumps({"title": "printer on fire"})
            item: Any = ResponseFunctionToolCall(
                id=call_id, call_id=call_id, type="function_call", name="create_ticket",
                arguments=arguments,
            )  # fmt: skip
        else:
            text = ResponseOutputText(
                text=f"tool said: {outputs}", type="output_text", annotations=[]
            )
            item = ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed", content=[text]
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("this demo runs Runner.run, not run_streamed")


def ticket_service(ledger: EffectLedger) -> Any:
    """A bare ASGI app: POST /tickets creates a ticket."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        title = json.loads(body)["title"]
        ledger.record(title)
        data = json.dumps({"id": f"T-{ledger.total()}", "title": title}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def create_ticket_via(client: httpx.Client, base: str) -> Any:
    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket.

        Args:
            title: what is wrong, in a few words.
        """
        r = client.post(f"{base}/tickets", json={"title": title})
        r.raise_for_status()
        ticket: dict[str, Any] = r.json()
        return ticket

    return create_ticket


async def demo(mode: str, tmp: Path) -> int:
    """Run the scripted agent once; the number of tickets the service created."""
    ledger = EffectLedger()
    keys = SQLiteStore(tmp / f"{mode}-keys.db")
    with ServerThread(IdempotencyMiddleware(ticket_service(ledger), store=keys)) as server:
        holder: list[ChaosProxy] = []

        def heal(record: dict[str, Any]) -> None:
            holder[0].heal()  # lose the first answer only

        proxy = ChaosProxy(server.url, rates=FaultRates(lose_after_commit=1.0), on_record=heal)
        holder.append(proxy)
        with proxy, instrument(httpx.Client(timeout=5)) as client:
            plain = create_ticket_via(client, proxy.url)
            if mode == "naive":
                agent = Agent(
                    name="support", model=ScriptedModel(), tools=[agents.function_tool(plain)]
                )
                result = await agents.Runner.run(agent, "my printer is on fire")
            else:
                guarded = tool(kind="write", name="create_ticket", attempts=3, wait_initial=0.05)(
                    plain
                )
                agent = Agent(name="support", model=ScriptedModel(), tools=[function_tool(guarded)])
                with SQLiteStore(tmp / "agent.db") as store:
                    run = start_run(store, "support-42")
                    result = await run_agent(agent, "my printer is on fire", run=run, step=1)
                    for c in run.calls():
                        print(f"  call: step {c.step} {c.tool} {c.state.value} {c.key[:18]}…")
            print(f"  {result.final_output}")
    keys.close()
    return ledger.total()


def main() -> int:
    agents.set_tracing_disabled(True)  # nothing to export: no API key, no network
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("naive", "guarded"):
            print(f"{mode}:")
            counts[mode] = asyncio.run(demo(mode, Path(tmp)))
            print(f"{mode:7}: tickets created = {counts[mode]}")
    return 0 if counts == {"naive": 2, "guarded": 1} else 1


if __name__ == "__main__":
    sys.exit(main())
