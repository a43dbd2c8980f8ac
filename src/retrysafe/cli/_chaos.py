"""``retrysafe chaos proxy``: put a fault-injecting proxy in front of any HTTP API (SPEC §8)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from retrysafe._exceptions import ConfigurationError
from retrysafe.cli._common import Number, epilog, errors, fail, json_option, parse_listen
from retrysafe.cli._signals import SHUTDOWN_SECONDS, Signals

if TYPE_CHECKING:
    from retrysafe.chaos import ChaosProxy

__all__ = ["chaos"]

_RATE = Number(zero=True, high=1.0, unit="a probability")
_F = TypeVar("_F", bound=Callable[..., Any])
_MAX_SEED = 2**32 - 1
_MAX_SECONDS = 86400.0
_MAX_LATENCY_MS = 600_000.0
_MAX_PATH = 4096


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
    if not (math.isfinite(low) and math.isfinite(high)):
        raise click.BadParameter(
            f"{value!r}: MIN and MAX must be finite numbers", param_hint="--latency-ms"
        )
    if low < 0 or high < low or high > _MAX_LATENCY_MS:
        raise click.BadParameter(
            f"{value!r}: need 0 <= MIN <= MAX <= {_MAX_LATENCY_MS:g} milliseconds",
            param_hint="--latency-ms",
        )
    return low / 1000.0, high / 1000.0


def _check_log(path: Path | None) -> Path | None:
    """The ``--log`` file: a path that is not empty, not a directory, not absurdly long."""
    if path is None:
        return None
    text = str(path)
    if not text.strip() or text == ".":
        raise click.BadParameter("the path is empty", param_hint="--log")
    if len(text) > _MAX_PATH:
        raise click.BadParameter(
            f"the path is {len(text)} characters long, over {_MAX_PATH}", param_hint="--log"
        )
    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise click.BadParameter(
            f"cannot use {text}: {exc.strerror or exc}", param_hint="--log"
        ) from None
    if is_dir:
        raise click.BadParameter(f"{text} is a directory", param_hint="--log")
    return path


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


@click.group(epilog=epilog())
def chaos() -> None:
    """Fault injection: prove that your client's retries are safe."""


@chaos.command(epilog=epilog())
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
    type=click.IntRange(0, _MAX_SEED),
    default=None,
    help="Seed of the fault RNG (one draw per request); random if omitted, and printed.",
)
@_rate_options
@click.option(
    "--hold-seconds",
    type=Number(high=_MAX_SECONDS),
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
    type=Number(high=_MAX_SECONDS),
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
@json_option
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
    as_json: bool,
) -> None:
    """Run a fault-injecting HTTP proxy in front of UPSTREAM until Ctrl-C or SIGTERM.

    Each request gets at most one fault, chosen with a seeded RNG; the rates of the faults
    must sum to at most 1. On exit, prints how many requests got each fault (with --json,
    as one JSON object).

    \b
    Exit status:
      1    the proxy could not start (port in use, log file not writable)
      2    bad options, or an upstream that is the proxy's own --listen
           address (nothing was started)
      130  stopped by SIGINT (Ctrl-C), after printing the summary
      143  stopped by SIGTERM, after printing the summary

    It stops within 5 seconds of the signal, dropping open connections.
    """
    from retrysafe._addresses import reaches_listener
    from retrysafe.chaos import ChaosProxy, FaultRates

    host, port = parse_listen(listen)
    latency_seconds = _parse_latency_ms(latency_ms)
    log_path = _check_log(log_path)
    with errors(flags=_FLAGS):
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
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    with errors(flags=_FLAGS):
        chaos_proxy = ChaosProxy(
            upstream,
            rates=rates,
            seed=seed,
            host=host,
            port=port,
            log_path=log_path,
            upstream_timeout=upstream_timeout,
        )
    target = chaos_proxy.upstream
    target_port = target.port or (443 if target.scheme == "https" else 80)
    if reaches_listener(target.host, target_port, listen_host=host, listen_port=port):
        raise click.BadParameter(
            f"{upstream} is the proxy's own --listen address {listen}: every request would "
            "be forwarded to the proxy itself, without end",
            param_hint="--upstream",
        )

    with Signals() as signals:
        try:
            chaos_proxy.start_in_thread()
        except ConfigurationError as exc:  # the port is taken, the log cannot be opened
            if exc.option == "upstream":  # checked above; the library checks again once bound
                fail(f"--upstream: {exc}", 2)
            fail(str(exc))
        try:
            click.echo(f"chaos proxy on {chaos_proxy.url} -> {upstream} (seed {seed})", err=True)
            active = {k: v for k, v in rates.to_dict().items() if v and k not in _DURATIONS}
            click.echo(f"fault rates: {json.dumps(active) if active else 'none'}", err=True)
            if signals.received is None:
                problem = chaos_proxy.probe_upstream(timeout=1.0)
                if problem is not None:
                    click.echo(
                        f"retrysafe: warning: {problem}; every forwarded request will get a 502 "
                        "until it is up",
                        err=True,
                    )
            click.echo("press Ctrl-C to stop", err=True)
            while not signals.wait(0.5):
                pass
        finally:
            # Within the 5 s even after a slow probe: the proxy's own shutdown waits at most
            # ~2 s for its connections, and its thread is a daemon.
            chaos_proxy.close(timeout=SHUTDOWN_SECONDS - 2.0)
        _summary(chaos_proxy, seed, signals, as_json=as_json)
    raise SystemExit(signals.exit_code or 0)


def _summary(chaos_proxy: ChaosProxy, seed: int, signals: Signals, *, as_json: bool) -> None:
    """The exit summary on stdout: counts per fault, as text or one JSON object."""
    from retrysafe.chaos import Fault

    stats = chaos_proxy.stats()
    if as_json:
        doc = {"seed": seed, **stats.to_dict(), "stopped_by": signals.name}
        click.echo(json.dumps(doc, separators=(",", ":")))
        return
    click.echo(f"{stats.requests} requests (seed {seed})")
    for fault in Fault:
        click.echo(f"  {fault.value:<22} {stats.by_fault[fault]}")
    click.echo(f"  {'latency added':<22} {stats.latency_added}")
    click.echo(f"  {'upstream errors (502)':<22} {stats.upstream_errors}")


_DURATIONS = frozenset({"hold_seconds", "latency_seconds"})
# ConfigurationError.option (FaultRates' fields, ChaosProxy's arguments) -> the flag to name.
_FLAGS = {
    **{flag[2:].replace("-", "_"): flag for flag, _ in _RATE_OPTIONS},
    "hold_seconds": "--hold-seconds",
    "latency_seconds": "--latency-ms",
    "upstream": "--upstream",
    "log": "--log",
}
