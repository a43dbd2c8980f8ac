"""Pieces every subcommand shares: store option, listen addresses, clean error exits."""

from __future__ import annotations

import errno
import socket
from typing import Any, NoReturn

import click

__all__ = ["STORE_ENV", "check_port_free", "fail", "parse_listen", "store_option"]

STORE_ENV = "RETRYSAFE_STORE"
DEFAULT_STORE = "sqlite:///retrysafe.db"


def store_option(fn: Any) -> Any:
    """``--store URL`` (env ``RETRYSAFE_STORE``, default ``sqlite:///retrysafe.db``)."""
    return click.option(
        "--store",
        envvar=STORE_ENV,
        default=DEFAULT_STORE,
        show_default=True,
        metavar="URL",
        help=(
            "Store URL: sqlite:///path.db, postgresql://user@host/db, "
            "redis://host:6379/0 or redis+cluster://host:7000,host:7001 (see docs/stores.md)."
        ),
    )(fn)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``retrysafe: error: <message>`` on stderr and exit ``code`` (no traceback)."""
    click.echo(f"retrysafe: error: {message}", err=True)
    raise SystemExit(code)


def parse_listen(value: str, *, option: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → ``(host, port)``; a usage error names the option."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise click.BadParameter(
            f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", param_hint=option
        )
    return host.strip("[]"), int(port_text)


def check_port_free(host: str, port: int) -> None:
    """Exit with a clear message when ``host:port`` cannot be bound (in use, bad address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                fail(f"cannot listen on {host}:{port}: the port is already in use")
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
