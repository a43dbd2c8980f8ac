"""The client side: a durable outbox of side-effecting HTTP requests and the worker that
delivers them with one stable idempotency key per job (SPEC §5).

Typical use::

    outbox = Outbox("sqlite:///app.db")
    job = outbox.submit("https://api.example.com/posts", json={"text": "hello"})
    outbox.worker(concurrency=8).run_until_idle()
    outbox.reconcile()            # UNKNOWN jobs: re-send with the same key
    print(outbox.get(job.id).state)

The outbox keeps its jobs in a SQL store (``SQLiteStore``, ``PostgresStore``);
``outbox_store(store)`` is that store's :class:`OutboxStore` (jobs and attempts, one
primitive per method) for code that reads or changes jobs below the :class:`Outbox`.
"""

from retrysafe.client._budget import BudgetState, RetryBudget
from retrysafe.client._models import AsyncOutboxStore, Attempt, Job, JobState, NewJob, OutboxStore
from retrysafe.client._outbox import DEAD_LETTER_STATES, AsyncOutbox, Outbox
from retrysafe.client._policy import RetryPolicy, Step, next_step, reconcile_step
from retrysafe.client._sender import IDEMPOTENCY_KEY_HEADER, SendResult, make_engine, send_attempt
from retrysafe.client._store import outbox_store
from retrysafe.client._worker import ReconcileReport, Worker, WorkerStats, areconcile, reconcile

__all__ = [
    "DEAD_LETTER_STATES",
    "IDEMPOTENCY_KEY_HEADER",
    "AsyncOutbox",
    "AsyncOutboxStore",
    "Attempt",
    "BudgetState",
    "Job",
    "JobState",
    "NewJob",
    "Outbox",
    "OutboxStore",
    "ReconcileReport",
    "RetryBudget",
    "RetryPolicy",
    "SendResult",
    "Step",
    "Worker",
    "WorkerStats",
    "areconcile",
    "make_engine",
    "next_step",
    "outbox_store",
    "reconcile",
    "reconcile_step",
    "send_attempt",
]
