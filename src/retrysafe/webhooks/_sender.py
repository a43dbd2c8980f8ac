"""The sending side's public door: :class:`Webhooks` manages endpoints, records events, fans
them out as outbox jobs and builds the worker that delivers them (SPEC §6).

It is a façade over three parts, each in its own module: endpoint administration
(:class:`~retrysafe.webhooks._admin.EndpointAdmin`), sending and the dead-letter queue
(:class:`~retrysafe.webhooks._dispatch.Dispatcher`), and the worker's per-attempt hooks
(:class:`~retrysafe.webhooks._delivery.DeliveryAttempt`, one object per attempt).

A delivery is one outbox job (key ``"{event id}:{endpoint id}"``) in the ``"webhooks"``
queue: it inherits the outbox's durability, leases, fencing, attempt records and retry
budget, and only the webhook worker claims it (a plain outbox worker on the same store
claims the ``"default"`` queue and never sends a delivery unsigned). Each attempt is signed
afresh (same ``webhook-id``, new ``webhook-timestamp`` and ``webhook-signature``), follows
its endpoint's schedule (:func:`~retrysafe.webhooks.decide`), and is logged as one
structured line; 410 Gone or a run of failures disables the endpoint.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

from retrysafe._exceptions import ConfigurationError
from retrysafe._wire import check_transport
from retrysafe.client._outbox import Outbox
from retrysafe.client._policy import RetryPolicy, policy_or_default, seconds
from retrysafe.client._store import StoreArg
from retrysafe.client._worker import Worker
from retrysafe.observability._telemetry import telemetry_of
from retrysafe.webhooks._admin import EndpointAdmin
from retrysafe.webhooks._delivery import WebhookAttempts
from retrysafe.webhooks._dispatch import DEAD_LETTER_STATES, MISSED_STATES, QUEUE, Dispatcher
from retrysafe.webhooks._endpoints import ROTATION_OVERLAP
from retrysafe.webhooks._models import WebhookEndpoint, WebhookStore
from retrysafe.webhooks._policy import WebhookPolicy
from retrysafe.webhooks._ssrf import PinnedTransport, SSRFGuard
from retrysafe.webhooks._store import delivery_outbox, webhook_store

__all__ = ["DEAD_LETTER_STATES", "MISSED_STATES", "QUEUE", "Webhooks"]

logger = logging.getLogger("retrysafe.webhooks")

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _via(
    part: str, fn: Callable[Concatenate[Any, _P], _T]
) -> Callable[Concatenate[Webhooks, _P], _T]:
    """A :class:`Webhooks` method that is ``fn`` of its part ``part`` (same signature and
    docstring)."""

    def method(self: Webhooks, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return fn(getattr(self, part), *args, **kwargs)

    method.__name__ = fn.__name__
    method.__doc__ = fn.__doc__
    method.__wrapped__ = fn  # type: ignore[attr-defined]
    return method


class Webhooks:
    """Webhook delivery on top of the outbox: endpoints, signed at-least-once deliveries, a
    dead-letter queue and replay (SPEC §6).

    Args:
        store: a :class:`~retrysafe.SQLiteStore` or :class:`~retrysafe.stores.PostgresStore`
            (its webhook tables sit beside the outbox's), or its URL (``sqlite:///path.db``,
            ``postgresql://…``).
        allow_private: allow endpoints on private, loopback and link-local addresses
            (default False: the SSRF guard refuses them, at registration and at every
            attempt).
        policy: schedules, timeouts and auto-disable rules (default :class:`WebhookPolicy`).
        rotation_overlap: seconds a replaced secret keeps signing (default 24 h).
        clock: Unix-seconds clock.

    Attributes:
        endpoints: the endpoint administration (:class:`EndpointAdmin`).
        dispatcher: sending and the dead-letter queue (:class:`Dispatcher`).
        outbox: the :class:`~retrysafe.Outbox` of the ``"webhooks"`` queue.
        store: the :class:`~retrysafe.webhooks.WebhookStore`.

    Raises:
        ConfigurationError: a malformed store URL or a store without webhook tables (Redis,
            memory).
    """

    def __init__(
        self,
        store: StoreArg = "sqlite:///retrysafe.db",
        *,
        allow_private: bool = False,
        policy: WebhookPolicy | None = None,
        rotation_overlap: float | timedelta = ROTATION_OVERLAP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy_or_default(policy, WebhookPolicy)
        self.allow_private = bool(allow_private)
        self.rotation_overlap = seconds(rotation_overlap, "rotation_overlap", allow_zero=True)
        self._clock = clock
        self.outbox = Outbox(
            store, policy=RetryPolicy(timeout=self.policy.timeout), clock=clock, queue=QUEUE
        )
        try:
            self.store: WebhookStore = webhook_store(self.outbox.store)
        except ConfigurationError:
            self.outbox.close()
            raise
        self.endpoints = EndpointAdmin(
            self.store,
            policy=self.policy,
            allow_private=self.allow_private,
            rotation_overlap=self.rotation_overlap,
            clock=clock,
        )
        self.dispatcher = Dispatcher(
            self.store,
            self.outbox.store,
            endpoints=self.endpoints,
            clock=clock,
            max_payload=self.policy.max_payload,
        )

    def __repr__(self) -> str:
        return f"Webhooks({self.store.url!r})"

    # ------------------------------------------------------------------ endpoints
    add_endpoint = _via("endpoints", EndpointAdmin.add_endpoint)
    resolve_endpoint = _via("endpoints", EndpointAdmin.resolve_endpoint)
    get_endpoint = _via("endpoints", EndpointAdmin.get_endpoint)
    list_endpoints = _via("endpoints", EndpointAdmin.list_endpoints)
    update_endpoint = _via("endpoints", EndpointAdmin.update_endpoint)
    rotate_secret = _via("endpoints", EndpointAdmin.rotate_secret)
    disable_endpoint = _via("endpoints", EndpointAdmin.disable_endpoint)
    delete_endpoint = _via("endpoints", EndpointAdmin.delete_endpoint)
    refused_endpoints = _via("endpoints", EndpointAdmin.refused_endpoints)

    def enable_endpoint(self, endpoint_id: str, *, replay_missed: bool = False) -> WebhookEndpoint:
        """Send to an endpoint again; with ``replay_missed`` also re-queue what it missed:
        its parked (CANCELLED) deliveries and its dead letters, with their same
        ``webhook-id``.

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        endpoint = self.endpoints.enable_endpoint(endpoint_id)
        if replay_missed:
            self.dispatcher.replay(endpoint_id=endpoint.id, states=MISSED_STATES)
        return endpoint

    # ------------------------------------------------------------------ sending, DLQ
    send = _via("dispatcher", Dispatcher.send)
    get_event = _via("dispatcher", Dispatcher.get_event)
    deliveries = _via("dispatcher", Dispatcher.deliveries)
    dead_letters = _via("dispatcher", Dispatcher.dead_letters)
    resolve_delivery = _via("dispatcher", Dispatcher.resolve_delivery)
    delivery = _via("dispatcher", Dispatcher.delivery)
    attempts = _via("dispatcher", Dispatcher.attempts)
    replay = _via("dispatcher", Dispatcher.replay)
    purge = _via("dispatcher", Dispatcher.purge)

    # ------------------------------------------------------------------ the worker
    def worker(self, **options: Any) -> Worker:
        """A :class:`~retrysafe.client.Worker` that delivers webhooks: signs each attempt,
        follows each endpoint's schedule, pins the checked address (SSRF guard).

        It claims only the ``"webhooks"`` queue: plain outbox jobs in the same store are left
        to a plain worker.

        ``options`` are the Worker's (``concurrency``, ``poll_interval``, ``rng``, …); a
        ``transport`` is wrapped by the SSRF guard. ``attempt_hooks`` and ``queue`` are this
        object's (one :class:`~retrysafe.webhooks._delivery.DeliveryAttempt` per attempt); an
        ``on_attempt`` is called after each attempt's own.

        Without ``allow_private``, logs one warning per enabled endpoint on a private,
        loopback or link-local address (see :meth:`refused_endpoints`): its deliveries
        would be refused at every attempt. Logs one warning per endpoint that names a
        schedule this object's policy does not have (registered by a program with another
        policy): its deliveries follow the default schedule.
        """
        if options.pop("queue", QUEUE) != QUEUE:
            raise ConfigurationError(
                f"the webhook worker delivers the {QUEUE!r} queue only", option="queue"
            )
        if isinstance(options.get("policy"), WebhookPolicy):
            raise ConfigurationError(
                "Webhooks.worker(policy=…) is the RetryPolicy of each attempt (its timeout); "
                "the WebhookPolicy with the schedules is given to Webhooks(policy=…)",
                option="policy",
            )
        for endpoint, exc in self.refused_endpoints():
            logger.warning(
                "endpoint %s is on a refused address and this worker does not allow private "
                "destinations: its deliveries will fail (%s)",
                endpoint.id,
                exc,
            )
        for endpoint in self.store.list_endpoints():
            if endpoint.schedule and not self.policy.has_schedule(endpoint.schedule):
                logger.warning(
                    "endpoint %s names the schedule %r, which this worker's policy does not "
                    "have (its schedules: %s): its deliveries follow %r",
                    endpoint.id,
                    endpoint.schedule,
                    ", ".join(sorted(s.name for s in self.policy.schedules)),
                    self.policy.default_schedule,
                )
        options.setdefault("policy", self.outbox.policy)
        options.setdefault("clock", self._clock)
        inner = options.pop("transport", None)
        if inner is None:  # the default engine, its resolver guarded
            options["address_guard"] = SSRFGuard(allow_private=self.allow_private)
        else:
            check_transport(inner)
            options["transport"] = PinnedTransport(inner, allow_private=self.allow_private)
        store, runs_end_on_record = delivery_outbox(self.outbox.store)
        attempts = WebhookAttempts(
            self.store,
            policy=self.policy,
            clock=options["clock"],
            rng=options.get("rng") or random.Random(),
            telemetry=telemetry_of(options.get("telemetry")),
            runs_end_on_record=runs_end_on_record,
        )
        return Worker(store, queue=QUEUE, attempt_hooks=attempts, **options)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the store if this object opened it from a URL. Idempotent."""
        self.outbox.close()

    def __enter__(self) -> Webhooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
