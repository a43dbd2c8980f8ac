"""Agent models and the store seam (SPEC §7): runs, logical tool calls (the audit log)
and the :class:`AgentStore` Protocol.

Times are Unix seconds (float).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AgentCall",
    "AgentCallState",
    "AgentRunRecord",
    "AgentStore",
    "StepBudget",
]

#: A run's step budget as a claim applies it: the number of logical calls the run recorded in,
#: the reason to refuse the next one out (None: it may run). See
#: :func:`retrysafe.agents._budget.steps_refusal`.
StepBudget = Callable[[int], str | None]


class AgentCallState(str, enum.Enum):
    """State of one logical agent tool call (SPEC §7).

    ``RUNNING``: claimed, attempts may be in flight. ``SUCCEEDED``: the result is stored and
    replayed to every repeat. ``FAILED``: a definitive error, re-raised to every repeat.
    ``UNKNOWN``: the effect may or may not have happened (attempts exhausted on transport
    errors, or the process running it stopped); repeats report it with the key. ``REFUSED``: a
    budget stopped the call before any attempt.
    """

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRunRecord:
    """One agent run as stored.

    Attributes:
        id: the run id (caller-given or generated).
        state: ``"active"`` or ``"stopped"`` (a budget refused a call; ``reason`` says which).
        max_steps: logical calls allowed in the run (None: unlimited).
        max_attempts: attempts allowed per logical call, over every process (None: unlimited).
        calls: logical calls recorded (refusals excluded); ``unknown``: those in ``UNKNOWN``.
    """

    id: str
    state: str
    max_steps: int | None
    max_attempts: int | None
    reason: str | None
    created_at: float
    updated_at: float
    calls: int = 0
    unknown: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentCall:
    """One logical tool call: a row of the audit log.

    Attributes:
        key: the call's idempotency key (derived from run, tool, step and arguments).
        arguments_json: canonical JSON text of the bound arguments; ``arguments_hash`` its
            SHA-256. :attr:`arguments` is the decoded value.
        signature: hash of the tool's parameters when the call was first recorded.
        result_json: the result as JSON text (None until SUCCEEDED, or when not
            JSON-serialisable). :attr:`result` is the decoded value.
        result_summary: a short human-readable summary (≤ 200 characters).
        fencing_token: proves which claimant may finish the call; ``owner`` names it.
    """

    key: str
    run_id: str
    step: int
    tool: str
    kind: str
    signature: str
    arguments_hash: str
    arguments_json: str
    state: AgentCallState
    attempts: int = 0
    fencing_token: int = 1
    owner: str = ""
    lease_expires_at: float = 0.0
    result_json: str | None = None
    result_summary: str | None = None
    error: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    finished_at: float | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The bound arguments as JSON values (``{parameter: value}``; tuples are lists)."""
        value: dict[str, Any] = json.loads(self.arguments_json)
        return value

    @property
    def result(self) -> Any:
        """The stored result as JSON values (a tuple comes back as a list); None when there
        is none (not SUCCEEDED, or not JSON-serialisable: see ``result_summary``)."""
        return None if self.result_json is None else json.loads(self.result_json)


@runtime_checkable
class AgentStore(Protocol):
    """Agent runs and their calls (SPEC §7). Every method is one atomic store operation.

    Concurrency contract: a claim is one transaction serialised with every other claim of its
    run (two claimants of one call never both win); every later write to a call
    (``take_over_agent_call``, ``start_agent_attempt``, ``extend_agent_call_lease``,
    ``finish_agent_call``) is a compare-and-swap on its fencing token and changes nothing for
    a claimant whose call was taken over. Times are the agent layer's (Unix seconds), stored
    as given: the agent layer compares leases on its own clock. Stores hold no policy: the
    step budget comes in with the claim.
    """

    def create_agent_run(
        self, run_id: str, *, max_steps: int | None, max_attempts: int | None, now: float
    ) -> tuple[bool, AgentRunRecord]:
        """Insert the run if absent. Returns ``(created, record)`` (the existing one if not)."""
        ...

    def get_agent_run(self, run_id: str) -> AgentRunRecord | None: ...

    def list_agent_runs(self, *, limit: int = 100) -> list[AgentRunRecord]:
        """Newest first, with call counts."""
        ...

    def stop_agent_run(self, run_id: str, *, reason: str, now: float) -> None: ...

    def claim_agent_call(
        self,
        call: AgentCall,
        *,
        now: float,
        budget: StepBudget | None = None,
        join_unknown: bool = False,
    ) -> tuple[str, AgentCall]:
        """Insert ``call`` if its key is absent, in one transaction that no other claim of the
        run interleaves with: of concurrent claimants of one key exactly one gets
        ``"claimed"``, and ``budget`` sees a count no concurrent claim changes.

        Args:
            call: the RUNNING call to record (its key, run, tool, signature, arguments, owner,
                lease end); ``now``: the agent layer's time, stored as given.
            budget: the run's step budget: called with the number of logical calls the run
                recorded (refusals excluded), it returns why the call is refused, or None.
                None: no budget (nothing is counted).
            join_unknown: when the key is absent but the run holds an UNKNOWN call of the
                same write tool with the same arguments (an earlier step), return
                ``("existing", that call)`` instead of inserting: its effect may have
                happened, so it is never sent again under a new key (SPEC §0, §7).

        Returns:
            ``("existing", row)`` when the key is recorded already; ``("conflict", row)`` when
            the run recorded this tool under another signature (``row`` is such a call);
            ``("refused", row)`` when ``budget`` refused: the call is recorded as a
            ``REFUSED`` row with the reason as its error, and the run is stopped with that
            reason; else ``("claimed", row)``, the recorded call (fencing token 1).
        """
        ...

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
        """Compare-and-swap a RUNNING call with an expired lease (or, if allowed, an UNKNOWN
        one) back to RUNNING under ``owner``. Returns the new fencing token, or None."""
        ...

    def start_agent_attempt(
        self, key: str, fencing_token: int, *, lease_expires_at: float, now: float
    ) -> int | None:
        """Count one attempt (fenced). Returns the call's attempts, or None if not the owner."""
        ...

    def extend_agent_call_lease(
        self, key: str, fencing_token: int, *, lease_expires_at: float
    ) -> bool:
        """The live claimant's heartbeat: move a RUNNING call's lease end forward to
        ``lease_expires_at`` (Unix seconds on the agent layer's clock; never backward) while it
        runs under exactly ``fencing_token``. True renewed; False otherwise, nothing written
        (taken over, finished, interrupted). An expired lease nobody took over yet is still
        the token's."""
        ...

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
        """Move a RUNNING call to ``state`` (fenced). False if the token is no longer valid."""
        ...

    def interrupt_agent_calls(self, run_id: str, *, now: float) -> int:
        """Move the run's RUNNING calls to UNKNOWN (its process stopped). Returns how many."""
        ...

    def get_agent_call(self, key: str) -> AgentCall | None: ...

    def list_agent_calls(self, run_id: str) -> list[AgentCall]:
        """The run's calls in the order they were recorded."""
        ...
