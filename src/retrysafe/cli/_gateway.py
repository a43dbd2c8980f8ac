"""``retrysafe gateway``: idempotency in front of any HTTP upstream, in any language."""

from __future__ import annotations

import logging

import click

from retrysafe._exceptions import RetrysafeError
from retrysafe.cli._common import check_port_free, fail, parse_listen, store_option

__all__ = ["gateway"]


@click.command()
@click.option("--upstream", required=True, metavar="URL", help="The service to protect.")
@click.option(
    "--listen",
    default="127.0.0.1:8080",
    show_default=True,
    metavar="HOST:PORT",
    help="Address the gateway listens on.",
)
@store_option
@click.option(
    "--lease",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds a request may run before another attempt may take over.",
)
@click.option(
    "--retention",
    type=float,
    default=86400.0,
    show_default=True,
    help="Seconds a completed key is remembered.",
)
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for the upstream (connect and each read).",
)
@click.option(
    "--key-required/--key-optional",
    default=False,
    show_default=True,
    help="Answer 400 missing-key to POST/PATCH requests without Idempotency-Key.",
)
@click.option(
    "--max-body-size",
    type=int,
    default=1 << 20,
    show_default=True,
    help="Largest request body in bytes (413 above).",
)
@click.option(
    "--max-replay-size",
    type=int,
    default=1 << 20,
    show_default=True,
    help="Largest response body in bytes kept for replay.",
)
@click.option(
    "--replay-header",
    multiple=True,
    metavar="NAME",
    help="Extra response header to store and replay (repeatable).",
)
@click.option(
    "--store-server-errors",
    is_flag=True,
    help="Store 5xx answers too (Stripe's behaviour) instead of releasing the key.",
)
@click.option(
    "--in-progress-wait",
    type=float,
    default=0.0,
    show_default=True,
    help="Seconds a duplicate waits for the first attempt before 409.",
)
@click.option(
    "--fail-open",
    is_flag=True,
    help="If the store is down, forward unprotected instead of answering 503.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def gateway(
    upstream: str,
    listen: str,
    store: str,
    lease: float,
    retention: float,
    timeout: float,
    key_required: bool,
    max_body_size: int,
    max_replay_size: int,
    replay_header: tuple[str, ...],
    store_server_errors: bool,
    in_progress_wait: float,
    fail_open: bool,
    log_level: str,
) -> None:
    """Run a reverse proxy that gives UPSTREAM idempotency keys.

    Every POST/PATCH carrying an Idempotency-Key runs once upstream; repeats get the stored
    answer with Idempotent-Replayed: true. One JSON log line per decision goes to stderr.

    \b
    Example:
      retrysafe gateway --upstream http://127.0.0.1:8000 \\
          --listen 127.0.0.1:8080 --store sqlite:///keys.db
    """
    import uvicorn

    from retrysafe._logging import configure_json_logging
    from retrysafe.server import IdempotencyConfig, IdempotencyMiddleware
    from retrysafe.server._gateway import ReverseProxy
    from retrysafe.stores import open_store

    host, port = parse_listen(listen)
    configure_json_logging(getattr(logging, log_level.upper()))
    try:
        proxy = ReverseProxy(upstream, timeout=timeout)
        # Every option is checked before the store is opened: a typo never creates a store.
        config = IdempotencyConfig(
            lease=lease,
            retention=retention,
            key_required=key_required,
            max_body_size=max_body_size,
            max_replay_size=max_replay_size,
            replay_headers=tuple(replay_header),
            store_server_errors=store_server_errors,
            in_progress_wait=in_progress_wait,
            fail_open=fail_open,
        )
        key_store = open_store(store)
        app = IdempotencyMiddleware(proxy, store=key_store, config=config)
    except RetrysafeError as exc:
        fail(str(exc))
    check_port_free(host, port)
    logging.getLogger("retrysafe.gateway").info(
        "gateway listening",
        extra={"listen": f"{host}:{port}", "upstream": proxy.upstream, "store": store},
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        # The upstream's own Date and Server headers pass through; don't add a second pair.
        server_header=False,
        date_header=False,
    )
