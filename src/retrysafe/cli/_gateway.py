"""``retrysafe gateway``: idempotency in front of any HTTP upstream, in any language."""

from __future__ import annotations

import dataclasses
import logging
import re

import click

from retrysafe.cli._common import (
    KEY_STORES,
    Number,
    check_port_free,
    clip,
    epilog,
    errors,
    fail,
    metrics_option,
    parse_listen,
    serving_metrics,
    store_option,
)
from retrysafe.cli._keys import check_scoping, scoping_options
from retrysafe.cli._signals import Signals, Stopper, quiet_server, server_config
from retrysafe.client._jobs import shown_url

__all__ = ["gateway"]

# An HTTP method or header name (RFC 9110 token), of a sane length.
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
# ConfigurationError.option (IdempotencyConfig's fields, ReverseProxy's) -> the flag to name.
_FLAGS = {
    "upstream": "--upstream",
    "timeout": "--timeout",
    "protected_methods": "--methods",
    "replay_headers": "--replay-header",
    "store": "--store",
    "schema": "--schema",
    "prefix": "--prefix",
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            "lease",
            "heartbeat",
            "max_run_time",
            "retention",
            "max_body_size",
            "max_replay_size",
            "in_progress_wait",
        )
    },
}


@click.command(epilog=epilog())
@click.option("--upstream", required=True, metavar="URL", help="The service to protect.")
@click.option(
    "--listen",
    default="127.0.0.1:8080",
    show_default=True,
    metavar="HOST:PORT",
    help="Address the gateway listens on.",
)
@store_option(schemes=(*KEY_STORES, "memory"))
@scoping_options
@click.option(
    "--lease",
    type=Number(),
    default=10.0,
    show_default=True,
    help="Seconds a claim holds without renewal: how long a crashed gateway blocks a key. "
    "A live request renews it, however long the upstream takes.",
)
@click.option(
    "--heartbeat",
    type=Number(),
    default=None,
    help="Seconds between lease renewals  [default: lease/3].",
)
@click.option(
    "--max-run-time",
    type=Number(),
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
    type=Number(),
    default=86400.0,
    show_default=True,
    help="Seconds a completed key is remembered.",
)
@click.option(
    "--timeout",
    type=Number(),
    default=30.0,
    show_default=True,
    help="Total seconds per upstream request, from sending it to the last body byte (the "
    "time the client takes to read the answer not counted); past it the client gets 504 "
    "(502 when no upstream connection came free for it: never sent, its key released). "
    "An answer head still missing is then awaited while the key is renewed (up to "
    "--max-run-time, which must not be shorter) and recorded for the retry; else the key "
    "is kept as outcome-unknown.",
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
    type=Number(zero=True),
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
@metrics_option
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
    schema: str | None,
    prefix: str | None,
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
    metrics_address: str | None,
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

    \b
    Exit status:
      1    the gateway could not start (port in use, store unreachable)
      2    bad options or --store, or an upstream that is the gateway's
           own --listen address (nothing was started)
      130  stopped by SIGINT (Ctrl-C)
      143  stopped by SIGTERM

    On SIGINT or SIGTERM it stops accepting, gives in-flight requests 3 seconds, closes the
    store and exits within 5 seconds (a second signal stops it at once). A request cut short
    keeps its key claimed until the lease ends, as if the gateway had crashed; so does one
    answered 504 whose upstream answer it still awaited (a retry after the lease sends it
    again).
    """
    import httpx

    from retrysafe._addresses import reaches_listener
    from retrysafe._logging import configure_json_logging, logging_snapshot
    from retrysafe.server import IdempotencyConfig, IdempotencyMiddleware
    from retrysafe.server._gateway import ReverseProxy
    from retrysafe.stores import open_store

    host, port = parse_listen(listen)
    restore = logging_snapshot("retrysafe", "uvicorn", "py.warnings")

    def restore_logging() -> None:
        logging.captureWarnings(False)
        restore()

    click.get_current_context().call_on_close(restore_logging)
    configure_json_logging(getattr(logging, log_level.upper()))
    configure_json_logging(logging.WARNING, logger="uvicorn")
    # Warnings (a dangerous but valid option) become JSON lines too: stderr stays parseable.
    logging.captureWarnings(True)
    configure_json_logging(logging.WARNING, logger="py.warnings")
    protected = [m.strip().upper() for m in methods.split(",") if m.strip()]
    for method in protected:
        if not _METHOD.fullmatch(method):
            raise click.BadParameter(
                f"{clip(method, 60)!r} is not an HTTP method name", param_hint="--methods"
            )
    for name in replay_header:
        if not _HEADER.fullmatch(name):
            raise click.BadParameter(
                f"{clip(name, 60)!r} is not an HTTP header name", param_hint="--replay-header"
            )
    _, schema = check_scoping(store, schema, prefix)
    if store.strip().lower().startswith("memory:") and not allow_memory_store:
        fail(
            "--store memory:// keeps keys in this process only: a restart forgets them and "
            "retries run the effect again. Use sqlite:///FILE, postgresql://… or redis://…, "
            "or pass --allow-memory-store for tests.",
            2,
        )
    with errors(flags=_FLAGS):
        proxy = ReverseProxy(upstream, timeout=timeout)
        target = httpx.URL(proxy.upstream)
        target_port = target.port or (443 if target.scheme == "https" else 80)
        if reaches_listener(target.host, target_port, listen_host=host, listen_port=port):
            raise click.BadParameter(
                f"{upstream} is the gateway's own --listen address {listen}: every request "
                "would be forwarded to the gateway itself, without end",
                param_hint="--upstream",
            )
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
    longest = config.lease_timing.max_run_time
    if timeout > longest:
        # Renewal would stop while the gateway still waits for the upstream: once the lease
        # ran out, a retry could take the key over and send the request a second time.
        raise click.BadParameter(
            f"{timeout:g} s is longer than --max-run-time ({longest:g} s): the key would "
            "stop being renewed while the gateway still waits for the "
            "upstream, and a retry could send the request again; raise --max-run-time or "
            "lower --timeout",
            param_hint="--timeout",
        )
    metrics_socket = None
    if metrics_address is not None:
        metrics_socket = metrics_host, metrics_port = parse_listen(
            metrics_address, option="--metrics"
        )
        # The same socket however it is spelled (localhost, 0.0.0.0, a wildcard --listen):
        # a usage error, so it is told before whether either port is free (exit 2, not 1).
        if reaches_listener(
            metrics_host, metrics_port, listen_host=host, listen_port=port
        ) or reaches_listener(host, port, listen_host=metrics_host, listen_port=metrics_port):
            raise click.BadParameter(
                f"{metrics_address} is the gateway's own --listen address {listen}",
                param_hint="--metrics",
            )
    check_port_free(host, port)  # before the store: a taken port creates no store either
    if metrics_socket is not None:
        check_port_free(*metrics_socket, option="--metrics", code=2)

    stopper = Stopper()
    with Signals(on_signal=stopper) as signals:
        with errors(store, flags=_FLAGS):  # a bad URL exits 2, an unreachable store 1
            # Its own schema or prefix: a gateway and the service behind it may share one
            # PostgreSQL database or one Redis (docs/stores.md) without sharing keys.
            scoping = {"schema": schema, "prefix": prefix}  # check_scoping: one at most
            key_store = open_store(store, **{k: v for k, v in scoping.items() if v is not None})
        try:
            with serving_metrics(metrics_address, key_store, log=True) as metrics:
                if metrics is not None:
                    config = dataclasses.replace(config, telemetry=metrics)
                app = IdempotencyMiddleware(proxy, store=key_store, config=config)
                server = stopper.server = quiet_server(
                    server_config(
                        app,
                        host,
                        port,
                        lifespan="on",
                        # The upstream's own Date header passes through.
                        date_header=False,
                        # The peer is the peer: uvicorn would take a loopback client's
                        # X-Forwarded-For as its address (the gateway adds the peer to it).
                        proxy_headers=False,
                    )
                )
                if signals.received is None:
                    logging.getLogger("retrysafe.gateway").info(
                        "gateway listening",
                        extra={
                            "listen": f"{host}:{port}",
                            "upstream": shown_url(proxy.upstream),
                            "store": store,
                        },
                    )
                    server.run()
        finally:
            key_store.close()
    if signals.received is not None:
        logging.getLogger("retrysafe.gateway").info(
            "gateway stopped", extra={"signal": signals.name}
        )
        raise SystemExit(signals.exit_code)
    if not server.started:
        fail(f"the gateway could not start on {host}:{port}")
