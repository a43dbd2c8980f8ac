"""retrysafe: make side-effecting calls safe to retry across networks that lose answers.

The public door. Importing it never imports psycopg, redis or a web framework.
"""

from typing import TYPE_CHECKING, Any

from retrysafe._exceptions import (
    ConfigurationError,
    DamagedJobError,
    InvalidKeyError,
    JobError,
    JobNotFoundError,
    PayloadError,
    RetrysafeError,
    RetrysafeWarning,
    SchemaError,
    StoreError,
    StoreUnavailableError,
    WebhookError,
    WebhookIdReusedError,
    WebhookVerificationError,
)
from retrysafe._logging import logging_config
from retrysafe.client import (
    AsyncOutbox,
    Job,
    JobState,
    Outbox,
    RetryBudget,
    RetryPolicy,
    Worker,
    WorkerStats,
    reconcile,
)
from retrysafe.server import IdempotencyConfig, IdempotencyMiddleware, WSGIIdempotencyMiddleware
from retrysafe.stores import MemoryStore, SQLiteStore, open_store

if TYPE_CHECKING:
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
    from retrysafe.agents import AgentRun, resume_run, start_run
    from retrysafe.chaos import ChaosProxy, EffectLedger
    from retrysafe.webhooks import Webhooks, WebhookVerifier

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "AgentRun",
    "AsyncOutbox",
    "BudgetExceededError",
    "CallIdReusedError",
    "ChaosProxy",
    "ConfigurationError",
    "DamagedJobError",
    "EffectLedger",
    "IdempotencyConfig",
    "IdempotencyMiddleware",
    "InvalidKeyError",
    "Job",
    "JobError",
    "JobNotFoundError",
    "JobState",
    "MemoryStore",
    "NoActiveRunError",
    "Outbox",
    "OutcomeUnknownError",
    "PayloadError",
    "RetryBudget",
    "RetryPolicy",
    "RetrysafeError",
    "RetrysafeWarning",
    "RunNotFoundError",
    "SQLiteStore",
    "SchemaError",
    "StoreError",
    "StoreUnavailableError",
    "ToolCallFailedError",
    "ToolSignatureError",
    "WSGIIdempotencyMiddleware",
    "WebhookError",
    "WebhookIdReusedError",
    "WebhookVerificationError",
    "WebhookVerifier",
    "Webhooks",
    "Worker",
    "WorkerStats",
    "__version__",
    "logging_config",
    "open_store",
    "reconcile",
    "resume_run",
    "start_run",
]


_AGENTS = frozenset(
    {
        "AgentError",
        "AgentRun",
        "BudgetExceededError",
        "CallIdReusedError",
        "NoActiveRunError",
        "OutcomeUnknownError",
        "RunNotFoundError",
        "ToolCallFailedError",
        "ToolSignatureError",
        "resume_run",
        "start_run",
    }
)


def __getattr__(name: str) -> Any:
    # The chaos harness (h11, the proxy) loads only when asked for.
    if name in ("ChaosProxy", "EffectLedger"):
        from retrysafe import chaos

        return getattr(chaos, name)
    if name in _AGENTS:
        # Agent tool calls load only when asked for.
        from retrysafe import agents

        return getattr(agents, name)
    if name in ("Webhooks", "WebhookVerifier"):
        from retrysafe import webhooks

        return getattr(webhooks, name)
    raise AttributeError(f"module 'retrysafe' has no attribute {name!r}")
