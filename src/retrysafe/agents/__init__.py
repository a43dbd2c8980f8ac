"""Safe agent tool calls (SPEC §7).

Declare tools ``read`` or ``write`` with :func:`tool`; run the agent loop inside
:func:`start_run` / :func:`resume_run`. Every write call gets an idempotency key derived from
the run and the logical call, recorded before the first attempt; a repeated call (a retried
step, a resumed run, the model emitting it twice) returns the stored result, and a call whose
outcome is unknown is reported with its key instead of running again. Runs and calls (the
audit log) live in a SQLite or PostgreSQL store: :func:`agent_store` gives a store's
:class:`AgentStore`. See ``docs/agents.md``.
"""

from retrysafe._exceptions import (
    AgentError,
    BudgetExceededError,
    CallIdReusedError,
    NoActiveRunError,
    OutcomeUnknownError,
    RunNotFoundError,
    ToolCallFailedError,
    ToolSignatureError,
)
from retrysafe.agents._httpx import (
    AsyncIdempotencyKeyTransport,
    IdempotencyKeyTransport,
    instrument,
)
from retrysafe.agents._keys import arguments_hash, bind_arguments, call_key, signature_hash
from retrysafe.agents._models import AgentCall, AgentCallState, AgentRunRecord, AgentStore
from retrysafe.agents._run import (
    AgentRun,
    call_id,
    current_call_key,
    current_run,
    resume_run,
    start_run,
)
from retrysafe.agents._store import agent_store
from retrysafe.agents._tools import ToolSpec, is_retryable, tool

__all__ = [
    "AgentCall",
    "AgentCallState",
    "AgentError",
    "AgentRun",
    "AgentRunRecord",
    "AgentStore",
    "AsyncIdempotencyKeyTransport",
    "BudgetExceededError",
    "CallIdReusedError",
    "IdempotencyKeyTransport",
    "NoActiveRunError",
    "OutcomeUnknownError",
    "RunNotFoundError",
    "ToolCallFailedError",
    "ToolSignatureError",
    "ToolSpec",
    "agent_store",
    "arguments_hash",
    "bind_arguments",
    "call_id",
    "call_key",
    "current_call_key",
    "current_run",
    "instrument",
    "is_retryable",
    "resume_run",
    "signature_hash",
    "start_run",
    "tool",
]
