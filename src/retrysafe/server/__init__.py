"""Server side: the idempotency middleware for ASGI and WSGI apps (SPEC §3, §4).

:class:`IdempotencyMiddleware` (ASGI) and :class:`WSGIIdempotencyMiddleware` (WSGI) share one
engine over :mod:`retrysafe.core` and a :mod:`retrysafe.stores` key store, configured by one
frozen :class:`IdempotencyConfig`. :func:`transaction` lets a handler commit its own SQL
writes together with the key's completion (transactional mode); :func:`mark_outcome_unknown`
and :func:`answer_early` let it say what the middleware cannot see. Importing this package imports
no web framework.
"""

from retrysafe.server._asgi import IdempotencyMiddleware
from retrysafe.server._config import DEFAULT_REPLAY_HEADERS, IdempotencyConfig
from retrysafe.server._outcome import answer_early, mark_outcome_unknown
from retrysafe.server._transaction import transaction
from retrysafe.server._wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "DEFAULT_REPLAY_HEADERS",
    "IdempotencyConfig",
    "IdempotencyMiddleware",
    "WSGIIdempotencyMiddleware",
    "answer_early",
    "mark_outcome_unknown",
    "transaction",
]
