"""``retrysafe chaos proxy``: put a fault-injecting proxy in front of any HTTP API (SPEC §8)."""

from __future__ import annotations

import json
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import click

from retrysafe._exceptions import ConfigurationError
from retrysafe.cli._common import fail, parse_listen

__all__ = ["chaos"]

_RATE = click.FloatRange(0.0, 1.0)
_F = TypeVar("_F", bound=Callable[..., Any])


def _parse_latency_ms(value: str) -> tuple[float, float]:
    """``MIN-MAX`` or ``MS`` in milliseconds → ``(min, max)`` in seconds."""
    low_text, sep, high_text = value.partition("-")
    try:
        low = float(low_text)
        high = float(high_text) if sep else low
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not MIN-MAX in milliseconds (e.g. 50-200)", param_hint="--latency-ms"
        ) from None
    if low < 0 or high < low:
        raise click.BadParameter(
            f"{value!r}: need 0 <= MIN <= MAX milliseconds", param_hint="--latency-ms"
        )
    return low / 1000.0, high / 1000.0


# One option per fault rate, in this order in --help: (flag, what it does).
_RATE_OPTIONS = (
    ("--lose-after-commit", "Close the connection after the upstream answered in full."),
    ("--hold-after-commit", "Hold the upstream's answer --hold-seconds before sending it."),
    ("--error-after-commit", "Replace the upstream's answer with 503."),
    ("--reset-before-forward", "Reset the connection (TCP RST) without forwarding."),
    ("--error-before-forward", "Answer 503 without forwarding."),
    ("--latency", "Add latency before forwarding (independent of the faults above)."),
)


def _rate_options(fn: _F) -> _F:
    """Add the fault-rate options (each a probability per request, default 0)."""
    for flag, text in reversed(_RATE_OPTIONS):
        option = click.option(
            flag, type=_RATE, default=0.0, show_default=True, metavar="RATE", help=text
        )
        fn = option(fn)
    return fn


@click.group()
def chaos() -> None:
    """Fault injection: prove that your client's retries are safe."""


@chaos.command()
@click.option("--upstream", required=True, metavar="URL", help="The API to put faults in front of.")
@click.option(
    "--listen",
    default="127.0.0.1:8899",
    show_default=True,
    metavar="HOST:PORT",
    help="Address the proxy listens on; point your client here.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the fault RNG (one draw per request); random if omitted, and printed.",
)
@_rate_options
@click.option(
    "--hold-seconds",
    type=click.FloatRange(min=0.0, min_open=True),
    default=30.0,
    show_default=True,
    help="How long a held answer waits (longer than your client's timeout).",
)
@click.option(
    "--latency-ms",
    default="50-200",
    show_default=True,
    metavar="MIN-MAX",
    help="Added latency range in milliseconds.",
)
@click.option(
    "--upstream-timeout",
    type=click.FloatRange(min=0.0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds to wait for the upstream before answering 502.",
)
@click.option(
    "--log",
    "log_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Append one JSON line per request to this file (its directory must exist).",
)
def proxy(
    upstream: str,
    listen: str,
    seed: int | None,
    lose_after_commit: float,
    hold_after_commit: float,
    hold_seconds: float,
    error_after_commit: float,
    reset_before_forward: float,
    error_before_forward: float,
    latency: float,
    latency_ms: str,
    upstream_timeout: float,
    log_path: Path | None,
) -> None:
    """Run a fault-injecting HTTP proxy in front of UPSTREAM until Ctrl-C.

    Each request gets at most one fault, chosen with a seeded RNG; the rates of the faults
    must sum to at most 1. On exit, prints how many requests got each fault.
    """
    from retrysafe.chaos import ChaosProxy, Fault, FaultRates

    host, port = parse_listen(listen)
    latency_seconds = _parse_latency_ms(latency_ms)
    try:
        rates = FaultRates(
            lose_after_commit=lose_after_commit,
            hold_after_commit=hold_after_commit,
            error_after_commit=error_after_commit,
            reset_before_forward=reset_before_forward,
            error_before_forward=error_before_forward,
            latency=latency,
            latency_seconds=latency_seconds,
            hold_seconds=hold_seconds,
        )
    except ConfigurationError as exc:
        hint = f"--{exc.option.replace('_', '-')}" if exc.option else None
        raise click.BadParameter(str(exc), param_hint=hint) from None
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    try:
        chaos_proxy = ChaosProxy(
            upstream,
            rates=rates,
            seed=seed,
            host=host,
            port=port,
            log_path=log_path,
            upstream_timeout=upstream_timeout,
        )
    except ConfigurationError as exc:
        hint = "--log" if exc.option == "log" else "--upstream"
        raise click.BadParameter(str(exc), param_hint=hint) from None
    try:
        chaos_proxy.start_in_thread()
    except ConfigurationError as exc:
        fail(str(exc))

    stopped = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.set()

    # Ctrl-C and SIGTERM both stop the proxy cleanly, even where SIGINT was inherited ignored.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if in_main_thread
        else {}
    )
    try:
        click.echo(
            f"chaos proxy on {chaos_proxy.url} -> {upstream} (seed {seed})",
            err=True,
        )
        active = {k: v for k, v in rates.to_dict().items() if v and k not in _DURATIONS}
        click.echo(f"fault rates: {json.dumps(active) if active else 'none'}", err=True)
        problem = chaos_proxy.probe_upstream()
        if problem is not None:
            click.echo(
                f"retrysafe: warning: {problem}; every forwarded request will get a 502 "
                "until it is up",
                err=True,
            )
        click.echo("press Ctrl-C to stop", err=True)
        try:
            while not stopped.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        chaos_proxy.close()

    stats = chaos_proxy.stats()
    click.echo(f"{stats.requests} requests (seed {seed})")
    for fault in Fault:
        click.echo(f"  {fault.value:<22} {stats.by_fault[fault]}")
    click.echo(f"  {'latency added':<22} {stats.latency_added}")
    click.echo(f"  {'upstream errors (502)':<22} {stats.upstream_errors}")


_DURATIONS = frozenset({"hold_seconds", "latency_seconds"})
