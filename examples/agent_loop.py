"""A scripted agent loop in plain Python (no model): naive vs guarded tool calls.

A ticket service, protected by retrysafe's idempotency middleware, sits behind a chaos proxy
that commits the first ticket and then loses the answer. The "model" is a script: it asks to
create one ticket, emits the same call twice in one step, and then retries the step as agents
do. The naive loop retries blindly; the guarded loop declares the tool with ``@tool``.

    python examples/agent_loop.py          # exits 0 when the guarded loop created 1 ticket
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from retrysafe._serving import ServerThread
from retrysafe.agents import instrument, start_run, tool
from retrysafe.chaos import ChaosProxy, EffectLedger, FaultRates
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore

#: What the scripted model asks for: (step, [(tool, arguments), …]) in order.
SCRIPT: list[tuple[int, list[tuple[str, dict[str, Any]]]]] = [
    (1, [("create_ticket", {"title": "printer on fire"})] * 2),  # the same call emitted twice
    (1, [("create_ticket", {"title": "printer on fire"})]),  # step 1 retried after an error
    (2, [("search_tickets", {})]),
]


def ticket_service(ledger: EffectLedger) -> Any:
    """A bare ASGI app: POST /tickets creates a ticket, GET /tickets lists them."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "POST":
            title = json.loads(body)["title"]
            ledger.record(title)
            status, payload = 201, {"id": f"T-{ledger.total()}", "title": title}
        else:
            status, payload = 200, {"tickets": [e.operation_id for e in ledger.effects()]}
        data = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def make_tools(client: httpx.Client, base: str) -> dict[str, Any]:
    """The agent's tools: plain functions, declared read or write."""

    @tool(kind="read", attempts=3, wait_initial=0.01)
    def search_tickets() -> list[str]:
        """List the existing tickets' titles."""
        tickets: list[str] = client.get(f"{base}/tickets").json()["tickets"]
        return tickets

    @tool(kind="write", attempts=3, wait_initial=0.01)
    def create_ticket(title: str) -> dict[str, Any]:
        """Create a support ticket."""
        r = client.post(f"{base}/tickets", json={"title": title})
        r.raise_for_status()
        ticket: dict[str, Any] = r.json()
        return ticket

    return {"search_tickets": search_tickets, "create_ticket": create_ticket}


def naive_loop(client: httpx.Client, base: str) -> None:
    """What many agents do: call the HTTP API, retry any error, no key, no memory."""
    for _step, calls in SCRIPT:
        for name, args in calls:
            for _ in range(3):
                try:
                    if name == "create_ticket":
                        client.post(f"{base}/tickets", json=args).raise_for_status()
                    else:
                        client.get(f"{base}/tickets").raise_for_status()
                    break
                except httpx.TransportError:
                    continue


def guarded_loop(store: SQLiteStore, tools: dict[str, Any]) -> list[Any]:
    """The same script through retrysafe tools inside an agent run."""
    results = []
    with start_run(store, max_steps=10) as run:
        for step, calls in SCRIPT:
            with run.step(step):
                results.extend(tools[name](**args) for name, args in calls)
    return results


def _heal_after_post(holder: list[ChaosProxy]) -> Any:
    def on_record(record: dict[str, Any]) -> None:
        if record["method"] == "POST":
            holder[0].heal()

    return on_record


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        counts = {}
        for mode in ("naive", "guarded"):
            ledger = EffectLedger()
            keys = SQLiteStore(Path(tmp) / f"{mode}-keys.db")
            app = IdempotencyMiddleware(ticket_service(ledger), store=keys)
            with ServerThread(app) as server:
                # lose the answer to the first POST only (after the service committed)
                holder: list[ChaosProxy] = []
                rates = FaultRates(lose_after_commit=1.0)
                proxy = ChaosProxy(server.url, rates=rates, on_record=_heal_after_post(holder))
                holder.append(proxy)
                with proxy, instrument(httpx.Client(timeout=5)) as client:
                    if mode == "naive":
                        naive_loop(client, proxy.url)
                    else:
                        store = SQLiteStore(Path(tmp) / "agent.db")
                        results = guarded_loop(store, make_tools(client, proxy.url))
                        print("guarded results:", results)
                        store.close()
            keys.close()
            counts[mode] = ledger.total()
            print(f"{mode:8} loop: {ledger.total()} ticket(s) created for 1 request")
    return 0 if counts["guarded"] == 1 and counts["naive"] >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
