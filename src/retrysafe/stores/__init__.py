"""Stores: the seams (:class:`KeyStore`, :class:`OutboxStore` and their async faces) and
their implementations.

``SQLiteStore`` is the embedded default; ``MemoryStore`` is for unit tests only (unsafe: a
restart forgets every key). Open any of them from a URL with :func:`open_store`.
"""

from retrysafe.stores._base import (
    AgentCall,
    AgentCallState,
    AgentRunRecord,
    AgentStore,
    AsyncKeyStore,
    AsyncOutboxStore,
    Attempt,
    Job,
    JobState,
    KeyStore,
    NewJob,
    OutboxStore,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    WebhookStore,
)
from retrysafe.stores._memory import MemoryStore
from retrysafe.stores._sqlite import SCHEMA_VERSION, SQLiteStore
from retrysafe.stores._url import as_async_key_store, open_store

__all__ = [
    "SCHEMA_VERSION",
    "AgentCall",
    "AgentCallState",
    "AgentRunRecord",
    "AgentStore",
    "AsyncKeyStore",
    "AsyncOutboxStore",
    "Attempt",
    "Job",
    "JobState",
    "KeyStore",
    "MemoryStore",
    "NewJob",
    "OutboxStore",
    "SQLiteStore",
    "WebhookDelivery",
    "WebhookEndpoint",
    "WebhookEvent",
    "WebhookStore",
    "as_async_key_store",
    "open_store",
]
