"""The agent store on SQL, written once for SQLite and PostgreSQL (SPEC §7, §9).

Agent runs and their logical tool calls (the audit log). A call is claimed in one transaction
(``atomic=True``) that first locks its run's row — ``SELECT … FOR UPDATE`` on PostgreSQL; on
SQLite the transaction's ``BEGIN IMMEDIATE`` holds the write lock already — so the claims of
one run are serialised: the key check, the signature check, the count the step budget sees and
the insert (``INSERT … ON CONFLICT DO NOTHING RETURNING``) see no concurrent claim of the run,
the key is durable before the first attempt, and two claimants of one call never both win.
Every later write is one statement fenced by the call's token.

Clock: the agent layer computes every time on its own clock (``now``, ``lease_expires_at``) and
compares leases itself, so agent rows store those times as given on both dialects, whatever
the connector's ``clock`` (a lease written on the server's clock and read against the caller's
would mix two clocks). The statements live in ``sql/agents.<dialect>.sql``;
:class:`SQLAgentStore` and :class:`AsyncSQLAgentStore` are the same operations on a sync and an
async :mod:`connector <retrysafe.stores._connector>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retrysafe._exceptions import StoreError
from retrysafe.agents._models import (
    AgentCall,
    AgentCallState,
    AgentRunRecord,
    AgentStore,
    StepBudget,
)
from retrysafe.stores._connector import (
    NEEDS_WRITE,
    Clock,
    NeedsWrite,
    OnAsyncConnector,
    OnConnector,
    Op,
    Statements,
    all_rows,
    async_op,
    count,
    feature_store,
    one,
    sync_op,
)

__all__ = ["AsyncSQLAgentStore", "SQLAgentStore", "agent_store"]

#: The columns every statement returning a row reads, in the order the row converter
#: unpacks them (``{call_columns}`` in the statement files).
CALL_COLUMNS = (
    "idempotency_key",
    "run_id",
    "step",
    "tool",
    "kind",
    "signature",
    "arguments_hash",
    "arguments",
    "state",
    "attempts",
    "fencing_token",
    "owner",
    "lease_expires_at",
    "result",
    "result_summary",
    "error",
    "created_at",
    "updated_at",
    "finished_at",
)

#: The columns every statement returning a row reads, in the order the row converter
#: unpacks them (``{run_columns}`` in the statement files).
RUN_COLUMNS = (
    "id",
    "state",
    "max_steps",
    "max_attempts",
    "reason",
    "created_at",
    "updated_at",
)

_SQL = Statements(
    "retrysafe.agents", "agents", columns={"call_columns": CALL_COLUMNS, "run_columns": RUN_COLUMNS}
)


def run_from_row(row: tuple[Any, ...]) -> AgentRunRecord:
    """An agent run record from a row: the run's columns, then (when listed) its call counts."""
    id_, state, max_steps, max_attempts, reason, created, updated = row[:7]
    calls, unknown = (row[7], row[8]) if len(row) > 7 else (0, 0)
    return AgentRunRecord(
        id=id_,
        state=state,
        max_steps=None if max_steps is None else int(max_steps),
        max_attempts=None if max_attempts is None else int(max_attempts),
        reason=reason,
        created_at=float(created),
        updated_at=float(updated),
        calls=int(calls),
        unknown=int(unknown),
    )


def _call(row: tuple[Any, ...]) -> AgentCall:
    (key, run_id, step, tool, kind, signature, args_hash, arguments, state, attempts) = row[:10]
    token, owner, lease, result, summary, error, created, updated, finished = row[10:]
    return AgentCall(
        key=key,
        run_id=run_id,
        step=int(step),
        tool=tool,
        kind=kind,
        signature=signature,
        arguments_hash=args_hash,
        arguments_json=arguments,
        state=AgentCallState(state),
        attempts=int(attempts),
        fencing_token=int(token),
        owner=owner,
        lease_expires_at=float(lease),
        result_json=result,
        result_summary=summary,
        error=error,
        created_at=float(created),
        updated_at=float(updated),
        finished_at=None if finished is None else float(finished),
    )


def _inserted(call: AgentCall, now: float, *, error: str | None = None) -> Mapping[str, Any]:
    """The parameters of ``insert_agent_call``: ``call`` as RUNNING, or as REFUSED (finished
    at ``now``, its lease ended) when ``error`` gives the refusal."""
    refused = error is not None
    return {
        "key": call.key,
        "run_id": call.run_id,
        "step": call.step,
        "tool": call.tool,
        "kind": call.kind,
        "signature": call.signature,
        "arguments_hash": call.arguments_hash,
        "arguments": call.arguments_json,
        "state": (AgentCallState.REFUSED if refused else AgentCallState.RUNNING).value,
        "owner": call.owner,
        "lease_expires_at": now if refused else call.lease_expires_at,
        "error": error,
        "now": now,
        "finished_at": now if refused else None,
    }


# ---------------------------------------------------------------------- operations
# Every operation takes the connector's clock first (the seam's signature) and ignores it:
# agent times are stored as given (see the module docstring).
def create_agent_run(
    clock: Clock, run_id: str, *, max_steps: int | None, max_attempts: int | None, now: float
) -> Op[tuple[bool, AgentRunRecord]]:
    params = {"id": run_id, "max_steps": max_steps, "max_attempts": max_attempts, "now": now}
    row = yield one(_SQL["insert_agent_run"], params)
    if row is not None:
        return True, run_from_row(row)
    existing = yield one(_SQL["get_agent_run"], params)
    if existing is None:  # runs are never deleted by the store
        raise StoreError(f"agent run {run_id!r} exists but cannot be read")
    return False, run_from_row(existing)


def get_agent_run(clock: Clock, run_id: str) -> Op[AgentRunRecord | None]:
    row = yield one(_SQL["get_agent_run"], {"id": run_id})
    return None if row is None else run_from_row(row)


def list_agent_runs(clock: Clock, *, limit: int = 100) -> Op[list[AgentRunRecord]]:
    rows = yield all_rows(_SQL["list_agent_runs"], {"limit": limit})
    return [run_from_row(r) for r in rows]


def stop_agent_run(clock: Clock, run_id: str, *, reason: str, now: float) -> Op[None]:
    yield count(_SQL["stop_agent_run"], {"id": run_id, "reason": reason, "now": now})


def claim_agent_call(
    clock: Clock,
    call: AgentCall,
    *,
    now: float,
    budget: StepBudget | None = None,
    join_unknown: bool = False,
) -> Op[tuple[str, AgentCall]]:
    """Run atomically (see :meth:`~retrysafe.agents.AgentStore.claim_agent_call`)."""
    yield one(_SQL["lock_agent_run"], {"run_id": call.run_id})
    existing = yield from get_agent_call(clock, call.key)
    if existing is not None:
        return "existing", existing
    other = yield one(
        _SQL["agent_signature_conflict"],
        {"run_id": call.run_id, "tool": call.tool, "signature": call.signature},
    )
    conflict = None if other is None else (yield from get_agent_call(clock, other[0]))
    if conflict is not None:
        return "conflict", conflict
    if join_unknown:
        params = {"run_id": call.run_id, "tool": call.tool, "arguments_hash": call.arguments_hash}
        sibling = yield one(_SQL["unknown_agent_call"], params)
        joined = None if sibling is None else (yield from get_agent_call(clock, sibling[0]))
        if joined is not None:
            return "existing", joined
    reason = None
    if budget is not None:
        (used,) = yield one(_SQL["count_agent_calls"], {"run_id": call.run_id})
        reason = budget(int(used))
    row = yield one(_SQL["insert_agent_call"], _inserted(call, now, error=reason))
    if row is None:  # only a claimant outside the run's lock (no such run) could have won
        raced = yield from get_agent_call(clock, call.key)
        if raced is None:
            raise StoreError(f"claim of agent call {call.key} raced with its deletion")
        return "existing", raced
    if reason is None:
        return "claimed", _call(row)
    yield from stop_agent_run(clock, call.run_id, reason=reason, now=now)
    return "refused", _call(row)


def existing_agent_call(
    clock: Clock,
    call: AgentCall,
    *,
    now: float,
    budget: StepBudget | None = None,
    join_unknown: bool = False,
) -> Op[tuple[str, AgentCall] | NeedsWrite]:
    """The read-only form of :func:`claim_agent_call` (``when_locked``, see
    :class:`~retrysafe.stores._connector.AsyncConnector`): what the async face runs when the
    claim met another process's write lock (SQLite). A call recorded under the key is what
    the claim returns first (``"existing"``), so it is returned as read (a resumed run's
    repeat); anything else is :data:`NEEDS_WRITE`."""
    existing = yield from get_agent_call(clock, call.key)
    return NEEDS_WRITE if existing is None else ("existing", existing)


def take_over_agent_call(
    clock: Clock,
    key: str,
    fencing_token: int,
    *,
    owner: str,
    lease_expires_at: float,
    now: float,
    allow_unknown: bool,
) -> Op[int | None]:
    params = {
        "key": key,
        "token": fencing_token,
        "owner": owner,
        "lease_expires_at": lease_expires_at,
        "now": now,
        "allow_unknown": bool(allow_unknown),
    }
    row = yield one(_SQL["take_over_agent_call"], params)
    return None if row is None else int(row[0])


def start_agent_attempt(
    clock: Clock, key: str, fencing_token: int, *, lease_expires_at: float, now: float
) -> Op[int | None]:
    params = {"key": key, "token": fencing_token, "lease_expires_at": lease_expires_at}
    row = yield one(_SQL["start_agent_attempt"], {**params, "now": now})
    return None if row is None else int(row[0])


def extend_agent_call_lease(
    clock: Clock, key: str, fencing_token: int, *, lease_expires_at: float
) -> Op[bool]:
    params = {"key": key, "token": fencing_token, "lease_expires_at": lease_expires_at}
    changed: int = yield count(_SQL["extend_agent_call_lease"], params)
    return changed == 1


def finish_agent_call(
    clock: Clock,
    key: str,
    fencing_token: int,
    *,
    state: AgentCallState,
    result: str | None,
    result_summary: str | None,
    error: str | None,
    now: float,
) -> Op[bool]:
    params = {
        "key": key,
        "token": fencing_token,
        "state": AgentCallState(state).value,
        "result": result,
        "result_summary": result_summary,
        "error": error,
        "now": now,
    }
    changed: int = yield count(_SQL["finish_agent_call"], params)
    return changed == 1


def interrupt_agent_calls(clock: Clock, run_id: str, *, now: float) -> Op[int]:
    changed: int = yield count(_SQL["interrupt_agent_calls"], {"run_id": run_id, "now": now})
    return changed


def get_agent_call(clock: Clock, key: str) -> Op[AgentCall | None]:
    row = yield one(_SQL["get_agent_call"], {"key": key})
    return None if row is None else _call(row)


def list_agent_calls(clock: Clock, run_id: str) -> Op[list[AgentCall]]:
    rows = yield all_rows(_SQL["list_agent_calls"], {"run_id": run_id})
    return [_call(r) for r in rows]


# ---------------------------------------------------------------------- faces
class SQLAgentStore(OnConnector):
    """:class:`~retrysafe.agents.AgentStore` on a SQL
    :class:`~retrysafe.stores._connector.Connector` (SQLite or PostgreSQL).

    Concurrency contract: see :class:`~retrysafe.agents.AgentStore` and the module docstring.
    The store it was opened on owns the connector: close that store, not this one.
    """

    create_agent_run = sync_op(create_agent_run)
    get_agent_run = sync_op(get_agent_run)
    list_agent_runs = sync_op(list_agent_runs)
    stop_agent_run = sync_op(stop_agent_run)
    claim_agent_call = sync_op(claim_agent_call, atomic=True)
    take_over_agent_call = sync_op(take_over_agent_call)
    start_agent_attempt = sync_op(start_agent_attempt)
    extend_agent_call_lease = sync_op(extend_agent_call_lease)
    finish_agent_call = sync_op(finish_agent_call)
    interrupt_agent_calls = sync_op(interrupt_agent_calls)
    get_agent_call = sync_op(get_agent_call)
    list_agent_calls = sync_op(list_agent_calls)

    def asyncio_agent_store(self) -> AsyncSQLAgentStore:
        """A new async face (its own connection or pool, bound to the event loop that first
        uses it; close it with ``aclose()``)."""
        return AsyncSQLAgentStore(self.connector.async_connector())


class AsyncSQLAgentStore(OnAsyncConnector):
    """The async face of :class:`SQLAgentStore`: the same operations, awaited, on an
    :class:`~retrysafe.stores._connector.AsyncConnector` (never blocking the event loop)."""

    create_agent_run = async_op(create_agent_run)
    get_agent_run = async_op(get_agent_run, skippable=True)
    list_agent_runs = async_op(list_agent_runs, skippable=True)
    stop_agent_run = async_op(stop_agent_run)
    claim_agent_call = async_op(
        claim_agent_call,
        atomic=True,
        skippable=True,
        when_locked=existing_agent_call,
    )
    take_over_agent_call = async_op(take_over_agent_call, skippable=True)
    start_agent_attempt = async_op(start_agent_attempt)
    extend_agent_call_lease = async_op(extend_agent_call_lease)
    finish_agent_call = async_op(finish_agent_call)
    interrupt_agent_calls = async_op(interrupt_agent_calls)
    get_agent_call = async_op(get_agent_call, skippable=True)
    list_agent_calls = async_op(list_agent_calls, skippable=True)


def agent_store(store: object) -> AgentStore:
    """The agent store of ``store``.

    Args:
        store: a :class:`~retrysafe.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore`
            (its runs and calls live in the same database, on its connector), or an object
            that implements :class:`~retrysafe.agents.AgentStore` already (returned as is).

    Raises:
        ConfigurationError: ``store`` cannot hold agent runs (memory, Redis).
    """
    found: AgentStore = feature_store(
        store,
        AgentStore,
        SQLAgentStore,
        "cannot hold agent runs; use a SQLiteStore (sqlite:///path.db) "
        "or a PostgresStore (postgresql://…)",
    )
    return found
