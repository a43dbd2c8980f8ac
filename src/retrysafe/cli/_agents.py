"""``retrysafe agents runs|calls``: the agent audit log (SPEC §7).

Tables by default, ``--json`` for scripts; errors are one ``retrysafe: error: …`` line and the
exit codes of docs/cli.md: 1 for an unknown run id or a store that failed, 2 for bad input (a
store that does not exist, a malformed run id). Both commands only read: a SQLite store is
opened read-only and a PostgreSQL one without creating tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import click

from retrysafe._exceptions import ConfigurationError
from retrysafe.agents._models import AgentCall, AgentRunRecord, AgentStore
from retrysafe.agents._store import agent_store
from retrysafe.cli._common import (
    SQL_STORES,
    StrParamType,
    epilog,
    errors,
    fail,
    json_option,
    opened_store,
    plain_table,
    print_table,
    shown_value,
    store_option,
)

__all__ = ["agents"]


class RunId(StrParamType):
    """An agent run id: 1–255 visible ASCII characters (SPEC §2)."""

    name = "run_id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from retrysafe.agents._keys import check_id

        try:
            return check_id(value, "run id")
        except ConfigurationError:
            self.fail(
                f"{shown_value(value, 60)} is not a run id (1–255 visible ASCII characters)",
                param,
                ctx,
            )


@contextmanager
def _store(url: str) -> Iterator[AgentStore]:
    """The store's agent store, opened read-only: listing never creates or changes it."""
    with errors(url), opened_store(url, write=False) as store:
        yield agent_store(store)


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, sort_keys=True))


def _run_dict(r: AgentRunRecord) -> dict[str, Any]:
    return asdict(r)


def _call_dict(c: AgentCall) -> dict[str, Any]:
    """The call for ``--json``: ``arguments`` and ``result`` as JSON values, not JSON text."""
    d = asdict(c)
    d["state"] = c.state.value
    d["arguments"] = c.arguments
    d["result"] = c.result
    for name in ("arguments_json", "result_json", "owner", "fencing_token", "lease_expires_at"):
        d.pop(name)
    return d


def _short_key(key: str) -> str:
    """``agent-3f2a9c…9e1b7d04``: enough to tell keys apart in an 80-column table."""
    return key if len(key) <= 21 else f"{key[:12]}…{key[-8:]}"


def _short_tool(name: str, width: int = 20) -> str:
    """The end of a long tool name (``…ls>.create_ticket``): qualnames differ at the end."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]


@click.group(epilog=epilog())
def agents() -> None:
    """Agent runs and their tool calls (the audit log)."""


@agents.command("runs", epilog=epilog())
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1, max=1_000_000))
@json_option
def runs(store: str, limit: int, as_json: bool) -> None:
    """List agent runs, newest first, with their budgets and call counts."""
    with _store(store) as s:
        records = s.list_agent_runs(limit=limit)
    if as_json:
        _emit([_run_dict(r) for r in records])
        return
    table = plain_table(title="agent runs")
    table.add_column("run id", no_wrap=True)
    for col in ("state", "calls", "unknown", "max steps", "max attempts", "created", "reason"):
        table.add_column(col, overflow="fold")
    for r in records:
        table.add_row(
            r.id,
            r.state,
            str(r.calls),
            str(r.unknown),
            "" if r.max_steps is None else str(r.max_steps),
            "" if r.max_attempts is None else str(r.max_attempts),
            _when(r.created_at),
            r.reason or "",
        )
    print_table(table)


@agents.command("calls", epilog=epilog("(no such run);"))
@click.argument("run_id", type=RunId())
@store_option(schemes=SQL_STORES, with_schema=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (full keys).")
@click.option("--wide", is_flag=True, help="Show full keys in the table.")
def calls(run_id: str, store: str, as_json: bool, wide: bool) -> None:
    """List RUN_ID's logical tool calls: one row per call, its key, state and result.

    The table shortens keys (first 12 and last 8 characters); ``--wide`` or ``--json``
    shows them in full.
    """
    with _store(store) as s:
        if s.get_agent_run(run_id) is None:
            from retrysafe.stores._url_check import redact_url

            fail(f"no agent run {run_id!r} in {redact_url(store)}")
        rows = s.list_agent_calls(run_id)
    if as_json:
        _emit([_call_dict(c) for c in rows])
        return
    from rich import box

    # Fits 80 columns: no rules between columns, a shortened key, short columns that never
    # wrap; only the result wraps. --wide adds the full key, kind, arguments hash and times.
    table = plain_table(title=f"calls of agent run {run_id}", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("tool", no_wrap=True)
    if wide:
        table.add_column("kind", no_wrap=True)
    table.add_column("state", no_wrap=True, min_width=9)
    table.add_column("att", justify="right", no_wrap=True)
    table.add_column("key", no_wrap=True, min_width=21)
    table.add_column("result / error", overflow="fold", min_width=12)
    if wide:
        table.add_column("args hash", no_wrap=True, overflow="ellipsis")
        table.add_column("created", no_wrap=True, overflow="ellipsis")
        table.add_column("finished", no_wrap=True, overflow="ellipsis")
    for c in rows:
        cells = [str(c.step), c.tool if wide else _short_tool(c.tool)]
        cells += [c.kind] if wide else []
        cells += [
            c.state.value,
            str(c.attempts),
            c.key if wide else _short_key(c.key),
            c.error or c.result_summary or "",
        ]
        if wide:
            cells += [c.arguments_hash[:16], _when(c.created_at), _when(c.finished_at)]
        table.add_row(*cells)
    print_table(table)
