"""``retrysafe gateway``: idempotency in front of any HTTP upstream, in any language."""

from __future__ import annotations

import logging

import click

from retrysafe._exceptions import ConfigurationError, RetrysafeError
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
    default=10.0,
    show_default=True,
    help="Seconds a claim holds without renewal: how long a crashed gateway blocks a key. "
    "A live request renews it, however long the upstream takes.",
)
@click.option(
    "--heartbeat",
    type=float,
    default=None,
    help="Seconds between lease renewals  [default: lease/3].",
)
@click.option(
    "--max-run-time",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds after which a request's lease is no longer renewed (a wedged request).",
)
@click.option(
    "--methods",
    default="POST,PATCH",
    show_default=True,
    metavar="M1,M2",
    help="Comma-separated methods to protect, e.g. POST,PATCH,PUT,DELETE.",
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
    help="Total seconds per upstream request, from sending it to the last body byte; "
    "past it the client gets 504 and the key is kept as outcome-unknown.",
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
    "--allow-memory-store",
    is_flag=True,
    help="Accept --store memory:// (for tests only: a restart forgets every key).",
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
    heartbeat: float | None,
    max_run_time: float,
    methods: str,
    retention: float,
    timeout: float,
    key_required: bool,
    max_body_size: int,
    max_replay_size: int,
    replay_header: tuple[str, ...],
    store_server_errors: bool,
    in_progress_wait: float,
    fail_open: bool,
    allow_memory_store: bool,
    log_level: str,
) -> None:
    """Run a reverse proxy that gives UPSTREAM idempotency keys.

    Every POST/PATCH (see --methods) carrying an Idempotency-Key runs once upstream; repeats
    get the stored answer with Idempotent-Replayed: true. One JSON log line per decision goes
    to stderr.

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
    configure_json_logging(logging.WARNING, logger="uvicorn")
    # Warnings (a dangerous but valid option) become JSON lines too: stderr stays parseable.
    logging.captureWarnings(True)
    configure_json_logging(logging.WARNING, logger="py.warnings")
    protected = [m.strip().upper() for m in methods.split(",") if m.strip()]
    if store.strip().lower().startswith("memory:") and not allow_memory_store:
        fail(
            "--store memory:// keeps keys in this process only: a restart forgets them and "
            "retries run the effect again. Use sqlite:///FILE, postgresql://… or redis://…, "
            "or pass --allow-memory-store for tests.",
            2,
        )
    try:
        proxy = ReverseProxy(upstream, timeout=timeout)
        # Every option is checked before the store is opened: a typo never creates a store.
        config = IdempotencyConfig(
            protected_methods=protected,
            lease=lease,
            heartbeat=heartbeat,
            max_run_time=max_run_time,
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
    except ConfigurationError as exc:
        # Name the flag the user typed, not the Python field behind it.
        option = {"protected_methods": "methods", "replay_headers": "replay-header"}.get(
            exc.option or "", (exc.option or "").replace("_", "-")
        )
        fail(f"--{option}: {exc}" if option else str(exc), 2)
    except RetrysafeError as exc:
        fail(str(exc), 2)
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
        log_config=None,  # uvicorn's own lines go through the JSON handler too
        access_log=False,
        lifespan="on",
        # The upstream's own Date and Server headers pass through; don't add a second pair.
        server_header=False,
        date_header=False,
    )
