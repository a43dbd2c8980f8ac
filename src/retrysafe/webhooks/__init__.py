"""Webhook delivery and reception (SPEC §6), per the Standard Webhooks specification.

Sending: :class:`Webhooks` registers endpoints, records each event once and fans it out as
one outbox delivery per subscribed endpoint; its worker signs every attempt afresh (same
``webhook-id``, new ``webhook-timestamp`` and ``webhook-signature``), retries 5xx, 408, 429
and transport errors on the endpoint's schedule, stops on other 4xx, disables endpoints on
410 Gone or a run of failures, and refuses private destinations (SSRF guard, pinned
addresses). Exhausted deliveries wait in the dead-letter queue for replay::

    hooks = Webhooks("sqlite:///app.db")
    ep = hooks.add_endpoint("https://example.com/hooks", event_types=["invoice.*"])
    hooks.send("invoice.paid", {"id": "in_1"})
    hooks.worker().run_until_idle()

Storage: endpoints, events and deliveries live beside the outbox, in SQLite or PostgreSQL;
:func:`webhook_store` gives the :class:`WebhookStore` of a ``SQLiteStore`` or
``PostgresStore``, and several webhook workers can share one PostgreSQL database.

Receiving: :class:`WebhookVerifier` (direct, decorator) and :class:`WebhookMiddleware`
(ASGI) verify signatures and handle each ``webhook-id`` once.
"""

from retrysafe._exceptions import (
    DestinationRefusedError,
    EndpointNotFoundError,
    WebhookError,
    WebhookIdReusedError,
    WebhookVerificationError,
)
from retrysafe.webhooks._endpoints import ROTATION_OVERLAP
from retrysafe.webhooks._models import AsyncWebhookStore, WebhookStore
from retrysafe.webhooks._models import WebhookDelivery as Delivery
from retrysafe.webhooks._models import WebhookEndpoint as Endpoint
from retrysafe.webhooks._models import WebhookEvent as Event
from retrysafe.webhooks._policy import (
    DEFAULT,
    SCHEDULES,
    SVIX,
    Schedule,
    WebhookPolicy,
    decide,
    disables_endpoint,
    rate_gate,
    should_auto_disable,
)
from retrysafe.webhooks._receiver import Receipt, WebhookMiddleware, WebhookVerifier
from retrysafe.webhooks._sender import DEAD_LETTER_STATES, Webhooks
from retrysafe.webhooks._signing import (
    DEFAULT_TOLERANCE,
    MIN_SECRET_BYTES,
    generate_secret,
    parse_secret,
    sign,
    signature_header,
    verify,
)
from retrysafe.webhooks._ssrf import PinnedTransport, address_problem
from retrysafe.webhooks._store import webhook_store

__all__ = [
    "DEAD_LETTER_STATES",
    "DEFAULT",
    "DEFAULT_TOLERANCE",
    "MIN_SECRET_BYTES",
    "ROTATION_OVERLAP",
    "SCHEDULES",
    "SVIX",
    "AsyncWebhookStore",
    "Delivery",
    "DestinationRefusedError",
    "Endpoint",
    "EndpointNotFoundError",
    "Event",
    "PinnedTransport",
    "Receipt",
    "Schedule",
    "WebhookError",
    "WebhookIdReusedError",
    "WebhookMiddleware",
    "WebhookPolicy",
    "WebhookStore",
    "WebhookVerificationError",
    "WebhookVerifier",
    "Webhooks",
    "address_problem",
    "decide",
    "disables_endpoint",
    "generate_secret",
    "parse_secret",
    "rate_gate",
    "should_auto_disable",
    "sign",
    "signature_header",
    "verify",
    "webhook_store",
]
