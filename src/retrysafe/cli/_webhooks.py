"""``retrysafe webhooks …``: endpoints, sending, the dead-letter queue and the worker.

Tables by default, ``--json`` for scripts; errors are one ``retrysafe: error: …`` line and
exit code 1 (unknown endpoint or delivery ids, bad URLs, secrets or payloads).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from retrysafe.cli._client import (
    _attempts_table,
    _emit,
    _errors,
    _JsonLines,
    _sqlite_path,
    _when,
)
from retrysafe.cli._common import fail, store_option
from retrysafe.webhooks._models import WebhookDelivery, WebhookEndpoint

__all__ = ["webhooks"]

_F = TypeVar("_F", bound=Callable[..., Any])
_ALLOW_ENV = "RETRYSAFE_WEBHOOKS_ALLOW_PRIVATE"


def _json_option(fn: _F) -> _F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def _allow_option(fn: _F) -> _F:
    return click.option(
        "--allow-private",
        is_flag=True,
        envvar=_ALLOW_ENV,
        help="Allow private, loopback and link-local destinations (SSRF guard off).",
    )(fn)


@contextmanager
def _hooks(store: str, allow_private: bool = False) -> Iterator[Any]:
    from retrysafe.webhooks import Webhooks

    with _errors(store), Webhooks(store, allow_private=allow_private) as hooks:
        yield hooks


@contextmanager
def _reader(store: str) -> Iterator[Any]:
    """Webhooks for a command that only reads, never creating a store: a SQLite file is
    opened read-only (a missing file is an error: a typo must not create an empty store), a
    PostgreSQL database without retrysafe's tables is a SchemaError naming `retrysafe
    migrate`; other URLs open as for writing."""
    from retrysafe.stores import SQLiteStore, open_store
    from retrysafe.webhooks import Webhooks

    path = _sqlite_path(store)
    postgres = store.split(":", 1)[0].lower() in ("postgresql", "postgres")
    if path is None and not postgres:
        with _hooks(store) as hooks:
            yield hooks
        return
    with _errors(store):
        opened = SQLiteStore(path, readonly=True) if path else open_store(store, create=False)
        try:
            with Webhooks(opened) as hooks:
                yield hooks
        finally:
            opened.close()


def _read_payload(payload: str) -> str:
    """PAYLOAD as text: itself, the file after ``@``, or stdin for ``-`` (UTF-8 only)."""
    if payload == "-":
        name, raw = "stdin", sys.stdin.buffer.read()
    elif payload.startswith("@"):
        name = payload[1:]
        try:
            with open(name, "rb") as f:
                raw = f.read()
        except OSError as exc:
            fail(f"cannot read {name}: {exc.strerror or exc}")
    else:
        return payload
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(f"{name} is not UTF-8 text (byte {exc.start})")


def _endpoints_table(endpoints: list[WebhookEndpoint]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="webhook endpoints")
    table.add_column("id", no_wrap=True)
    for col in ("url", "event types", "enabled", "schedule", "failures", "created"):
        table.add_column(col, overflow="fold")
    for e in endpoints:
        enabled = "yes" if e.enabled else f"no ({e.disabled_reason or ''})"
        table.add_row(
            e.id,
            e.url,
            ", ".join(e.event_types) or "*",
            enabled,
            e.schedule,
            str(e.failure_count),
            _when(e.created_at),
        )
    Console().print(table)


def _deliveries_table(deliveries: list[WebhookDelivery], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
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
    Console().print(table)


def _show_endpoint(e: WebhookEndpoint, as_json: bool, secrets: bool = False) -> None:
    if as_json:
        _emit(e.to_dict(secrets=secrets))
        return
    for k, v in e.to_dict(secrets=secrets).items():
        click.echo(f"{k}: {v}")


@click.group("webhooks")
def webhooks() -> None:
    """Signed webhook delivery (Standard Webhooks): endpoints, send, DLQ, worker."""


# ---------------------------------------------------------------------- endpoints
@webhooks.group("endpoints")
def endpoints() -> None:
    """Register and manage subscriber endpoints."""


@endpoints.command("add")
@store_option
@click.argument("url")
@click.option("--secret", default=None, help="whsec_ secret (default: a fresh one).")
@click.option("--event-type", "-e", "event_types", multiple=True, help="Type or prefix.* .")
@click.option("--description", default="", help="Free text.")
@click.option("--schedule", default=None, help="Retry schedule: default or svix.")
@click.option("--rate-limit", type=float, default=None, help="Most attempts per second.")
@click.option("--disabled", is_flag=True, help="Register it disabled.")
@_allow_option
@_json_option
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
    """Register URL; prints the endpoint with its secret (shown only here and in show)."""
    with _hooks(store, allow_private) as hooks, _errors(store):
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


@endpoints.command("list")
@store_option
@_json_option
def endpoints_list(store: str, as_json: bool) -> None:
    """List endpoints."""
    with _reader(store) as hooks, _errors(store):
        found = hooks.list_endpoints()
        if as_json:
            _emit([e.to_dict() for e in found])
        else:
            _endpoints_table(found)


@endpoints.command("show")
@store_option
@click.argument("endpoint_id")
@click.option("--secrets", is_flag=True, help="Include the secrets.")
@_json_option
def endpoints_show(store: str, endpoint_id: str, secrets: bool, as_json: bool) -> None:
    """Show one endpoint (id or unique prefix)."""
    with _reader(store) as hooks, _errors(store):
        _show_endpoint(hooks.get_endpoint(endpoint_id), as_json, secrets)


@endpoints.command("update")
@store_option
@click.argument("endpoint_id")
@click.option("--url", default=None)
@click.option("--secret", default=None, help="Rotate to this whsec_ secret.")
@click.option("--rotate", is_flag=True, help="Rotate to a fresh secret.")
@click.option("--event-type", "-e", "event_types", multiple=True)
@click.option("--description", default=None)
@click.option("--schedule", default=None)
@click.option("--rate-limit", type=float, default=None, help="Attempts per second.")
@click.option("--no-rate-limit", is_flag=True, help="Remove the rate limit.")
@_allow_option
@_json_option
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
    with _hooks(store, allow_private) as hooks, _errors(store):
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


@endpoints.command("disable")
@store_option
@click.argument("endpoint_id")
@click.option("--reason", default="disabled by an operator", show_default=True)
@_json_option
def endpoints_disable(store: str, endpoint_id: str, reason: str, as_json: bool) -> None:
    """Stop sending to an endpoint (its deliveries are kept, parked)."""
    with _hooks(store) as hooks, _errors(store):
        _show_endpoint(hooks.disable_endpoint(endpoint_id, reason), as_json)


@endpoints.command("enable")
@store_option
@click.argument("endpoint_id")
@click.option("--replay-missed", is_flag=True, help="Re-queue parked and dead deliveries.")
@_json_option
def endpoints_enable(store: str, endpoint_id: str, replay_missed: bool, as_json: bool) -> None:
    """Send to an endpoint again."""
    with _hooks(store) as hooks, _errors(store):
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


@endpoints.command("delete")
@store_option
@click.argument("endpoint_id")
@click.option("--yes", is_flag=True, help="Do not ask.")
def endpoints_delete(store: str, endpoint_id: str, yes: bool) -> None:
    """Delete an endpoint with its deliveries (events stay)."""
    with _hooks(store) as hooks, _errors(store):
        full = hooks.resolve_endpoint(endpoint_id)
        if not yes:
            click.confirm(f"delete endpoint {full} and its deliveries?", abort=True)
        hooks.delete_endpoint(full)
        click.echo(f"deleted {full}")


# ---------------------------------------------------------------------- send
@webhooks.command("send")
@store_option
@click.argument("event_type")
@click.argument("payload")
@click.option("--id", "event_id", default=None, help="Event id (the webhook-id).")
@_json_option
def send(store: str, event_type: str, payload: str, event_id: str | None, as_json: bool) -> None:
    """Record an event (PAYLOAD: JSON text, @file, or - for stdin) and its deliveries."""
    payload = _read_payload(payload)
    try:
        value = json.loads(payload)
    except ValueError as exc:
        fail(f"payload is not JSON: {exc}")
    with _hooks(store) as hooks, _errors(store):
        event = hooks.send(event_type, value, event_id=event_id)
        deliveries = hooks.deliveries(event_id=event.id, limit=10_000)
        if as_json:
            _emit({**event.to_dict(), "deliveries": [d.to_dict() for d in deliveries]})
        else:
            click.echo(f"event {event.id} ({event.event_type}): {len(deliveries)} deliveries")


# ---------------------------------------------------------------------- dlq
@webhooks.group("dlq")
def dlq() -> None:
    """The webhook dead-letter queue: list, show, replay, purge."""


@dlq.command("list")
@store_option
@click.option("--endpoint", "endpoint_id", default=None)
@click.option("--event-type", default=None)
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@_json_option
def dlq_list(
    store: str, endpoint_id: str | None, event_type: str | None, limit: int, as_json: bool
) -> None:
    """Dead letters: exhausted (unknown) and rejected deliveries."""
    with _reader(store) as hooks, _errors(store):
        found = hooks.dead_letters(endpoint_id=endpoint_id, event_type=event_type, limit=limit)
        if as_json:
            _emit([d.to_dict() for d in found])
        else:
            _deliveries_table(found, "webhook dead letters")


@dlq.command("show")
@store_option
@click.argument("delivery_id")
@_json_option
def dlq_show(store: str, delivery_id: str, as_json: bool) -> None:
    """One delivery with all its attempts."""
    with _reader(store) as hooks, _errors(store):
        d = hooks.delivery(delivery_id)
        attempts = hooks.attempts(d.id)
        if as_json:
            _emit({**d.to_dict(), "attempts": [a.to_dict() for a in attempts]})
        else:
            for k, v in d.to_dict().items():
                click.echo(f"{k}: {v}")
            _attempts_table(attempts)


@dlq.command("replay")
@store_option
@click.argument("delivery_ids", nargs=-1)
@click.option("--endpoint", "endpoint_id", default=None)
@click.option("--event-type", default=None)
@click.option("--all", "replay_all", is_flag=True, help="Every dead letter (of the filters).")
@_json_option
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
    with _hooks(store) as hooks, _errors(store):
        done = hooks.replay(
            list(delivery_ids) or None, endpoint_id=endpoint_id, event_type=event_type
        )
        if as_json:
            _emit([d.to_dict() for d in done])
        else:
            click.echo(f"replayed {len(done)} deliveries")


@dlq.command("purge")
@store_option
@click.option("--endpoint", "endpoint_id", default=None)
@click.option("--event-type", default=None)
@click.option("--older-than", type=click.FloatRange(min=0), default=0.0, help="Seconds.")
@click.option("--yes", is_flag=True, help="Do not ask.")
@_json_option
def dlq_purge(
    store: str,
    endpoint_id: str | None,
    event_type: str | None,
    older_than: float,
    yes: bool,
    as_json: bool,
) -> None:
    """Delete dead letters and their attempts."""
    if not yes:
        click.confirm("delete these dead letters and their attempts?", abort=True)
    with _hooks(store) as hooks, _errors(store):
        n = hooks.purge(endpoint_id=endpoint_id, event_type=event_type, older_than=older_than)
        if as_json:
            _emit({"purged": n})
        else:
            click.echo(f"purged {n} dead letters")


# ---------------------------------------------------------------------- worker
@webhooks.command("worker")
@store_option
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--until-idle", is_flag=True, help="Exit once nothing is pending.")
@_allow_option
def worker(store: str, concurrency: int, until_idle: bool, allow_private: bool) -> None:
    """Deliver webhooks; one JSON line per attempt (event, endpoint, attempt, status,
    latency, outcome) on stdout. SIGTERM stops gracefully."""
    log = logging.getLogger("retrysafe.webhooks")
    handler = _JsonLines()
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        with _hooks(store, allow_private) as hooks, _errors(store):
            for endpoint, exc in hooks.refused_endpoints():
                click.echo(
                    f"retrysafe: warning: endpoint {endpoint.id} will not be delivered to: "
                    f"{exc} (pass --allow-private to this worker too)",
                    err=True,
                )
            w = hooks.worker(concurrency=concurrency)
            try:
                w.run(until_idle=until_idle, handle_signals=True)
            except KeyboardInterrupt:
                raise SystemExit(130) from None
            finally:
                w.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
