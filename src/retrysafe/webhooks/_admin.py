"""Endpoint administration (SPEC §6): register, look up, update, rotate, enable, disable and
delete subscriber endpoints. Validation is :mod:`retrysafe.webhooks._endpoints`' (pure); the
SSRF guard resolves every new URL before anything is written."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from retrysafe._exceptions import ConfigurationError, DestinationRefusedError, EndpointNotFoundError
from retrysafe.webhooks._endpoints import (
    check_event_types,
    check_secret,
    check_url,
    new_endpoint_id,
    rotated,
)
from retrysafe.webhooks._models import WebhookEndpoint, WebhookStore
from retrysafe.webhooks._policy import WebhookPolicy
from retrysafe.webhooks._signing import generate_secret
from retrysafe.webhooks._ssrf import resolve_checked

__all__ = ["KEEP", "EndpointAdmin", "Keep", "log_disabled"]

logger = logging.getLogger("retrysafe.webhooks")


class Keep:
    """The default of an optional argument whose None means something (no rate limit)."""


KEEP = Keep()


def _check_rate(rate: object) -> float | None:
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e6:
        raise ConfigurationError(
            f"rate_limit must be attempts per second > 0, or None; got {rate!r}",
            option="rate_limit",
        )
    return float(rate)


def _check_description(description: object) -> None:
    if not isinstance(description, str):
        raise ConfigurationError("description must be a string", option="description")


def log_disabled(endpoint_id: str, reason: str) -> None:
    """The one warning line of a disabled endpoint (by an operator or by the worker)."""
    logger.warning("endpoint %s disabled: %s", endpoint_id, reason)


def _not_found(endpoint_id: str) -> EndpointNotFoundError:
    return EndpointNotFoundError(f"no endpoint {endpoint_id!r}", endpoint_id=endpoint_id)


class EndpointAdmin:
    """The endpoints of one webhook store.

    Args:
        store: the webhook store.
        policy: its schedules (an endpoint names one).
        allow_private: let the SSRF guard accept private, loopback and link-local addresses.
        rotation_overlap: seconds a replaced secret keeps signing.
        clock: Unix-seconds clock.
    """

    def __init__(
        self,
        store: WebhookStore,
        *,
        policy: WebhookPolicy,
        allow_private: bool,
        rotation_overlap: float,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.policy = policy
        self.allow_private = allow_private
        self.rotation_overlap = rotation_overlap
        self._clock = clock

    def check_destination(self, url: str) -> None:
        """Resolve ``url``'s host (blocking) and apply the SSRF guard.

        Raises:
            DestinationRefusedError: a refused address, or the host does not resolve.
        """
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        resolve_checked(parts.hostname or "", port, allow_private=self.allow_private, url=url)

    def _check_schedule(self, schedule: str | None) -> str:
        if schedule is None:
            return self.policy.default_schedule
        if not isinstance(schedule, str) or not self.policy.has_schedule(schedule):
            names = sorted(s.name for s in self.policy.schedules)
            raise ConfigurationError(
                f"schedule {schedule!r} is not one of {names}", option="schedule"
            )
        return schedule

    def add_endpoint(
        self,
        url: str,
        *,
        secret: str | None = None,
        event_types: Sequence[str] | None = None,
        description: str = "",
        schedule: str | None = None,
        rate_limit: float | None = None,
        enabled: bool = True,
    ) -> WebhookEndpoint:
        """Register a subscriber endpoint.

        Args:
            url: the http(s) URL deliveries are POSTed to.
            secret: its ``whsec_`` secret (>= 24 random bytes); default a fresh one
                (read it back from the returned endpoint's ``secrets[0][0]``).
            event_types: the types it receives (``invoice.paid``, ``invoice.*``, ``*``);
                empty or None: every type.
            description: free text.
            schedule: the name of a schedule in the policy (default ``"default"``).
            rate_limit: the most attempts per second it receives (None: unlimited),
                spaced evenly; enforced per worker process.
            enabled: False registers it disabled (its deliveries are parked).

        Returns:
            The stored :class:`~retrysafe.webhooks.Endpoint`.

        Raises:
            ConfigurationError: a bad URL, secret, event type or schedule name.
            DestinationRefusedError: the host resolves to a refused address (SSRF guard) or
                does not resolve.
        """
        url = check_url(url)
        secret = generate_secret() if secret is None else check_secret(secret)
        types = check_event_types(event_types)
        schedule = self._check_schedule(schedule)
        _check_description(description)
        self.check_destination(url)
        now = self._clock()
        endpoint = WebhookEndpoint(
            id=new_endpoint_id(),
            url=url,
            secrets=((secret, None),),
            event_types=types,
            description=description,
            schedule=schedule,
            rate_limit=_check_rate(rate_limit),
            enabled=bool(enabled),
            disabled_reason=None if enabled else "registered disabled",
            failure_count=0,
            first_failure_at=None,
            created_at=now,
            updated_at=now,
        )
        return self.store.insert_endpoint(endpoint)

    def resolve_endpoint(self, endpoint_id: str) -> str:
        """The full id of ``endpoint_id`` or of the one endpoint whose id starts with it.

        Raises:
            EndpointNotFoundError: none, or the prefix is ambiguous.
        """
        if not isinstance(endpoint_id, str) or not endpoint_id:
            raise EndpointNotFoundError(f"no endpoint {endpoint_id!r}")
        if self.store.get_endpoint(endpoint_id) is not None:
            return endpoint_id
        found = [e.id for e in self.store.list_endpoints() if e.id.startswith(endpoint_id)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise EndpointNotFoundError(
                f"endpoint id prefix {endpoint_id!r} is ambiguous: {', '.join(found[:3])}",
                endpoint_id=endpoint_id,
            )
        raise EndpointNotFoundError(
            f"no endpoint {endpoint_id!r} in {self.store.url}", endpoint_id=endpoint_id
        )

    def get_endpoint(self, endpoint_id: str) -> WebhookEndpoint:
        """The endpoint (full id or unique prefix). Raises :class:`EndpointNotFoundError`."""
        endpoint = self.store.get_endpoint(self.resolve_endpoint(endpoint_id))
        if endpoint is None:
            raise _not_found(endpoint_id)
        return endpoint

    def list_endpoints(self) -> list[WebhookEndpoint]:
        """Every endpoint, oldest first."""
        return self.store.list_endpoints()

    def update_endpoint(
        self,
        endpoint_id: str,
        *,
        url: str | None = None,
        secret: str | None = None,
        event_types: Sequence[str] | None = None,
        description: str | None = None,
        schedule: str | None = None,
        rate_limit: float | Keep | None = KEEP,
    ) -> WebhookEndpoint:
        """Change an endpoint; None (for ``rate_limit``: leaving it out) keeps a field.

        A new ``url`` also applies to its deliveries not yet succeeded. A new ``secret``
        rotates: it signs from now on, and the previous secret keeps signing too for
        ``rotation_overlap`` seconds (several ``v1,`` signatures per attempt).

        Raises:
            EndpointNotFoundError: no such endpoint.
            ConfigurationError, DestinationRefusedError: as for :meth:`add_endpoint`.
        """
        current = self.get_endpoint(endpoint_id)
        now = self._clock()
        new_url = current.url if url is None else check_url(url)
        if url is not None:
            self.check_destination(new_url)
        secrets = current.secrets
        if secret is not None:
            secrets = rotated(current, check_secret(secret), now=now, overlap=self.rotation_overlap)
        types = current.event_types if event_types is None else check_event_types(event_types)
        if description is not None:
            _check_description(description)
        changed = WebhookEndpoint(
            id=current.id,
            url=new_url,
            secrets=secrets,
            event_types=types,
            description=current.description if description is None else description,
            schedule=current.schedule if schedule is None else self._check_schedule(schedule),
            rate_limit=current.rate_limit
            if isinstance(rate_limit, Keep)
            else _check_rate(rate_limit),
            enabled=current.enabled,
            disabled_reason=current.disabled_reason,
            failure_count=current.failure_count,
            first_failure_at=current.first_failure_at,
            created_at=current.created_at,
            updated_at=now,
        )
        updated = self.store.update_endpoint(changed, now=now, retarget=new_url != current.url)
        if updated is None:
            raise _not_found(endpoint_id)
        return updated

    def rotate_secret(self, endpoint_id: str, secret: str | None = None) -> WebhookEndpoint:
        """Rotate to ``secret`` (default a fresh one); see :meth:`update_endpoint`."""
        return self.update_endpoint(endpoint_id, secret=secret or generate_secret())

    def disable_endpoint(
        self, endpoint_id: str, reason: str = "disabled by an operator"
    ) -> WebhookEndpoint:
        """Stop sending to an endpoint. Its pending deliveries are parked (CANCELLED) and new
        events still record a parked delivery for it: nothing is lost.

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        full = self.resolve_endpoint(endpoint_id)
        endpoint = self.store.set_endpoint_enabled(
            full, enabled=False, reason=str(reason), now=self._clock()
        )
        if endpoint is None:
            raise _not_found(endpoint_id)
        log_disabled(full, str(reason))
        return endpoint

    def enable_endpoint(self, endpoint_id: str) -> WebhookEndpoint:
        """Send to an endpoint again (its failure run starts anew).

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        full = self.resolve_endpoint(endpoint_id)
        endpoint = self.store.set_endpoint_enabled(
            full, enabled=True, reason=None, now=self._clock()
        )
        if endpoint is None:
            raise _not_found(endpoint_id)
        return endpoint

    def delete_endpoint(self, endpoint_id: str) -> None:
        """Delete an endpoint with its deliveries and their attempts (events stay).

        Raises:
            EndpointNotFoundError: no such endpoint.
        """
        if not self.store.delete_endpoint(self.resolve_endpoint(endpoint_id)):
            raise _not_found(endpoint_id)

    def refused_endpoints(self) -> list[tuple[WebhookEndpoint, DestinationRefusedError]]:
        """The enabled endpoints the SSRF guard would refuse now (empty when
        ``allow_private``): every attempt to them fails with ``DestinationRefused`` until
        the schedule runs out. Resolves each host once (blocking); a host that does not
        resolve is not listed (DNS may be down for a moment)."""
        if self.allow_private:
            return []
        refused = []
        for endpoint in self.store.list_endpoints():
            if not endpoint.enabled:
                continue
            try:
                self.check_destination(endpoint.url)
            except DestinationRefusedError as exc:
                if exc.reason != "unresolved":
                    refused.append((endpoint, exc))
        return refused
