"""retrysafe's one exception tree.

Every error retrysafe raises on purpose derives from :class:`RetrysafeError` and carries
structured attributes instead of information buried in the message::

    RetrysafeError
    ├── ConfigurationError          a value that cannot work (bad URL, timeout <= 0, …)
    ├── InvalidKeyError             an idempotency key that is empty, too long or not visible ASCII
    ├── StoreError                  the store failed; the driver's error is the ``__cause__``
    │   ├── StoreUnavailableError   the store cannot be reached or is locked/read-only
    │   └── SchemaError             the store's schema is missing or from another version
    ├── JobError                    an outbox job cannot be submitted or changed
    │   └── JobNotFoundError        no job with that id
    └── PayloadError                a payload that cannot be serialised to JSON

    RetrysafeWarning (UserWarning)  a configuration that works but is dangerous
                                    (retention shorter than the lease, a worker lease
                                    shorter than twice the request timeout, …)

Driver errors (``sqlite3``, ``psycopg``, ``redis``) are translated to these in one place per
store and always chained with ``raise … from``.
"""

from __future__ import annotations


class RetrysafeError(Exception):
    """Base class of every error retrysafe raises on purpose."""


class ConfigurationError(RetrysafeError, ValueError):
    """A configuration value that cannot work.

    Attributes:
        option: the name of the offending option, e.g. ``"timeout"``.
    """

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class InvalidKeyError(RetrysafeError, ValueError):
    """An idempotency key that breaks SPEC §2 (1–255 visible ASCII characters).

    Attributes:
        key: the raw header value as received (may be truncated to 300 characters).
        reason: a short, client-safe explanation.
    """

    def __init__(self, reason: str, *, key: str) -> None:
        super().__init__(f"invalid idempotency key: {reason}")
        self.key = key[:300]
        self.reason = reason


class StoreError(RetrysafeError):
    """The store failed. The driver's own exception is chained as ``__cause__``.

    Attributes:
        store: a short description of the store, e.g. ``"sqlite:///var/keys.db"``.
    """

    def __init__(self, message: str, *, store: str = "") -> None:
        super().__init__(message)
        self.store = store


class StoreUnavailableError(StoreError):
    """The store cannot serve requests now (unreachable, locked, read-only, disk full).

    Middleware answers ``503 store-unavailable`` with ``Retry-After`` (fail closed, SPEC §3).
    """


class SchemaError(StoreError):
    """The store's schema is missing, or was written by a version retrysafe does not understand."""


class JobError(RetrysafeError):
    """An outbox job cannot be submitted or changed.

    Attributes:
        job_id: the job's id, when one exists.
    """

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class JobNotFoundError(JobError, LookupError):
    """No job with that id exists in the outbox."""


class PayloadError(RetrysafeError, TypeError):
    """A payload that cannot be serialised to JSON.

    Attributes:
        path: where in the payload the bad value sits, e.g. ``"$.items[2]"``.
    """

    def __init__(self, message: str, *, path: str = "$") -> None:
        super().__init__(message)
        self.path = path


class RetrysafeWarning(UserWarning):
    """A configuration that works but is dangerous, e.g. a retention shorter than the lease.

    Turn it into an error in tests with ``-W error::retrysafe.RetrysafeWarning``.
    """
