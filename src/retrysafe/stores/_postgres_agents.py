"""The agent half of :class:`~retrysafe.stores.PostgresStore` (SPEC §7).

Agent runs and their logical tool calls (the audit log), with the tables and semantics of the
SQLite version (:mod:`retrysafe.stores._sqlite_agents`). A call is claimed in one transaction
that first locks its run's row (``SELECT … FOR UPDATE``: the claims of one run are serialised,
as SQLite's ``BEGIN IMMEDIATE`` serialises them), then checks the key, the tool's signature and
the step budget and inserts the row with ``INSERT … ON CONFLICT DO NOTHING RETURNING`` — so the
key is durable before the first attempt and two claimants of the same call never both win.
Every later write is one statement fenced by the call's fencing token. Statements live in
``sql/postgres.sql``.

Clock: the agent layer computes every time on its own clock (``now``, ``lease_expires_at``)
and compares leases itself, so agent rows store those times as given whatever the store's
``clock`` (a lease written on the server's clock and read against the caller's would mix two
clocks).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from retrysafe.agents._models import AgentCall, AgentCallState, AgentRunRecord
from retrysafe.stores._sql import queries
from retrysafe.stores._sqlite_agents import _row_to_call, _row_to_run

__all__ = ["PostgresAgentsMixin"]

_T = TypeVar("_T")
# bytes: psycopg accepts them as queries, and they are not LiteralString-checked.
_Q: dict[str, bytes] = {name: q.encode() for name, q in queries("postgres").items()}

_Conn = psycopg.Connection[Any]


def _get_call(c: _Conn, key: str) -> AgentCall | None:
    row = c.execute(_Q["get_agent_call"], {"key": key}).fetchone()
    return None if row is None else _row_to_call(row)


def _insert_call(c: _Conn, call: AgentCall, now: float) -> AgentCall | None:
    """Insert ``call`` if its key is absent; the stored row, or None when the key existed."""
    finished = None if call.state is AgentCallState.RUNNING else now
    row = c.execute(
        _Q["insert_agent_call"],
        {
            "key": call.key,
            "run_id": call.run_id,
            "step": call.step,
            "tool": call.tool,
            "kind": call.kind,
            "signature": call.signature,
            "arguments_hash": call.arguments_hash,
            "arguments": call.arguments_json,
            "state": call.state.value,
            "owner": call.owner,
            "lease_expires_at": call.lease_expires_at,
            "error": call.error,
            "now": now,
            "finished_at": finished,
        },
    ).fetchone()
    return None if row is None else _row_to_call(row)


def _claim(c: _Conn, call: AgentCall, max_steps: int | None, now: float) -> tuple[str, AgentCall]:
    with c.transaction():
        c.execute(_Q["lock_agent_run"], {"run_id": call.run_id})
        existing = _get_call(c, call.key)
        if existing is not None:
            return "existing", existing
        other = c.execute(
            _Q["agent_signature_conflict"],
            {"run_id": call.run_id, "tool": call.tool, "signature": call.signature},
        ).fetchone()
        conflict = None if other is None else _get_call(c, other[0])
        if conflict is not None:
            return "conflict", conflict
        counted = c.execute(_Q["count_agent_calls"], {"run_id": call.run_id}).fetchone()
        count = 0 if counted is None else int(counted[0])
        if max_steps is not None and count >= max_steps:
            reason = f"step budget exhausted: {count} of {max_steps} logical calls used"
            refused = AgentCall(
                key=call.key,
                run_id=call.run_id,
                step=call.step,
                tool=call.tool,
                kind=call.kind,
                signature=call.signature,
                arguments_hash=call.arguments_hash,
                arguments_json=call.arguments_json,
                state=AgentCallState.REFUSED,
                owner=call.owner,
                lease_expires_at=now,
                error=reason,
                created_at=now,
                updated_at=now,
                finished_at=now,
            )
            stored = _insert_call(c, refused, now)
            if stored is None:  # only a claimant outside the run lock could have won
                raced = _get_call(c, call.key)
                assert raced is not None
                return "existing", raced
            c.execute(_Q["stop_agent_run"], {"id": call.run_id, "reason": reason, "now": now})
            return "refused", refused
        stored = _insert_call(c, call, now)
        if stored is None:
            raced = _get_call(c, call.key)
            assert raced is not None
            return "existing", raced
        return "claimed", stored


class PostgresAgentsMixin:
    """:class:`~retrysafe.stores.AgentStore` on PostgreSQL; mixed into ``PostgresStore``."""

    if TYPE_CHECKING:

        def _conn(self) -> AbstractContextManager[_Conn]: ...

    def _arun(self, fn: Callable[[_Conn], _T]) -> _T:
        with self._conn() as c:
            return fn(c)

    def create_agent_run(
        self, run_id: str, *, max_steps: int | None, max_attempts: int | None, now: float
    ) -> tuple[bool, AgentRunRecord]:
        params = {"id": run_id, "max_steps": max_steps, "max_attempts": max_attempts, "now": now}

        def op(c: _Conn) -> tuple[bool, AgentRunRecord]:
            row = c.execute(_Q["insert_agent_run"], params).fetchone()
            if row is not None:
                return True, _row_to_run(row)
            existing = c.execute(_Q["get_agent_run"], {"id": run_id}).fetchone()
            assert existing is not None  # runs are never deleted by the store
            return False, _row_to_run(existing)

        return self._arun(op)

    def get_agent_run(self, run_id: str) -> AgentRunRecord | None:
        row = self._arun(lambda c: c.execute(_Q["get_agent_run"], {"id": run_id}).fetchone())
        return None if row is None else _row_to_run(row)

    def list_agent_runs(self, *, limit: int = 100) -> list[AgentRunRecord]:
        rows = self._arun(lambda c: c.execute(_Q["list_agent_runs"], {"limit": limit}).fetchall())
        return [_row_to_run(r) for r in rows]

    def stop_agent_run(self, run_id: str, *, reason: str, now: float) -> None:
        params = {"id": run_id, "reason": reason, "now": now}
        self._arun(lambda c: c.execute(_Q["stop_agent_run"], params))

    def claim_agent_call(
        self, call: AgentCall, *, max_steps: int | None, now: float
    ) -> tuple[str, AgentCall]:
        return self._arun(lambda c: _claim(c, call, max_steps, now))

    def take_over_agent_call(
        self,
        key: str,
        fencing_token: int,
        *,
        owner: str,
        lease_expires_at: float,
        now: float,
        allow_unknown: bool,
    ) -> int | None:
        params = {
            "key": key,
            "token": fencing_token,
            "owner": owner,
            "lease_expires_at": lease_expires_at,
            "now": now,
            "allow_unknown": allow_unknown,
        }
        row = self._arun(lambda c: c.execute(_Q["take_over_agent_call"], params).fetchone())
        return None if row is None else int(row[0])

    def start_agent_attempt(
        self, key: str, fencing_token: int, *, lease_expires_at: float, now: float
    ) -> int | None:
        params = {"key": key, "token": fencing_token, "lease_expires_at": lease_expires_at}
        params["now"] = now
        row = self._arun(lambda c: c.execute(_Q["start_agent_attempt"], params).fetchone())
        return None if row is None else int(row[0])

    def extend_agent_call_lease(
        self, key: str, fencing_token: int, *, lease_expires_at: float
    ) -> bool:
        params = {"key": key, "token": fencing_token, "lease_expires_at": lease_expires_at}
        n: int = self._arun(lambda c: c.execute(_Q["extend_agent_call_lease"], params).rowcount)
        return n == 1

    def finish_agent_call(
        self,
        key: str,
        fencing_token: int,
        *,
        state: AgentCallState,
        result: str | None,
        result_summary: str | None,
        error: str | None,
        now: float,
    ) -> bool:
        params = {
            "key": key,
            "token": fencing_token,
            "state": state.value,
            "result": result,
            "result_summary": result_summary,
            "error": error,
            "now": now,
        }
        n: int = self._arun(lambda c: c.execute(_Q["finish_agent_call"], params).rowcount)
        return n == 1

    def interrupt_agent_calls(self, run_id: str, *, now: float) -> int:
        params = {"run_id": run_id, "now": now}
        n: int = self._arun(lambda c: c.execute(_Q["interrupt_agent_calls"], params).rowcount)
        return n

    def get_agent_call(self, key: str) -> AgentCall | None:
        return self._arun(lambda c: _get_call(c, key))

    def list_agent_calls(self, run_id: str) -> list[AgentCall]:
        rows = self._arun(
            lambda c: c.execute(_Q["list_agent_calls"], {"run_id": run_id}).fetchall()
        )
        return [_row_to_call(r) for r in rows]
