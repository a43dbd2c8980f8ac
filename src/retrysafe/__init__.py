"""retrysafe: make side-effecting calls safe to retry across networks that lose answers.

The public door. Importing it never imports psycopg, redis or a web framework.
"""

from retrysafe._exceptions import (
    ConfigurationError,
    InvalidKeyError,
    JobError,
    JobNotFoundError,
    PayloadError,
    RetrysafeError,
    SchemaError,
    StoreError,
    StoreUnavailableError,
)
from retrysafe.stores import MemoryStore, SQLiteStore, open_store

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "InvalidKeyError",
    "JobError",
    "JobNotFoundError",
    "MemoryStore",
    "PayloadError",
    "RetrysafeError",
    "SQLiteStore",
    "SchemaError",
    "StoreError",
    "StoreUnavailableError",
    "__version__",
    "open_store",
]
