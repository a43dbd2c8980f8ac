"""The agent half of :class:`~retrysafe.stores.SQLiteStore` (SPEC §7).

Agent runs and their logical tool calls (the audit log). A call is claimed in one
``BEGIN IMMEDIATE`` … ``COMMIT`` that checks the key, the tool's signature and the step budget
and inserts the row, so the key is durable before the first attempt and two claimants of the
same call never both win. Statements live in ``sql/sqlite.sql``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from retrysafe.agents._models import AgentCall, AgentCallState, AgentRunRecord
from retrysafe.stores._sql import queries

__all__ = ["SQLiteAgentsMixin"]

_T = TypeVar("_T")
_Q = queries("sqlite")


def _row_to_run(row: Sequence[Any]) -> AgentRunRecord:
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


def _row_to_call(row: Sequence[Any]) -> AgentCall:
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


def _get_call(c: sqlite3.Connection, key: str) -> AgentCall | None:
    row = c.execute(_Q["get_agent_call"], {"key": key}).fetchone()
    return None if row is None else _row_to_call(row)


def _insert_call(c: sqlite3.Connection, call: AgentCall, now: float) -> None:
    finished = None if call.state is AgentCallState.RUNNING else now
    c.execute(
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
    )


def _claim(
    c: sqlite3.Connection, call: AgentCall, max_steps: int | None, now: float
) -> tuple[str, AgentCall]:
    c.execute("BEGIN IMMEDIATE")
    try:
        existing = _get_call(c, call.key)
        if existing is not None:
            outcome: tuple[str, AgentCall] = ("existing", existing)
        else:
            other = c.execute(
                _Q["agent_signature_conflict"],
                {"run_id": call.run_id, "tool": call.tool, "signature": call.signature},
            ).fetchone()
            conflict = None if other is None else _get_call(c, other[0])
            if conflict is not None:
                outcome = ("conflict", conflict)
            else:
                count = int(
                    c.execute(_Q["count_agent_calls"], {"run_id": call.run_id}).fetchone()[0]
                )
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
                    _insert_call(c, refused, now)
                    c.execute(
                        _Q["stop_agent_run"], {"id": call.run_id, "reason": reason, "now": now}
                    )
                    outcome = ("refused", refused)
                else:
                    _insert_call(c, call, now)
                    stored = _get_call(c, call.key)
                    assert stored is not None
                    outcome = ("claimed", stored)
        c.execute("COMMIT")
    except BaseException:
        if c.in_transaction:
            c.execute("ROLLBACK")
        raise
    return outcome


class SQLiteAgentsMixin:
    """:class:`~retrysafe.stores.AgentStore` on SQLite; mixed into ``SQLiteStore``."""

    if TYPE_CHECKING:

        def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T: ...

    def _arun(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        return self.run(fn)

    def create_agent_run(
        self, run_id: str, *, max_steps: int | None, max_attempts: int | None, now: float
    ) -> tuple[bool, AgentRunRecord]:
        params = {"id": run_id, "max_steps": max_steps, "max_attempts": max_attempts, "now": now}

        def op(c: sqlite3.Connection) -> tuple[bool, AgentRunRecord]:
            row = c.execute(_Q["insert_agent_run"], params).fetchone()
            if row is not None:
                return True, _row_to_run(row)
            existing = c.execute(_Q["get_agent_run"], {"id": run_id}).fetchone()
            return False, _row_to_run(existing)

        return self._arun(op)

    def get_agent_run(self, run_id: str) -> AgentRunRecord | None:
        row = self._arun(lambda c: c.execute(_Q["get_agent_run"], {"id": run_id}).fetchone())
        return None if row is None else _row_to_run(row)

    def list_agent_runs(self, *, limit: int = 100) -> list[AgentRunRecord]:
        rows = self._arun(lambda c: c.execute(_Q["list_agent_runs"], {"limit": limit}).fetchall())
        return [_row_to_run(r) for r in rows]

    def stop_agent_run(self, run_id: str, *, reason: str, now: float) -> None:
        self._arun(
            lambda c: c.execute(_Q["stop_agent_run"], {"id": run_id, "reason": reason, "now": now})
        )

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
            "allow_unknown": 1 if allow_unknown else 0,
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
