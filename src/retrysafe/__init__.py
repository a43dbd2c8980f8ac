"""retrysafe: make side-effecting calls safe to retry across networks that lose answers.

The public door. Importing it loads only the exceptions; every other name is imported on
first use (never psycopg, redis or a web framework unless a store or a framework asks).
"""

import importlib
from typing import TYPE_CHECKING, Any

from retrysafe._exceptions import (
    AgentError,
    BudgetExceededError,
    CallIdReusedError,
    ConfigurationError,
    DamagedJobError,
    InvalidKeyError,
    JobError,
    JobNotFoundError,
    NoActiveRunError,
    OutcomeUnknownError,
    PayloadError,
    RetrysafeError,
    RetrysafeWarning,
    RunNotFoundError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
    SubmitOutcomeUnknownError,
    ToolCallFailedError,
    ToolSignatureError,
    WebhookError,
    WebhookIdReusedError,
    WebhookVerificationError,
)

if TYPE_CHECKING:
    from retrysafe._logging import logging_config
    from retrysafe.agents import AgentRun, resume_run, start_run
    from retrysafe.chaos import ChaosProxy, EffectLedger
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
    from retrysafe.server import (
        IdempotencyConfig,
        IdempotencyMiddleware,
        WSGIIdempotencyMiddleware,
    )
    from retrysafe.stores import MemoryStore, SQLiteStore, open_store
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
    "SubmitOutcomeUnknownError",
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


# Where each name of the door lives: a name is imported on first use and then kept, so
# ``import retrysafe`` costs its exceptions alone (a command line starts, and handles Ctrl-C,
# a fifth of a second sooner) and the chaos harness, the agents and webhooks load only when
# asked for.
_HOMES: dict[str, str] = {
    "logging_config": "retrysafe._logging",
    **dict.fromkeys(("AgentRun", "resume_run", "start_run"), "retrysafe.agents"),
    **dict.fromkeys(("ChaosProxy", "EffectLedger"), "retrysafe.chaos"),
    **dict.fromkeys(
        (
            "AsyncOutbox",
            "Job",
            "JobState",
            "Outbox",
            "RetryBudget",
            "RetryPolicy",
            "Worker",
            "WorkerStats",
            "reconcile",
        ),
        "retrysafe.client",
    ),
    **dict.fromkeys(
        ("IdempotencyConfig", "IdempotencyMiddleware", "WSGIIdempotencyMiddleware"),
        "retrysafe.server",
    ),
    **dict.fromkeys(("MemoryStore", "SQLiteStore", "open_store"), "retrysafe.stores"),
    **dict.fromkeys(("Webhooks", "WebhookVerifier"), "retrysafe.webhooks"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'retrysafe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
