"""The ``retrysafe`` command line. Subcommands load lazily, so ``retrysafe --help`` stays fast
and a subcommand's dependencies are imported only when it runs."""

from __future__ import annotations

import importlib
import warnings
from typing import Any, TextIO

import click

from retrysafe._exceptions import RetrysafeWarning

__all__ = ["main"]

# name -> "module:attribute" of a click command or group.
_COMMANDS: dict[str, str] = {
    "agents": "retrysafe.cli._agents:agents",
    "chaos": "retrysafe.cli._chaos:chaos",
    "demo": "retrysafe.cli._demo:demo",
    "gateway": "retrysafe.cli._gateway:gateway",
    "dlq": "retrysafe.cli._client:dlq",
    "jobs": "retrysafe.cli._client:jobs",
    "migrate": "retrysafe.cli._migrate:migrate",
    "reconcile": "retrysafe.cli._client:reconcile_command",
    "webhooks": "retrysafe.cli._webhooks:webhooks",
    "worker": "retrysafe.cli._client:worker",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module, _, attr = _COMMANDS[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="retrysafe")
def cli() -> None:
    """Make side-effecting calls safe to retry across networks that lose answers."""
    warnings.showwarning = _show_warning


_default_showwarning = warnings.showwarning


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A :class:`~retrysafe.RetrysafeWarning` is one line for a person, not a source location."""
    if issubclass(category, RetrysafeWarning):
        click.echo(f"retrysafe: warning: {message}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> Any:
    """Console entry point."""
    return cli.main(args=argv, prog_name="retrysafe")
