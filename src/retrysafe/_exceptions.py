"""retrysafe's one exception tree.

Every error retrysafe raises on purpose derives from :class:`RetrysafeError` and carries
structured attributes instead of information buried in the message::

    RetrysafeError
    ├── ConfigurationError          a value that cannot work (bad URL, timeout <= 0, …),
    │                               or server.transaction() used outside a claimed request
    │                               or with a store without SQL
    ├── InvalidKeyError             an idempotency key that is empty, too long or not visible ASCII
    ├── StoreError                  the store failed; the driver's error is the ``__cause__``
    │   ├── StoreUnavailableError   the store cannot be reached or is locked/read-only
    │   ├── DamagedJobError         a job's stored row holds values retrysafe never writes
    │   └── SchemaError             the store's schema is missing or from another version
    ├── JobError                    an outbox job cannot be submitted or changed
    │   └── JobNotFoundError        no job with that id
    ├── PayloadError                a payload (or a tool call's argument) that cannot be
    │                               serialised to JSON
    ├── AgentError                  an agent tool call cannot run (SPEC §7)
    │   ├── NoActiveRunError        a write tool called outside an agent run
    │   ├── RunNotFoundError        a resumed run id that does not exist
    │   ├── ToolSignatureError      a tool's signature changed between runs
    │   ├── OutcomeUnknownError     the call's effect may or may not have happened (with key)
    │   ├── ToolCallFailedError     a repeat of a call that failed definitively
    │   ├── CallIdReusedError       an explicit call id reused for another tool or arguments
    │   └── BudgetExceededError     a step or attempt budget stopped the call
    └── WebhookError                webhook delivery or reception failed
        ├── EndpointNotFoundError   no webhook endpoint with that id
        ├── DestinationRefusedError an endpoint resolves to a private, loopback, link-local,
        │                           multicast or reserved address (SSRF guard)
        ├── WebhookVerificationError an incoming webhook's signature, timestamp or headers
        │                           are not valid (Standard Webhooks)
        └── WebhookIdReusedError    an incoming webhook-id already received with another body

    RetrysafeWarning (UserWarning)  a configuration that works but is dangerous
                                    (retention shorter than the lease, a heartbeat
                                    longer than half the lease, …)

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


class SubmitOutcomeUnknownError(StoreUnavailableError):
    """A submission's write went to the store and no answer came back (a timeout, a
    connection lost mid-commit): what it records may be recorded all the same. Submit it
    again with ``key`` — the same request with the same key returns what was stored, or
    records it once; a new key could record it twice (SPEC §2: a timeout is not a failure).

    Attributes:
        key: what to submit again with: the job's idempotency key (``Outbox.submit``,
            ``key=``) or the event's id (``Webhooks.send``, ``event_id=``).
        job_id: the id the job was (or would have been) recorded under; None for an event.
    """

    def __init__(
        self, message: str, *, key: str, job_id: str | None = None, store: str = ""
    ) -> None:
        super().__init__(message, store=store)
        self.key = key
        self.job_id = job_id


class DamagedJobError(StoreError):
    """A job's stored row cannot be read: a value in it is not one retrysafe writes (headers
    that are no JSON array of ``[name, value]`` pairs, a state or time of another type), so
    something other than retrysafe wrote or changed it. A worker that claims such a job never
    sends it: it parks it UNKNOWN, with the reason in ``last_error``.

    Attributes:
        job_id: the job's id.
    """

    def __init__(self, message: str, *, job_id: str, store: str = "") -> None:
        super().__init__(message, store=store)
        self.job_id = job_id


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


class AgentError(RetrysafeError):
    """An agent tool call cannot run, or cannot report a result (SPEC §7).

    Attributes:
        run_id: the agent run, when there is one.
        key: the call's idempotency key, when the call was recorded.
        tool: the tool's name, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        key: str | None = None,
        tool: str | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.key = key
        self.tool = tool


class NoActiveRunError(AgentError, RuntimeError):
    """A write tool was called outside an agent run (``start_run`` / ``resume_run``)."""


class RunNotFoundError(AgentError, LookupError):
    """``resume_run`` was given a run id that the store does not hold."""


class ToolSignatureError(AgentError):
    """A tool's parameters changed between runs: the run recorded calls of this tool under
    another signature, so the same logical call would get another key (and run twice).

    Attributes:
        recorded: the signature hash the run recorded; ``current``: the tool's signature now.
    """

    def __init__(
        self, message: str, *, run_id: str, tool: str, recorded: str, current: str
    ) -> None:
        super().__init__(message, run_id=run_id, tool=tool)
        self.recorded = recorded
        self.current = current


class OutcomeUnknownError(AgentError):
    """The call's effect may or may not have happened; it is NOT a failure (SPEC §5, §7).

    Raised when a write tool's attempts ran out on transport errors or timeouts, when its
    process stopped mid-call, and to every repeat of such a call. Reconcile it with the same
    ``key`` (``resume_run(..., retry_unknown=True)``); never retry it with a new one.

    Attributes:
        attempts: the attempts the call made so far.
    """

    def __init__(
        self, message: str, *, run_id: str, key: str, tool: str, attempts: int = 0
    ) -> None:
        super().__init__(message, run_id=run_id, key=key, tool=tool)
        self.attempts = attempts


class ToolCallFailedError(AgentError):
    """A repeat of a call that failed definitively, or whose stored result cannot be
    replayed; the tool does not run again.

    Attributes:
        error: the recorded error (``"ValueError: …"``).
    """

    def __init__(self, message: str, *, run_id: str, key: str, tool: str, error: str) -> None:
        super().__init__(message, run_id=run_id, key=key, tool=tool)
        self.error = error


class CallIdReusedError(AgentError):
    """An explicit call id (``with call_id(...)``) that the run already recorded for another
    tool or other arguments. Nothing runs and the recorded call is kept; like the
    middleware's 422 for a key reused with another request (SPEC §3).

    Attributes:
        call_id: the reused id. ``recorded_tool`` / ``recorded_arguments_hash``: the call the
            run recorded under it; ``arguments_hash``: the hash of the rejected call's arguments.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str,
        key: str,
        tool: str,
        call_id: str,
        recorded_tool: str,
        recorded_arguments_hash: str,
        arguments_hash: str,
    ) -> None:
        super().__init__(message, run_id=run_id, key=key, tool=tool)
        self.call_id = call_id
        self.recorded_tool = recorded_tool
        self.recorded_arguments_hash = recorded_arguments_hash
        self.arguments_hash = arguments_hash


class BudgetExceededError(AgentError):
    """A budget stopped an agent: too many logical calls in the run (``kind="steps"``) or too
    many attempts of one call (``kind="attempts"``). The refusal is in the audit log.

    Attributes:
        limit: the budget that was reached; ``kind``: ``"steps"`` or ``"attempts"``.
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str,
        limit: int,
        kind: str,
        key: str | None = None,
        tool: str | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id, key=key, tool=tool)
        self.limit = limit
        self.kind = kind


class WebhookError(RetrysafeError):
    """Webhook delivery or reception failed (SPEC §6).

    Attributes:
        endpoint_id: the endpoint concerned, when there is one.
    """

    def __init__(self, message: str, *, endpoint_id: str | None = None) -> None:
        super().__init__(message)
        self.endpoint_id = endpoint_id


class WebhookIdReusedError(WebhookError):
    """An incoming ``webhook-id`` was already received with another body (SPEC §6): a sender
    bug or a forged redelivery, never a duplicate to acknowledge. The handler did not run.

    Attributes:
        webhook_id: the reused id.
        stored_fingerprint: SHA-256 (hex) of the body first received under it.
        fingerprint: SHA-256 (hex) of this body.
    """

    def __init__(
        self, message: str, *, webhook_id: str, stored_fingerprint: str, fingerprint: str
    ) -> None:
        super().__init__(message)
        self.webhook_id = webhook_id
        self.stored_fingerprint = stored_fingerprint
        self.fingerprint = fingerprint


class EndpointNotFoundError(WebhookError, LookupError):
    """No webhook endpoint with that id exists in the store."""


class DestinationRefusedError(WebhookError):
    """An endpoint URL resolves to an address the SSRF guard refuses (private, loopback,
    link-local, multicast, reserved) and private destinations were not allowed.

    Attributes:
        url: the endpoint URL.
        address: the refused IP address (None when the host did not resolve).
        reason: a short explanation, e.g. ``"loopback"``.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        address: str | None = None,
        reason: str = "",
        endpoint_id: str | None = None,
    ) -> None:
        super().__init__(message, endpoint_id=endpoint_id)
        self.url = url
        self.address = address
        self.reason = reason


class WebhookVerificationError(WebhookError, ValueError):
    """An incoming webhook failed verification (Standard Webhooks): a header is missing or
    malformed, the timestamp is outside the tolerance, or no signature matches the body.

    Attributes:
        reason: a short, sender-safe explanation (``"no matching signature"``,
            ``"timestamp too old"``, ``"missing header webhook-id"``, …).
        webhook_id: the ``webhook-id`` header, when present (truncated to 300 characters).
    """

    def __init__(self, reason: str, *, webhook_id: str | None = None) -> None:
        super().__init__(f"webhook verification failed: {reason}")
        self.reason = reason
        self.webhook_id = None if webhook_id is None else webhook_id[:300]


class RetrysafeWarning(UserWarning):
    """A configuration that works but is dangerous, e.g. a retention shorter than the lease.

    Turn it into an error in tests with ``-W error::retrysafe.RetrysafeWarning``.
    """
