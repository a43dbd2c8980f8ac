"""``retrysafe ui``: the operator console (:mod:`retrysafe.ui`) on a local port."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import closing
from typing import Any

import click

from retrysafe.cli._common import (
    EXIT_USAGE,
    KEY_STORES,
    SCHEMA_ENV,
    Number,
    SchemaName,
    canonical_scheme,
    check_port_free,
    epilog,
    errors,
    fail,
    opened_store,
    parse_listen,
    remember_schema,
    store_option,
)
from retrysafe.cli._signals import Signals, Stopper, quiet_server, server_config

__all__ = ["TOKEN_ENV", "ui"]

#: Seconds cancelled requests get to give their jobs back before the process exits.
_CLEANUP = 1.5
TOKEN_ENV = "RETRYSAFE_UI_TOKEN"  # noqa: S105 - the variable's name, not a token


@click.command("ui", epilog=epilog())
@store_option(schemes=KEY_STORES)
@click.option(
    "--listen",
    default="127.0.0.1:8090",
    show_default=True,
    metavar="HOST:PORT",
    help="Address to serve on; a non-loopback address needs --token.",
)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    metavar="TEXT",
    help=f"Access token (16–512 visible ASCII characters): every page then needs it. Prefer "
    f"env {TOKEN_ENV}: a --token value shows in `ps`.",
)
@click.option(
    "--schema",
    envvar=SCHEMA_ENV,
    type=SchemaName(),
    default=None,
    callback=remember_schema,
    help="PostgreSQL schema holding retrysafe's tables (default public).",
)
@click.option(
    "--prefix",
    default=None,
    metavar="TEXT",
    help="Redis key prefix the middleware's keys are under (default retrysafe:).",
)
@click.option(
    "--reconcile-timeout",
    type=Number(high=600),
    default=10.0,
    show_default=True,
    help="Seconds per reconcile attempt.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def ui(
    store: str,
    listen: str,
    token: str | None,
    schema: str | None,
    prefix: str | None,
    reconcile_timeout: float,
    log_level: str,
) -> None:
    """Serve the operator console: jobs, dead letters, webhooks, agent runs and keys.

    Actions (reconcile, retry, purge, webhook replay, enable/disable) go through a
    confirmation page and are written to stderr as JSON log lines with what they changed.

    \b
    Example:
      retrysafe ui --store sqlite:///app.db          # then open http://127.0.0.1:8090/
      RETRYSAFE_UI_TOKEN=$(openssl rand -hex 24) \\
        retrysafe ui --store postgresql://… --listen 0.0.0.0:8090

    \b
    Exit status:
      1    the console could not start (port in use, store unreachable)
      2    bad options or --store, or a non-loopback --listen without --token
      130  stopped by SIGINT (Ctrl-C)
      143  stopped by SIGTERM
    """
    from retrysafe._logging import configure_json_logging, logging_snapshot
    from retrysafe.stores._url_check import redact_url
    from retrysafe.ui import console_app
    from retrysafe.ui._security import is_loopback_host

    host, port = parse_listen(listen)
    if schema is not None and canonical_scheme(store) != "postgresql":
        fail("--schema: only a postgresql:// store has a schema", EXIT_USAGE)
    if prefix is not None and canonical_scheme(store) not in ("redis", "redis+cluster"):
        fail("--prefix: only a redis:// store has a key prefix", EXIT_USAGE)
    if host.lower() == "localhost":
        # Bound and shown as 127.0.0.1: a browser tries localhost on [::1] first, where
        # another local user could listen on the same port and collect the token.
        host = "127.0.0.1"
    if token is not None and not token.strip():
        token = None
    if not is_loopback_host(host) and token is None:
        raise click.BadParameter(
            f"{host} is not a loopback address: anyone who reaches it could change jobs. "
            f"Give a token (--token, or ${TOKEN_ENV}), or listen on 127.0.0.1",
            param_hint="--listen",
        )
    restore = logging_snapshot("retrysafe", "uvicorn", "py.warnings")
    click.get_current_context().call_on_close(restore)
    configure_json_logging(getattr(logging, log_level.upper()))
    configure_json_logging(logging.WARNING, logger="uvicorn")
    check_port_free(host, port)
    stopper = Stopper()
    with (
        Signals(on_signal=stopper) as signals,
        errors(store, flags={"store": "--store", "token": "--token", "schema": "--schema"}),
        _opened(store, schema, prefix) as opened,
    ):
        app = console_app(
            opened,
            token=token,
            reconcile_timeout=reconcile_timeout,
            # Behind a token the Host check is the token's job; on loopback it stops
            # DNS rebinding.
            loopback_only=token is None,
            # Two consoles on two schemas of one database must not look alike.
            store_name=redact_url(store) + (f" (schema {schema})" if schema else ""),
        )
        server = stopper.server = quiet_server(
            server_config(
                app,
                host,
                port,
                lifespan="off",
                # The action log records the peer's address: never one a request claims
                # (X-Forwarded-For) — any local process could forge it.
                proxy_headers=False,
            )
        )
        shown_host = f"[{host}]" if ":" in host else host
        if signals.received is None:
            logging.getLogger("retrysafe.ui").info(
                "console listening",
                extra={
                    "url": f"http://{shown_host}:{port}/",
                    "store": redact_url(store),
                    **({"schema": schema} if schema else {}),
                    "token": token is not None,
                    "pid": os.getpid(),
                },
            )
            asyncio.run(_serve(server))
    if signals.received is not None:
        logging.getLogger("retrysafe.ui").info("console stopped", extra={"signal": signals.name})
        raise SystemExit(signals.exit_code)
    if not server.started:
        fail(f"the console could not start on {host}:{port}")


async def _serve(server: Any) -> None:
    """uvicorn's ``serve``, then the cleanup of the requests its shutdown cancelled: a
    cancelled reconcile gives its jobs back (UNKNOWN) in its ``except CancelledError``, which
    needs the loop for a moment more — ``asyncio.run`` would cancel that cleanup too."""
    await server.serve()
    pending = [t for t in server.server_state.tasks if not t.done()]
    if pending:
        await asyncio.wait(pending, timeout=_CLEANUP)


def _opened(store: str, schema: str | None, prefix: str | None) -> Any:
    """The existing store (never created); on PostgreSQL in ``schema``, on Redis under
    ``prefix``, when given."""
    from retrysafe import stores

    if schema is not None:
        return closing(stores.open_store(store, schema=schema, create=False))
    if prefix is not None:
        return closing(stores.open_store(store, prefix=prefix))
    return opened_store(store, write=True)
