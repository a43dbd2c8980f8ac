"""retrysafe's pure core: keys, fingerprints, the server decision (SPEC §3), the client
classification (SPEC §5), backoff, lease timing and problem details. Nothing here does I/O or
reads a clock.
"""

from retrysafe.core._backoff import (
    Backoff,
    Jitter,
    decorrelated_jitter,
    equal_jitter,
    exponential,
    full_jitter,
    parse_retry_after,
)
from retrysafe.core._classify import (
    KEY_REUSED_PROBLEM,
    Action,
    AttemptOutcome,
    Classification,
    Committed,
    classify_response,
    classify_transport_error,
)
from retrysafe.core._decision import (
    Claim,
    Decision,
    InProgress,
    InvalidKey,
    KeyCheck,
    Keyed,
    KeyReused,
    MissingKey,
    NotProtected,
    Replay,
    ReplayUnavailable,
    TakeOver,
    Unkeyed,
    check_key,
    decide,
    should_store,
)
from retrysafe.core._fingerprint import canonical_body, fingerprint, is_json_content_type
from retrysafe.core._keys import MAX_KEY_LENGTH, key_hash, parse_key, scope_from_authorization
from retrysafe.core._lease import (
    MAX_LEASE,
    MAX_RUN_TIME,
    MIN_HEARTBEAT,
    LeaseTiming,
    lease_timing,
)
from retrysafe.core._problems import PROBLEM_CONTENT_TYPE, PROBLEM_TYPE_PREFIX, Problem
from retrysafe.core._records import KeyRecord, KeyState, StoredResponse

__all__ = [
    "KEY_REUSED_PROBLEM",
    "MAX_KEY_LENGTH",
    "MAX_LEASE",
    "MAX_RUN_TIME",
    "MIN_HEARTBEAT",
    "PROBLEM_CONTENT_TYPE",
    "PROBLEM_TYPE_PREFIX",
    "Action",
    "AttemptOutcome",
    "Backoff",
    "Claim",
    "Classification",
    "Committed",
    "Decision",
    "InProgress",
    "InvalidKey",
    "Jitter",
    "KeyCheck",
    "KeyRecord",
    "KeyReused",
    "KeyState",
    "Keyed",
    "LeaseTiming",
    "MissingKey",
    "NotProtected",
    "Problem",
    "Replay",
    "ReplayUnavailable",
    "StoredResponse",
    "TakeOver",
    "Unkeyed",
    "canonical_body",
    "check_key",
    "classify_response",
    "classify_transport_error",
    "decide",
    "decorrelated_jitter",
    "equal_jitter",
    "exponential",
    "fingerprint",
    "full_jitter",
    "is_json_content_type",
    "key_hash",
    "lease_timing",
    "parse_key",
    "parse_retry_after",
    "scope_from_authorization",
    "should_store",
]
