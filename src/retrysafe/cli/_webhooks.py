"""``retrysafe webhooks …``: endpoints, sending, the dead-letter queue and the worker.

Tables by default, ``--json`` for scripts; errors are one ``retrysafe: error: …`` line and the
exit codes of docs/cli.md: 1 for an unknown endpoint or delivery id or a store that failed, 2
for bad input (URLs, secrets, event types, payloads, ids that cannot be ids). No command
creates a store (``retrysafe migrate`` does).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from retrysafe.cli._client import (
    _CONCURRENCY,
    DELIVERY_ID,
    Served,
    _attempts_table,
    _emit,
    _JsonLines,
    _url,
    _when,
    check_lease_timing,
    emit_summary,
    finish,
    lease_options,
    no_metrics_with_processes,
    outage_bound,
    serve,
)
from retrysafe.cli._common import (
    SQL_STORES,
    Number,
    StrParamType,
    check_can_ask,
    driver_lines_to,
    epilog,
    errors,
    fail,
    json_option,
    limit_hint,
    metrics_option,
    opened_store,
    plain_table,
    print_table,
    read_json_argument,
    rerun_with,
    serving_metrics,
    shown_value,
    store_option,
)
from retrysafe.cli._processes import in_processes, processes_option
from retrysafe.client._worker import GRACE_MARGIN
from retrysafe.webhooks._models import WebhookDelivery, WebhookEndpoint
from retrysafe.webhooks._policy import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD_HINT, WebhookPolicy

if TYPE_CHECKING:
    from retrysafe.webhooks import Webhooks

__all__ = ["webhooks"]

_ALLOW_ENV = "RETRYSAFE_WEBHOOKS_ALLOW_PRIVATE"
_LIMIT = click.IntRange(min=1, max=1_000_000)
#: ``send --max-payload``: 1 byte to 1 GiB.
_PAYLOAD_BYTES = click.IntRange(min=1, max=2**30)
_ENDPOINT_FLAGS = {
    "url": "URL",
    "secret": "--secret",
    "event_types": "-e/--event-type",
    "schedule": "--schedule",
    "rate_limit": "--rate-limit",
    "description": "--description",
}


class EndpointId(StrParamType):
    """An endpoint id or the start of one: ``ep_`` and up to 32 hex digits (or a start of
    ``ep_`` itself)."""

    name = "endpoint_id"
    _ID = re.compile(r"ep_[0-9a-f]{0,32}")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        low = value.lower() if isinstance(value, str) else ""
        if not (low and ("ep_".startswith(low) or self._ID.fullmatch(low))):
            self.fail(
                f"{shown_value(value, 60)} is not an endpoint id (ep_ and hex digits, or the "
                "start of one)",
                param,
                ctx,
            )
        return low


class EventType(StrParamType):
    """An event type (``invoice.paid``): 1–128 of ``A-Z a-z 0-9 _ . -``."""

    name = "event_type"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from retrysafe._exceptions import ConfigurationError
        from retrysafe.webhooks._endpoints import check_event_type

        try:
            return check_event_type(value)
        except ConfigurationError:
            self.fail(
                f"{shown_value(value, 60)} is not an event type (1–128 of A-Z a-z 0-9 _ . -)",
                param,
                ctx,
            )


class Text(StrParamType):
    """Free text for a person: at most ``limit`` characters, no control characters."""

    name = "text"

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            self.fail("not text", param, ctx)
        if len(value) > self.limit:
            self.fail(f"{len(value)} characters; at most {self.limit}", param, ctx)
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            self.fail(f"{shown_value(value, 60)} contains a control character", param, ctx)
        return value


ENDPOINT_ID = EndpointId()
EVENT_TYPE = EventType()
_RATE = Number(high=1e6, unit="attempts per second")


def _allow_option(fn: Any) -> Any:
    return click.option(
        "--allow-private",
        is_flag=True,
        envvar=_ALLOW_ENV,
        help="Allow private, loopback and link-local destinations (SSRF guard off).",
    )(fn)


@contextmanager
def _hooks(
    store: str,
    allow_private: bool = False,
    *,
    write: bool = True,
    flags: Mapping[str, str] | None = None,
    policy: WebhookPolicy | None = None,
) -> Iterator[Any]:
    """Webhooks on an existing store (a reader opens SQLite read-only, PostgreSQL without
    creating tables); retrysafe errors inside become one error line and the exit code."""
    from retrysafe.webhooks import Webhooks

    with (
        errors(store, flags),
        opened_store(store, write=write) as opened,
        Webhooks(opened, allow_private=allow_private, policy=policy) as hooks,
    ):
        yield hooks


def _endpoints_table(endpoints: list[WebhookEndpoint]) -> Any:
    table = plain_table(title="webhook endpoints")
    table.add_column("id", no_wrap=True)
    for col in ("url", "event types", "enabled", "schedule", "failures", "created"):
        table.add_column(col, overflow="fold")
    for e in endpoints:
        enabled = "yes" if e.enabled else f"no ({e.disabled_reason or ''})"
        table.add_row(
            e.id,
            _url(e.url),
            ", ".join(e.event_types) or "*",
            enabled,
            e.schedule,
            str(e.failure_count),
            _when(e.created_at),
        )
    return table


def _deliveries_table(deliveries: list[WebhookDelivery], title: str) -> Any:
    table = plain_table(title=title)
    table.add_column("id", no_wrap=True, min_width=12)
    for col in ("state", "event", "type", "endpoint", "sends", "last", "updated"):
        table.add_column(col, overflow="fold")
    for d in deliveries:
        last = f"{d.last_status or ''} {d.last_outcome or ''}".strip()
        table.add_row(
            d.id[:12],
            d.state.value,
            d.event_id,
            d.event_type,
            d.endpoint_id,
            str(d.sends),
            last,
            _when(d.updated_at),
        )
    return table


def _show_endpoint(e: WebhookEndpoint, as_json: bool, secrets: bool = False) -> None:
    if as_json:
        _emit(e.to_dict(secrets=secrets))
        return
    for k, v in e.to_dict(secrets=secrets).items():
        click.echo(f"{k}: {v}")


@click.group("webhooks", epilog=epilog())
def webhooks() -> None:
    """Signed webhook delivery (Standard Webhooks): endpoints, send, DLQ, worker."""


_STORE = store_option(schemes=SQL_STORES, with_schema=True)


# ---------------------------------------------------------------------- endpoints
@webhooks.group("endpoints", epilog=epilog())
def endpoints() -> None:
    """Register and manage subscriber endpoints."""


@endpoints.command("add", epilog=epilog("(the host does not resolve);"))
@_STORE
@click.argument("url")
@click.option("--secret", default=None, help="whsec_ secret (default: a fresh one).")
@click.option("--event-type", "-e", "event_types", multiple=True, help="Type or prefix.* .")
@click.option("--description", type=Text(), default="", help="Free text (≤ 1000 characters).")
@click.option("--schedule", default=None, help="Retry schedule: default or svix.")
@click.option("--rate-limit", type=_RATE, default=None, help="Most attempts per second.")
@click.option("--disabled", is_flag=True, help="Register it disabled.")
@_allow_option
@json_option
def endpoints_add(
    store: str,
    url: str,
    secret: str | None,
    event_types: tuple[str, ...],
    description: str,
    schedule: str | None,
    rate_limit: float | None,
    disabled: bool,
    allow_private: bool,
    as_json: bool,
) -> None:
    """Register URL; prints the endpoint with its secret (shown only here and in show). The
    store must exist (`retrysafe migrate` creates it)."""
    with _hooks(store, allow_private, flags=_ENDPOINT_FLAGS) as hooks:
        e = hooks.add_endpoint(
            url,
            secret=secret,
            event_types=list(event_types),
            description=description,
            schedule=schedule,
            rate_limit=rate_limit,
            enabled=not disabled,
        )
        _show_endpoint(e, as_json, secrets=True)


@endpoints.command("list", epilog=epilog())
@_STORE
@json_option
def endpoints_list(store: str, as_json: bool) -> None:
    """List endpoints."""
    with _hooks(store, write=False) as hooks:
        found = hooks.list_endpoints()
    if as_json:
        _emit([e.to_dict() for e in found])
    else:
        print_table(_endpoints_table(found))


@endpoints.command("show", epilog=epilog("(no such endpoint);"))
@_STORE
@click.argument("endpoint_id", type=ENDPOINT_ID)
@click.option("--secrets", is_flag=True, help="Include the secrets.")
@json_option
def endpoints_show(store: str, endpoint_id: str, secrets: bool, as_json: bool) -> None:
    """Show one endpoint (id or unique prefix)."""
    with _hooks(store, write=False) as hooks:
        _show_endpoint(hooks.get_endpoint(endpoint_id), as_json, secrets)


@endpoints.command("update", epilog=epilog("(no such endpoint, or the host does not resolve);"))
@_STORE
@click.argument("endpoint_id", type=ENDPOINT_ID)
@click.option("--url", default=None)
@click.option("--secret", default=None, help="Rotate to this whsec_ secret.")
@click.option("--rotate", is_flag=True, help="Rotate to a fresh secret.")
@click.option("--event-type", "-e", "event_types", multiple=True)
@click.option("--description", type=Text(), default=None, help="Free text (≤ 1000 characters).")
@click.option("--schedule", default=None)
@click.option("--rate-limit", type=_RATE, default=None, help="Attempts per second.")
@click.option("--no-rate-limit", is_flag=True, help="Remove the rate limit.")
@_allow_option
@json_option
def endpoints_update(
    store: str,
    endpoint_id: str,
    url: str | None,
    secret: str | None,
    rotate: bool,
    event_types: tuple[str, ...],
    description: str | None,
    schedule: str | None,
    rate_limit: float | None,
    no_rate_limit: bool,
    allow_private: bool,
    as_json: bool,
) -> None:
    """Change an endpoint; a new secret rotates (the old one signs for 24 h more)."""
    from retrysafe.webhooks import generate_secret

    if rotate and secret is not None:
        raise click.UsageError("give --secret or --rotate, not both")
    if no_rate_limit and rate_limit is not None:
        raise click.UsageError("give --rate-limit or --no-rate-limit, not both")
    limit: dict[str, Any] = {}
    if no_rate_limit:
        limit["rate_limit"] = None
    elif rate_limit is not None:
        limit["rate_limit"] = rate_limit
    flags = {**_ENDPOINT_FLAGS, "url": "--url"}
    with _hooks(store, allow_private, flags=flags) as hooks:
        e = hooks.update_endpoint(
            endpoint_id,
            url=url,
            secret=generate_secret() if rotate else secret,
            event_types=list(event_types) if event_types else None,
            description=description,
            schedule=schedule,
            **limit,
        )
        _show_endpoint(e, as_json, secrets=rotate or secret is not None)


@endpoints.command("disable", epilog=epilog("(no such endpoint);"))
@_STORE
@click.argument("endpoint_id", type=ENDPOINT_ID)
@click.option("--reason", type=Text(), default="disabled by an operator", show_default=True)
@json_option
def endpoints_disable(store: str, endpoint_id: str, reason: str, as_json: bool) -> None:
    """Stop sending to an endpoint (its deliveries are kept, parked)."""
    with _hooks(store) as hooks:
        _show_endpoint(hooks.disable_endpoint(endpoint_id, reason), as_json)


@endpoints.command("enable", epilog=epilog("(no such endpoint);"))
@_STORE
@click.argument("endpoint_id", type=ENDPOINT_ID)
@click.option("--replay-missed", is_flag=True, help="Re-queue parked and dead deliveries.")
@json_option
def endpoints_enable(store: str, endpoint_id: str, replay_missed: bool, as_json: bool) -> None:
    """Send to an endpoint again."""
    with _hooks(store) as hooks:
        e = hooks.enable_endpoint(endpoint_id)
        replayed = []
        if replay_missed:
            from retrysafe.webhooks._dispatch import MISSED_STATES

            replayed = hooks.replay(endpoint_id=e.id, states=MISSED_STATES)
    if as_json:
        _emit({**e.to_dict(), "replayed": [d.id for d in replayed]})
    else:
        _show_endpoint(e, False)
        click.echo(f"replayed: {len(replayed)}")


@endpoints.command("delete", epilog=epilog("(no such endpoint, or not confirmed);"))
@_STORE
@click.argument("endpoint_id", type=ENDPOINT_ID)
@click.option("--yes", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@json_option
def endpoints_delete(store: str, endpoint_id: str, yes: bool, as_json: bool) -> None:
    """Delete an endpoint with its deliveries (events stay)."""
    check_can_ask(yes, "delete")
    with _hooks(store) as hooks:
        full = hooks.resolve_endpoint(endpoint_id)
        if not yes:
            click.confirm(f"delete endpoint {full} and its deliveries?", abort=True, err=True)
        hooks.delete_endpoint(full)
    if as_json:
        _emit({"deleted": full})
    else:
        click.echo(f"deleted {full}")


# ---------------------------------------------------------------------- send
@webhooks.command("send", epilog=epilog())
@_STORE
@click.argument("event_type")
@click.argument("payload")
@click.option("--id", "event_id", default=None, help="Event id (the webhook-id).")
@click.option(
    "--max-payload",
    type=_PAYLOAD_BYTES,
    default=DEFAULT_MAX_PAYLOAD,
    show_default=True,
    help="Largest payload recorded, in bytes of JSON (what retrysafe's receiver reads by "
    "default).",
)
@json_option
def send(
    store: str,
    event_type: str,
    payload: str,
    event_id: str | None,
    max_payload: int,
    as_json: bool,
) -> None:
    """Record an event (PAYLOAD: JSON text, @file, or - for stdin) and its deliveries."""
    value = read_json_argument(payload, "PAYLOAD")
    flags = {"event_type": "EVENT_TYPE", "event_id": "--id", "payload": "PAYLOAD"}
    policy = WebhookPolicy(max_payload=max_payload)
    with _hooks(store, flags=flags, policy=policy) as hooks:
        with limit_hint(MAX_PAYLOAD_HINT, "--max-payload"), rerun_with("--id"):
            event = hooks.send(event_type, value, event_id=event_id)
        deliveries = hooks.deliveries(event_id=event.id, limit=10_000)
    if as_json:
        _emit({**event.to_dict(), "deliveries": [d.to_dict() for d in deliveries]})
    else:
        n = len(deliveries)
        click.echo(f"event {event.id} ({event.event_type}): {n} deliver{'y' if n == 1 else 'ies'}")


# ---------------------------------------------------------------------- dlq
@webhooks.group("dlq", epilog=epilog())
def dlq() -> None:
    """The webhook dead-letter queue: list, show, replay, purge."""


_ENDPOINT_FILTER = click.option("--endpoint", "endpoint_id", type=ENDPOINT_ID, default=None)
_TYPE_FILTER = click.option("--event-type", type=EVENT_TYPE, default=None)


@dlq.command("list", epilog=epilog("(no such endpoint);"))
@_STORE
@_ENDPOINT_FILTER
@_TYPE_FILTER
@click.option("--limit", type=_LIMIT, default=100, show_default=True)
@json_option
def dlq_list(
    store: str, endpoint_id: str | None, event_type: str | None, limit: int, as_json: bool
) -> None:
    """Dead letters: exhausted (unknown) and rejected deliveries."""
    with _hooks(store, write=False) as hooks:
        found = hooks.dead_letters(endpoint_id=endpoint_id, event_type=event_type, limit=limit)
    if as_json:
        _emit([d.to_dict() for d in found])
    else:
        print_table(_deliveries_table(found, "webhook dead letters"))


@dlq.command("show", epilog=epilog("(no such delivery);"))
@_STORE
@click.argument("delivery_id", type=DELIVERY_ID)
@json_option
def dlq_show(store: str, delivery_id: str, as_json: bool) -> None:
    """One delivery with all its attempts."""
    with _hooks(store, write=False) as hooks:
        d = hooks.delivery(delivery_id)
        attempts = hooks.attempts(d.id)
    if as_json:
        _emit({**d.to_dict(), "attempts": [a.to_dict() for a in attempts]})
    else:
        for k, v in d.to_dict().items():
            click.echo(f"{k}: {v}")
        print_table(_attempts_table(attempts))


@dlq.command("replay", epilog=epilog("(no such delivery or endpoint);"))
@_STORE
@click.argument("delivery_ids", nargs=-1, type=DELIVERY_ID)
@_ENDPOINT_FILTER
@_TYPE_FILTER
@click.option("--all", "replay_all", is_flag=True, help="Every dead letter (of the filters).")
@json_option
def dlq_replay(
    store: str,
    delivery_ids: tuple[str, ...],
    endpoint_id: str | None,
    event_type: str | None,
    replay_all: bool,
    as_json: bool,
) -> None:
    """Re-queue dead letters with their same webhook-id."""
    if not delivery_ids and not (replay_all or endpoint_id or event_type):
        raise click.UsageError("give delivery ids, or --all / --endpoint / --event-type")
    if delivery_ids and replay_all:  # which one was meant? Nothing is replayed.
        raise click.UsageError("give delivery ids or --all, not both")
    with _hooks(store) as hooks:
        done = hooks.replay(
            list(delivery_ids) or None, endpoint_id=endpoint_id, event_type=event_type
        )
    if as_json:
        _emit([d.to_dict() for d in done])
    else:
        click.echo(f"replayed {len(done)} deliver{'y' if len(done) == 1 else 'ies'}")


@dlq.command("purge", epilog=epilog("(no such endpoint, or not confirmed);"))
@_STORE
@_ENDPOINT_FILTER
@_TYPE_FILTER
@click.option("--older-than", type=Number(zero=True), default=0.0, help="Seconds.")
@click.option("--yes", is_flag=True, help="Do not ask (needed when stdin is not a terminal).")
@json_option
def dlq_purge(
    store: str,
    endpoint_id: str | None,
    event_type: str | None,
    older_than: float,
    yes: bool,
    as_json: bool,
) -> None:
    """Delete dead letters and their attempts."""
    check_can_ask(yes, "purge")
    with _hooks(store) as hooks:
        if not yes:
            click.confirm("delete these dead letters and their attempts?", abort=True, err=True)
        n = hooks.purge(endpoint_id=endpoint_id, event_type=event_type, older_than=older_than)
    if as_json:
        _emit({"purged": n})
    else:
        click.echo(f"purged {n} dead letters")


# ---------------------------------------------------------------------- worker
@webhooks.command(
    "worker",
    epilog=epilog(
        "(--until-idle: some deliveries ended UNKNOWN, or the store stayed unreachable);"
    ),
)
@_STORE
@click.option(
    "--concurrency", "-c", type=_CONCURRENCY, default=8, show_default=True
)
@click.option(
    "--max-per-destination",
    type=_CONCURRENCY,
    default=None,
    help="Deliveries in flight to one scheme://host:port at most (default: --concurrency; "
    "below it, a receiver whose deliveries time out gets fewer, and slow ones share half "
    "while others have deliveries due).",
)
@lease_options("deliveries")
@click.option("--until-idle", is_flag=True, help="Exit once nothing is pending.")
@_allow_option
@processes_option
@metrics_option
@json_option
def worker(
    store: str,
    concurrency: int,
    max_per_destination: int | None,
    lease: float | None,
    heartbeat: float | None,
    max_run_time: float | None,
    until_idle: bool,
    allow_private: bool,
    processes: int,
    metrics_address: str | None,
    as_json: bool,
) -> None:
    """Deliver webhooks; one JSON line per attempt (event, endpoint, attempt, status,
    latency, outcome) on stdout, and a last line with the totals (--json changes nothing:
    the output is JSON lines already). SIGTERM: in-flight attempts finish, exit 143; Ctrl-C:
    in-flight deliveries released, exit 130."""
    check_lease_timing(lease, heartbeat, max_run_time)
    no_metrics_with_processes(processes, metrics_address)

    def warn(hooks: Webhooks) -> None:
        for endpoint, exc in hooks.refused_endpoints():
            click.echo(
                f"retrysafe: warning: endpoint {endpoint.id} will not be delivered to: "
                f"{exc} (pass --allow-private to this worker too)",
                err=True,
            )

    def run(index: int | None) -> Served:
        log = logging.getLogger("retrysafe")  # deliveries, the worker's, store's, metrics'
        handler = _JsonLines(attempts_of="retrysafe.webhooks")
        log.addHandler(handler)
        old = log.level
        log.setLevel(logging.INFO)
        try:
            with (
                _hooks(store, allow_private) as hooks,
                serving_metrics(metrics_address, hooks.outbox.store) as metrics,
            ):
                if index is None:  # else the parent said it, once
                    warn(hooks)
                w = hooks.worker(
                    concurrency=concurrency,
                    max_per_destination=max_per_destination,
                    lease=lease,
                    heartbeat=heartbeat,
                    max_run_time=max_run_time,
                    telemetry=metrics,
                    **outage_bound(until_idle),
                )
                handler.on_failure = w.stop
                try:
                    with driver_lines_to(handler):
                        served = serve(w, until_idle=until_idle, what="deliveries")
                finally:
                    w.close()
        finally:
            log.removeHandler(handler)
            log.setLevel(old)
        served.error = handler.error("deliveries")
        return served

    def check() -> float:
        with _hooks(store, allow_private) as hooks:
            warn(hooks)
            return float(hooks.policy.timeout) + GRACE_MARGIN

    served = in_processes(processes, run, check=check, what="deliveries")
    if served.error is not None:
        fail(served.error)
    emit_summary({"event": "stopped", **served.stats.to_dict()})
    finish(served, until_idle=until_idle, what="deliveries")
